"""The recurrent-state faults on the hybrid tiny-qwen35moe: each one, where it acts, makes a request start from
another request's state, and two detectors see it: state_provenance (the engine's note of who computed the
state a request starts from, against its own prefix) names victim <- source, and the reference detector (solo
reruns on a clean engine) sees the answer change. Held-out random scenarios (kvtui/bench/faults.py's hybrid
family, seeds below the bench's 9000) with the fault on and off; engine-level checks against transformers' own
`generate` on a separate instance of the model; the mechanisms one by one (slot zeroing, the published entry,
the tier's state buffer, the index in the wrong units); the detector on real StateStartEntry values; the fault
refusals on hybrid and non-hybrid models.
"""

from __future__ import annotations

import pytest
import torch

from kvtui.bench.faults import RETRY_PROMPTS, STATE, scenario_text
from kvtui.config import EngineConfig
from kvtui.detect.state_provenance import StateProvenanceDetector
from kvtui.engine.block_manager import BlockManager
from kvtui.engine.engine import Engine
from kvtui.engine.request import SamplingParams
from kvtui.engine.state_pool import EMPTY_PREFIX, StateOrigin, StatePool, prefix_digest, state_shape
from kvtui.events import StateStartEntry
from kvtui.faults import FAULTS, acts_on, faults_for
from kvtui.model_kinds import ModelKind
from kvtui.models.hybrid import build_hybrid
from kvtui.scenario import parse_scenario
from kvtui.session import Session

NEW_TOKENS = 6
SEEDS = (100, 101, 102)
# the lighthouse (48 tokens) and the cat (45 tokens) of scenarios/faults/state_published_before_write.yaml
LIGHTHOUSE, CAT = RETRY_PROMPTS.read_text().splitlines()[:2]


@pytest.fixture(scope="module")
def hybrid():
    """(engine model, oracle model, tokenizer): two separate instances of the seeded hybrid."""
    model, tokenizer = build_hybrid()
    oracle, _ = build_hybrid()
    return model, oracle, tokenizer


@pytest.fixture(scope="module")
def loaded():
    from kvtui.models import load_model

    return load_model("tiny-qwen35moe", progress=False)


def generate(oracle, ids: list[int]) -> list[int]:
    """transformers' own greedy generate of NEW_TOKENS tokens (no stop)."""
    out = oracle.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=2)
    return out[0, len(ids):].tolist()


def outputs(events) -> dict[str, list[int]]:
    return {f.request_id: list(f.output_ids) for e in events for f in e.finished if f.output_ids}


def starts(events) -> dict[str, StateStartEntry]:
    return {s.request_id: s for e in events for s in e.state_starts}


# -- the catalogue -----------------------------------------------------------------------------------
def test_the_state_faults_act_on_the_hybrid_only_and_the_others_not_on_it():
    assert set(STATE) == {n for n, f in FAULTS.items() if f.models == (ModelKind.HYBRID,)}
    assert all(acts_on(n, ModelKind.HYBRID) and not acts_on(n, ModelKind.DECODER_ONLY) for n in STATE)
    assert not any(acts_on(n, ModelKind.HYBRID) for n in FAULTS if n not in STATE)
    assert faults_for("slots", ModelKind.HYBRID) == ("state_slot_not_reset",)
    assert faults_for("paged", ModelKind.HYBRID) == STATE
    assert all(FAULTS[n].caught_by == ("state_provenance", "reference") for n in STATE)


def test_an_engine_running_the_hybrid_refuses_the_other_faults_in_one_line(hybrid):
    engine = Engine(hybrid[0], EngineConfig(max_len=64, kv="paged", prefix_caching=True))
    engine.set_faults(["state_slot_not_reset", "state_index_units"])
    with pytest.raises(ValueError, match=r"^fault 'block_refcount' does not act on hybrid models like this engine's$"):
        engine.set_faults(["block_refcount"])


