"""The one KV interface: the scheduler admits into and plans over either KV cache through the same
verbs; chunks carry a slot (slots) or a block table (paged KV), never a sentinel; the engine has no
KV-mode branch; fault names are typed at their use sites."""

import ast
from pathlib import Path

from helpers import make_engine

from kvtui.config import EngineConfig
from kvtui.engine import Engine, SamplingParams
from kvtui.engine.batching import build_batch
from kvtui.engine.kv_cache import KVCache
from kvtui.engine.paged import PagedCache
from kvtui.engine.slot_cache import SlotCache
from kvtui.faults import FAULT_NAMES, FaultName

ENGINE = Path(__file__).parents[2] / "kvtui" / "engine"


def engine_for(loaded, **kw) -> Engine:
    engine = make_engine(loaded.model, EngineConfig(num_slots=2, max_len=32), **kw)
    engine.submit("a", [5, 6, 7, 8, 9, 10], SamplingParams(max_new_tokens=3))
    engine.submit("b", [11, 12, 13], SamplingParams(max_new_tokens=3))
    return engine


def test_slot_chunks_carry_their_slot_and_no_blocks(tiny):
    engine = engine_for(tiny["tiny-llama"])
    assert isinstance(engine.scheduler.kv, SlotCache)
    assert [r.request_id for r in engine.scheduler.admit(0.0)] == ["a", "b"]
    plan = engine.scheduler.plan()
    assert [(c.request.request_id, c.slot, c.blocks, c.start_pos, c.end_pos) for c in plan.chunks] == \
        [("a", 0, None, 0, 6), ("b", 1, None, 0, 3)]
    batch = build_batch(plan, layout="packed", block_size=engine.kv.block_size)
    assert [(s.slot, s.blocks) for s in batch.segments] == [(0, None), (1, None)]


def test_paged_chunks_carry_block_tables_and_slot_none(tiny):
    engine = engine_for(tiny["tiny-llama"], kv="paged", block_size=4, num_blocks=20)
    assert isinstance(engine.scheduler.kv, PagedCache)
    assert [r.request_id for r in engine.scheduler.admit(0.0)] == ["a", "b"]
    plan = engine.scheduler.plan()
    # the free queue hands out its head: a's 6 tokens take blocks 1 and 2, b's 3 tokens block 3
    assert [(c.request.request_id, c.slot, c.blocks, c.end_pos) for c in plan.chunks] == \
        [("a", None, (1, 2), 6), ("b", None, (3,), 3)]
    batch = build_batch(plan, layout="packed", block_size=4)
    assert [(s.slot, s.blocks) for s in batch.segments] == [(None, (1, 2)), (None, (3,))]
    report = engine.step()
    assert [(r.request_id, r.slot, r.blocks) for r in report.running] == [("a", None, (1, 2)), ("b", None, (3,))]


def test_paged_admission_is_bounded_by_max_batch_size_after_reconfigure(tiny):
    engine = engine_for(tiny["tiny-llama"], kv="paged", block_size=4, num_blocks=20)
    engine.reconfigure(max_batch_size=1)
    assert [r.request_id for r in engine.scheduler.admit(0.0)] == ["a"]
    report = engine.step()
    assert (report.num_running, report.max_batch_size, report.num_waiting) == (1, 1, 1)
    assert (report.slots_used, report.num_slots) == (None, None)  # no slots under paged KV


def test_both_caches_implement_every_verb_of_the_interface():
    verbs = sorted(name for name, value in vars(KVCache).items() if callable(value) and not name.startswith("_"))
    assert verbs == ["admit", "checkpoint", "commit", "configure", "ensure", "expected_writers", "finish", "fork",
                     "free_seats", "keep_checkpoint", "preempt", "rejection", "report_fields"]
    missing = [f"{cls.__name__}.{verb}" for cls in (SlotCache, PagedCache) for verb in verbs
               if not callable(getattr(cls, verb, None))]
    assert missing == []