def test_a_scenario_refuses_a_state_fault_on_a_text_model_and_a_text_fault_on_the_hybrid():
    from kvtui.scenario.plan import audio_mismatch

    base = """name: x
max_requests: 2
model: {model}
engine: {{kv: paged, prefix_caching: true, faults: [{fault}]}}
prompts: {{kind: synthetic}}
"""
    text = parse_scenario(base.format(model="tiny-llama", fault="state_index_units"))
    assert audio_mismatch(text, None, "tiny-llama") == ("fault state_index_units does not act on decoder-only "
                                                         "models like tiny-llama; drop it (`kvtui faults` lists them)")
    hybrid = parse_scenario(base.format(model="tiny-qwen35moe", fault="block_refcount"))
    assert audio_mismatch(hybrid, None, "tiny-qwen35moe").startswith("fault block_refcount does not act on hybrid")
    fine = parse_scenario(base.format(model="tiny-qwen35moe", fault="state_index_units"))
    assert audio_mismatch(fine, None, "tiny-qwen35moe") == ""


# -- held-out scenarios: the truth table -------------------------------------------------------------
def _run(loaded, fault: str, seed: int, on: bool):
    spec = parse_scenario(scenario_text(fault, seed, on), f"held-out {fault} {seed}")
    session = Session(spec, loaded, clock="virtual")
    session.run()
    if on:  # the fault acted where it was caught (fault.acted events)
        assert session.summary.fault_acts[fault] > 0
    return spec, [e for e in session.contamination if e.counts]


def test_the_held_out_seeds_cover_slots_and_paged_kv():
    kinds = {"paged" if "kv: paged" in scenario_text("state_slot_not_reset", s) else "slots" for s in SEEDS}
    assert kinds == {"slots", "paged"}
    assert all("kv: paged" in scenario_text(f, s) and "prefix_caching: true" in scenario_text(f, s)
               for f in STATE[1:] for s in SEEDS)


@pytest.mark.parametrize("fault", STATE)
@pytest.mark.parametrize("seed", SEEDS)
def test_a_held_out_scenario_catches_the_fault_naming_victim_and_source(loaded, fault, seed):
    spec, reports = _run(loaded, fault, seed, on=True)
    ran = {f"r{i:03d}" for i in range(spec.max_requests)}
    assert {"state_provenance", "reference"} <= {e.detector for e in reports}, reports
    state = [e for e in reports if e.detector == "state_provenance"]
    named = [e for e in state if e.source is not None]
    assert named, state
    assert all(e.kind == "cross_request" and e.victim in ran and e.source in ran - {e.victim} for e in named)
    assert all(e.kind == "corruption" for e in state if e.source is None)  # a zero state nobody published
    # the reference check sees every named victim's answer changed, and nothing else
    changed = {e.victim for e in reports if e.detector == "reference"}
    assert {e.victim for e in named} <= changed
    assert changed <= {e.victim for e in state}
    _, clean = _run(loaded, fault, seed, on=False)
    assert clean == []


# -- the mechanisms on the engine, against transformers' generate ---------------------------------------
def test_state_slot_not_reset_starts_the_next_request_from_its_slots_previous_owners_state(hybrid):
    model, oracle, tok = hybrid
    first, second = tok(LIGHTHOUSE).input_ids, tok(CAT).input_ids
    for faults, clean in (([], True), (["state_slot_not_reset"], False)):
        engine = Engine(model, EngineConfig(max_len=96, num_slots=1), eos_token_ids=())
        engine.set_faults(faults)
        events = []
        for rid, ids in (("a", first), ("b", second)):
            engine.submit(rid, ids, SamplingParams(max_new_tokens=NEW_TOKENS))
            events += engine.run_until_done()
        out, start = outputs(events), starts(events)["b"]
        assert out["a"] == generate(oracle, first)
        assert (out["b"] == generate(oracle, second)) is clean
        assert (start.via, start.slot, start.tokens, start.reader_key) == ("slot", 0, 0, EMPTY_PREFIX)
        if clean:
            assert (start.writer, start.writer_tokens, start.writer_key) == (None, 0, EMPTY_PREFIX)
        else:  # what a's forward left: its prompt and all but its last token, fed
            covered = len(first) + NEW_TOKENS - 1
            assert (start.writer, start.writer_tokens) == ("a", covered)
            assert start.writer_key == prefix_digest((first + out["a"])[:covered])