def _functions(tree: ast.AST):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_engine_has_no_kv_mode_branch():
    """Only `_make_kv` reads the KV mode; nothing in Engine asks whether it runs paged."""
    tree = ast.parse((ENGINE / "engine.py").read_text())
    attrs = sorted({n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in ("paged", "blocks")
                    and isinstance(n.value, ast.Name) and n.value.id == "self"})
    assert attrs == []
    readers = sorted({f.name for f in _functions(tree) for n in ast.walk(f)
                      if isinstance(n, ast.Constant) and n.value == "paged"})
    assert readers == ["_make_kv"]
    scheduler = ast.parse((ENGINE / "scheduler.py").read_text())
    assert sorted(f.name for f in _functions(scheduler) if f.name.startswith(("admit", "plan"))) == ["admit", "plan"]


def test_fault_names_are_typed_at_the_engines_use_sites():
    """No fault name is spelled as a bare string in kvtui/engine/ (docstrings aside): FaultName members."""
    bare = [f"{path.name}:{n.lineno} {n.value}" for path in sorted(ENGINE.glob("*.py"))
            for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant) and n.value in FAULT_NAMES]
    assert bare == []
    assert tuple(FaultName) == FAULT_NAMES
    assert [FaultName.STALE_SLOT == "stale_slot", f"{FaultName.BLOCK_REFCOUNT}"] == [True, "block_refcount"]


def test_engine_has_no_model_kind_branch():
    """The model's kind is read where the engine's sides are built (make_encoder_side, and
    state_side.make_state_side for a hybrid's recurrent state); Engine never asks whether its model is an
    encoder-decoder, a hybrid, has an encoder, or what its input carries."""
    tree = ast.parse((ENGINE / "engine.py").read_text())
    tree.body = [n for n in tree.body if getattr(n, "name", None) != "make_encoder_side"]  # the one reader
    kind_words = ("is_encoder_decoder", "encoder_decoder", "ENCODER_DECODER", "DECODER_ONLY", "audio", "images",
                  "embeds", "whisper")
    named = sorted({n.attr if isinstance(n, ast.Attribute) else n.id for n in ast.walk(tree)
                    if isinstance(n, (ast.Attribute, ast.Name)) and (n.attr if isinstance(n, ast.Attribute) else n.id)
                    in kind_words})
    assert named == []
    tests_on_encoder = [ast.unparse(n.test) for n in ast.walk(tree) if isinstance(n, (ast.If, ast.IfExp))
                        and "encoder" in ast.unparse(n.test)]
    assert tests_on_encoder == []
    readers = sorted({f.name for path in sorted(ENGINE.glob("*.py")) for f in _functions(ast.parse(path.read_text()))
                      for n in ast.walk(f) if isinstance(n, ast.Name) and n.id == "model_kind"})
    assert readers == ["make_encoder_side", "make_state_side"]


def test_every_encoder_side_implements_the_protocol_and_the_scheduler_calls_it():
    from kvtui.engine.encoder import CrossAttentionInputs
    from kvtui.engine.encoder_side import EncoderSide, TokenInputs

    verbs = sorted(name for name, value in vars(EncoderSide).items() if callable(value) and not name.startswith("_"))
    assert verbs == ["adjust_logits", "admit", "bind", "configure", "finish", "problem", "report", "submit"]
    missing = [f"{cls.__name__}.{verb}" for cls in (TokenInputs, CrossAttentionInputs) for verb in verbs
               if not callable(getattr(cls, verb, None))]
    assert missing == []
    scheduler = (ENGINE / "scheduler.py").read_text()
    assert [v for v in ("self.encoder.admit(", "self.encoder.bind(", "self.encoder.finish(") if v not in scheduler] == []
    engine = (ENGINE / "engine.py").read_text()
    assert [v for v in (".admit(", ".bind(") if f"encoder{v}" in engine] == []