def test_state_published_before_write_serves_a_cancelled_prefills_unwritten_checkpoint(hybrid):
    """a fills a 4-block pool; b takes a's blocks, is cancelled right after its prefill (before its next step
    writes its checkpoints); c, b's prompt again, restores the entry b's scheduling published: a's state."""
    model, oracle, tok = hybrid
    first, retry = tok(LIGHTHOUSE).input_ids, tok(CAT).input_ids
    assert len(first) + NEW_TOKENS > 48 and 32 < len(retry) < 48
    for faults, clean in (([], True), (["state_published_before_write"], False)):
        engine = Engine(model, EngineConfig(max_len=64, kv="paged", block_size=16, num_blocks=5, prefix_caching=True),
                        eos_token_ids=())
        engine.set_faults(faults)
        engine.submit("a", first, SamplingParams(max_new_tokens=NEW_TOKENS))
        events = engine.run_until_done()
        engine.submit("b", retry, SamplingParams(max_new_tokens=NEW_TOKENS))
        events.append(engine.step())  # b's whole prefill, its first token sampled
        engine.abort("b")
        events += engine.run_until_done()
        engine.submit("c", retry, SamplingParams(max_new_tokens=NEW_TOKENS))
        events += engine.run_until_done()
        out, start = outputs(events), starts(events)["c"]
        assert out["a"] == generate(oracle, first)
        assert (out["c"] == generate(oracle, retry)) is clean
        assert (start.via, start.tokens, start.reader_key) == ("checkpoint", 32, prefix_digest(retry[:32]))
        if clean:
            assert (start.writer, start.writer_tokens, start.matches) == ("b", 32, True)
        else:  # b's block 1 was a's block 2, whose state memory held a's state after 48 positions
            assert (start.writer, start.writer_tokens, start.publisher) == ("a", 48, "b")
            assert start.writer_key == prefix_digest(first[:48])


def test_tier_drops_recurrent_state_restores_the_state_of_the_last_block_the_tier_stored(hybrid):
    model, oracle, tok = hybrid
    system = "You are a careful assistant who keeps every secret it is told and answers in one short line. "
    first, second = tok(system + "The code word is heron.").input_ids, tok(system + "What is two and two?").input_ids
    other = tok("an unrelated prompt that takes nearly all of the pool's blocks for itself, and then it goes on and on "
                "about nothing much at all, the weather, the road, the price of bread, the old dog asleep by the fire "
                "and the").input_ids
    for faults, clean in (([], True), (["tier_drops_recurrent_state"], False)):
        engine = Engine(model, EngineConfig(max_len=64, kv="paged", block_size=8, num_blocks=9, prefix_caching=True,
                                            kv_offload_blocks=16), eos_token_ids=())
        engine.set_faults(faults)
        events = []
        for rid, ids in (("first", first), ("other", other), ("second", second)):
            engine.submit(rid, ids, SamplingParams(max_new_tokens=NEW_TOKENS))
            events += engine.run_until_done()
        out, start = outputs(events), starts(events)["second"]
        assert sum(e.kv_offload_hits for e in events) >= 8
        assert (out["second"] == generate(oracle, second)) is clean
        assert start.via == "checkpoint" and start.matches is clean
        if clean:
            assert engine.kv.tier.state_buffer is None and (start.writer, start.writer_tokens) == ("first", start.tokens)
        else:  # the buffer held the checkpoint of the block stored last, when other's blocks were evicted
            assert (start.writer, start.publisher) == ("other", "first") and start.writer_tokens != start.tokens
            assert start.writer_key == prefix_digest(other[:start.writer_tokens])


def test_state_index_units_reads_the_block_a_quarter_block_index_points_at():
    """Bookkeeping alone: a 1-block hit (16 tokens) reads index (16 - 1) // 4 = 3 of the reader's table, a
    block whose state memory holds what its previous owner kept there; past the table's end, nothing."""
    manager = BlockManager(8, 16, caching=True)  # 7 usable: x takes 5, a 2
    manager.needs_state = True
    system, mine, theirs = list(range(16)), list(range(16)) + list(range(100, 150)), list(range(200, 270))
    manager.admit("x", theirs)  # 5 blocks, each with a state
    for i in range(4):
        manager.publish_state("x", i, f"x after {16 * (i + 1)}")
    manager.admit("a", system + [7])
    manager.commit("a", system + [7], 17, prompt_len=17)
    manager.publish_state("a", 0, "a after 16")
    manager.free("a")
    manager.free("x")
    manager.faults = frozenset({"state_index_units"})
    admission = manager.admit("b", mine)
    assert admission.hit_tokens == 16
    table = manager.table("b")
    assert len(table) == 5 and manager.pool.blocks[table[3]].state is None  # a new block, its state evicted
    assert manager.state_at("b", 16) == manager.pool.blocks[table[3]].memory
    assert manager.state_at("b", 16) == "x after 64"  # table [6 (the hit), 7, 5, 4, 3]: x's block 4
    assert manager.state_at("b", 32) is None  # (32 - 1) // 4 = 7: past b's 5 blocks
    manager.faults = frozenset()
    assert manager.state_at("b", 16) == "a after 16"


def test_a_slot_not_zeroed_is_read_and_a_zeroed_one_is_not(hybrid):
    pool = StatePool(state_shape(hybrid[0].config), num_slots=1)
    slot = pool.allocate("a")
    pool.conv[0][slot].fill_(3.0)
    pool.held[slot] = StateOrigin("a", 12, prefix_digest(range(12)))  # as update_from_output notes it
    pool.free(slot)
    assert pool.allocate("b", zero=False) == slot and not pool.holds_zero(slot)
    assert bool((pool.conv[0][slot] == 3.0).all()) and pool.held[slot].writer == "a"
    pool.free(slot)
    assert pool.allocate("c") == slot and pool.holds_zero(slot) and torch.count_nonzero(pool.conv[0][slot]) == 0


# -- the detector -------------------------------------------------------------------------------------
class _Step:
    def __init__(self, step: int, entries) -> None:
        self.step, self.state_starts = step, tuple(entries)


def _entry(request_id, via, tokens, writer, writer_items, reader_items, publisher=None, slot=0):
    return StateStartEntry(request_id=request_id, slot=slot, via=via, tokens=tokens, writer=writer,
                           writer_tokens=len(writer_items), publisher=publisher, writer_key=prefix_digest(writer_items),
                           reader_key=prefix_digest(reader_items))


def test_the_detector_names_the_writer_of_a_foreign_state_once_per_pair():
    prompt, other = [5, 6, 7, 8], [9, 10, 11, 12, 13]
    detector = StateProvenanceDetector()
    sound = [_entry("r1", "slot", 0, None, [], []), _entry("r2", "checkpoint", 4, "r0", prompt, prompt),
             _entry("r3", "fork", 4, "r2", prompt, prompt)]
    assert detector.on_step(_Step(1, sound), 0.1) == []
    bad = [_entry("r4", "slot", 0, "r1", other, []), _entry("r5", "checkpoint", 4, "r1", other, prompt, "r2")]
    events = detector.on_step(_Step(2, bad), 0.2)
    assert [(e.victim, e.source, e.kind, e.step, e.evidence.via, e.evidence.writer_tokens) for e in events] == \
        [("r4", "r1", "cross_request", 2, "slot", 5), ("r5", "r1", "cross_request", 2, "checkpoint", 5)]
    assert events[1].evidence.publisher == "r2"
    assert detector.on_step(_Step(3, bad), 0.3) == []  # once per (victim, source)


def test_a_zero_state_kept_by_another_names_the_publisher_and_ones_own_state_is_corruption():
    prompt = [5, 6, 7, 8]
    detector = StateProvenanceDetector()
    zero = _entry("r2", "checkpoint", 4, None, [], prompt, publisher="r1")
    own = _entry("r3", "slot", 0, "r3", prompt + [1], [])
    nobody = _entry("r4", "checkpoint", 4, None, [], prompt)
    events = detector.on_step(_Step(5, [zero, own, nobody]), 1.0)
    assert [(e.victim, e.source, e.kind) for e in events] == [("r2", "r1", "cross_request"), ("r3", None, "corruption"),
                                                              ("r4", None, "corruption")]


# -- the dashboard: the state slots beside the KV --------------------------------------------------------
def _render(renderable, width: int) -> str:
    import io

    from rich.console import Console

    console = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def _dashboard(spec, loaded, pick):
    """The dashboard state fed a virtual-clock run of `spec` up to the first step `pick` accepts; (the step, its
    snapshot)."""
    from kvtui.tui.snapshot_build import build_snapshot
    from kvtui.tui.state import DashboardState

    events = []
    Session(spec, loaded, clock="virtual", listeners=(events.append,), detectors=("state_provenance",)).run()
    state = DashboardState()
    for event in events:
        state.apply(event)
        if type(event).__name__ == "StepEvent" and pick(event):
            return event, build_snapshot(state)
    raise AssertionError("no step matched")


def _owned(event) -> int:
    return sum(o is not None for _, o, _ in event.state_slot_map)


@pytest.mark.parametrize("fault, seed, pick", [
    ("state_slot_not_reset", SEEDS[0], lambda e: _owned(e) >= 2),  # slots: no checkpoints
    ("state_index_units", SEEDS[1], lambda e: any(c for _, o, c in e.state_slot_map if o))])
def test_the_kv_panel_lists_each_state_slot_with_its_owner_and_last_checkpoint(loaded, fault, seed, pick):
    from kvtui.tui import panels

    spec = parse_scenario(scenario_text(fault, seed))
    step, snap = _dashboard(spec, loaded, pick)
    assert [(s.index, s.owner, s.checkpoint) for s in snap.state_slots] == [tuple(x) for x in step.state_slot_map]
    text = _render(panels.block_map(snap, 60, 12) if snap.kv == "paged" else panels.slot_map(snap, 60, 12), 60)
    used = [s for s in snap.state_slots if s.owner]
    assert f"state slots (owner @checkpoint) {len(used)}/{len(snap.state_slots)}" in " ".join(text.split())
    for s in used:
        cell = f"{s.index} {s.owner} @{s.checkpoint if s.checkpoint is not None else '-'}"
        assert cell in " ".join(text.split()), (cell, text)
    if snap.kv == "paged":  # a prefix hit's slot shows the checkpoint it restored, others the last one kept
        assert any(s.checkpoint is not None and s.checkpoint % 16 == 0 for s in used)


def test_a_model_without_recurrent_state_shows_no_state_slots(tiny):
    from kvtui.tui import panels

    spec = parse_scenario("""name: plain
seed: 0
max_requests: 3
model: tiny-llama
engine: {slots: 2, max_len: 64}
arrivals: {process: constant, rate_per_s: 50.0}
prompts: {kind: synthetic, prompt_tokens: 8}
output_tokens: 4
""")
    step, snap = _dashboard(spec, tiny["tiny-llama"], lambda e: e.slots_used)
    assert step.state_slot_map == () and snap.state_slots == ()
    assert "state slots" not in _render(panels.slot_map(snap, 60, 12), 60)
    assert "state_slot_map" not in step.to_json() and "state_starts" not in step.to_json()
