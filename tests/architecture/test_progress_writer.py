"""A request's progress (cache_len: positions its KV holds; prefill_done: prefill tokens fed) has one
writer, Scheduler.set_progress: admission from the KV cache's hit count, each step's chunks
(Scheduler.update_from_output), preemption and parallel-sampling forks all go through it."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from helpers import make_engine, make_requests, solo

from kvtui.engine import SamplingParams
from kvtui.engine.request import RequestState, RequestStatus

KVTUI = Path(__file__).parents[2] / "kvtui"
PROGRESS = ("cache_len", "prefill_done")
# The dashboard's own view of a request (kvtui/tui/state.py `_Request`, not RequestState) has a cache_len field
# of its own, written from each step's report: these two methods write that view, never an engine request.
VIEW_WRITERS = {("kvtui/tui/state.py", "DashboardState._blocks", "cache_len"),
                ("kvtui/tui/state.py", "DashboardState._running", "cache_len")}
WRITER = ("kvtui/engine/scheduler.py", "Scheduler.set_progress")


def progress_writes(source: str) -> list[tuple[str, str]]:
    """(qualified function, attribute) of each assignment to an attribute named cache_len or prefill_done in
    `source`: =, augmented and annotated assignments (tuple targets included) and setattr with the name."""
    found = []

    def targets(node):
        if isinstance(node, ast.Assign):
            return node.targets
        if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            return [node.target]
        return []

    def flat(target):
        if isinstance(target, (ast.Tuple, ast.List)):
            return [t for e in target.elts for t in flat(e)]
        return [target.value] if isinstance(target, ast.Starred) else [target]

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{scope}.{child.name}" if scope else child.name
            for target in (t for top in targets(child) for t in flat(top)):
                if isinstance(target, ast.Attribute) and target.attr in PROGRESS:
                    found.append((scope, target.attr))
            if isinstance(child, ast.Call) and getattr(child.func, "id", None) == "setattr" and len(child.args) > 1 \
                    and isinstance(child.args[1], ast.Constant) and child.args[1].value in PROGRESS:
                found.append((scope, child.args[1].value))
            visit(child, inner)

    visit(ast.parse(source), "")
    return found


def test_the_scan_finds_every_kind_of_write():
    source = ("def f(r):\n    r.cache_len = 1\n    r.a, r.prefill_done = 0, 2\n    r.cache_len += 1\n"
              "    setattr(r, 'prefill_done', 3)\nclass C:\n    def g(self, r):\n        r.cache_len: int = 0\n"
              "x = r.cache_len\nd = dict(cache_len=4)\n")
    assert progress_writes(source) == [("f", "cache_len"), ("f", "prefill_done"), ("f", "cache_len"),
                                       ("f", "prefill_done"), ("C.g", "cache_len")]


def test_only_the_scheduler_writes_a_requests_progress():
    writes = {(path.relative_to(KVTUI.parent).as_posix(), scope, attr) for path in sorted(KVTUI.rglob("*.py"))
              for scope, attr in progress_writes(path.read_text())}
    assert writes == {(*WRITER, "cache_len"), (*WRITER, "prefill_done")} | VIEW_WRITERS


def test_the_excluded_writers_write_the_dashboards_view_not_a_request():
    from kvtui.tui import state

    fields = {f.name for f in dataclasses.fields(state._Request)}
    assert state._Request is not RequestState and "cache_len" in fields and "prefill_done" not in fields
    source = (KVTUI / "tui" / "state.py").read_text()
    for _, scope, _ in VIEW_WRITERS:  # each takes the view it writes from DashboardState._request (a _Request)
        cls, name = scope.split(".")
        method = next(n for c in ast.parse(source).body if getattr(c, "name", None) == cls for n in c.body
                      if getattr(n, "name", None) == name)
        assert "self._request(" in ast.unparse(method)


# -- behaviour ---------------------------------------------------------------------------------------------
PROMPT = [(i * 37) % 250 + 3 for i in range(12)]  # 12 tokens: three blocks of 4


def test_a_prefix_cache_hit_of_n_tokens_starts_the_request_at_n(tiny):
    engine = make_engine(tiny["tiny-llama"].model, kv="paged", block_size=4, num_blocks=32, max_len=64,
                         prefix_caching=True, max_batch_size=4)
    first = make_requests(engine, [PROMPT], SamplingParams(max_new_tokens=2))[0]
    engine.run_until_done()
    assert first.finish_reason.value == "length"
    shares, same = make_requests(engine, [PROMPT[:8] + [9, 9, 9], PROMPT], SamplingParams(max_new_tokens=2),
                                 prefix="b")
    engine.scheduler.admit(engine.now())
    # two full blocks shared; the identical prompt hits at most prompt length - 1 = 11 tokens: two blocks too
    assert [(r.cache_len, r.prefill_done, r.prefix_hit_tokens) for r in (shares, same)] == [(8, 8, 8), (8, 8, 8)]
    report = engine.step()
    assert [(e.request_id, e.query_tokens, e.cache_len) for e in report.running] == [("b0", 3, 11), ("b1", 4, 12)]
    assert [(r.cache_len, r.prefill_done) for r in (shares, same)] == [(11, 11), (12, 12)]
    engine.run_until_done()
    assert same.generated_ids == first.generated_ids


def test_a_slot_starts_at_zero_and_a_stale_slot_at_the_length_it_kept(tiny):
    model = tiny["tiny-llama"].model
    clean = make_engine(model, num_slots=1, max_len=64)
    assert clean.kv.admit(make_requests(clean, [PROMPT])[0], 0) == 0
    assert clean.kv.admit(make_requests(clean, [PROMPT], prefix="x")[0], 1) is None  # no free slot
    engine = make_engine(model, num_slots=1, max_len=64, faults=frozenset({"stale_slot"}))
    make_requests(engine, [PROMPT[:6]], SamplingParams(max_new_tokens=2))
    engine.run_until_done()  # positions 0..6 written (the prompt and the first token): the slot keeps 7
    longer, shorter = make_requests(engine, [PROMPT, PROMPT[:4]], SamplingParams(max_new_tokens=2), prefix="s")
    assert engine.scheduler.admit(engine.now()) == [longer]
    assert (longer.cache_len, longer.prefill_done) == (7, 7)  # feeds prompt tokens 7..11 at positions 7..11
    assert engine.step().stale_starts == (("s0", 0, "r0", 7),)
    while not longer.is_done:
        engine.step()
    assert longer.cache_len == 13  # 12 prompt positions and its first token
    assert engine.scheduler.admit(engine.now()) == [shorter]
    assert (shorter.cache_len, shorter.prefill_done) == (13, 3)  # more kept than its prompt: it feeds its last token


def test_preemption_resets_progress_to_zero_and_the_tokens_stay_the_solo_ones(tiny):
    """Three usable blocks of 4: a and b prefill a block each; at their first decode a takes the last free
    block and b (the newest) is preempted: back to 0 positions, 0 prefill tokens, its token to recompute."""
    loaded = tiny["tiny-llama"]
    engine = make_engine(loaded.model, kv="paged", block_size=4, num_blocks=4, watermark=0.0, max_len=12,
                         max_batch_size=2)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    a, b = make_requests(engine, [PROMPT[:4], PROMPT[4:8]], params)
    engine.step()
    assert [(r.cache_len, r.prefill_done) for r in (a, b)] == [(4, 4), (4, 4)]
    report = engine.step()
    assert report.preempted == ("r1",) and b.status == RequestStatus.WAITING
    assert (b.cache_len, b.prefill_done, b.recompute_tokens, len(b.generated_ids)) == (0, 0, 1, 1)
    assert (a.cache_len, a.prefill_done) == (5, 4)
    engine.run_until_done()
    assert a.generated_ids == solo(loaded, PROMPT[:4], params) and b.generated_ids == solo(loaded, PROMPT[4:8], params)


def test_chunked_prefill_advances_by_its_chunks_then_decode_by_one(tiny):
    engine = make_engine(tiny["tiny-llama"].model, num_slots=1, max_len=64, max_tokens_per_step=4)
    state = make_requests(engine, [PROMPT[:10]], SamplingParams(max_new_tokens=3))[0]
    progress = []
    for _ in range(4):
        report = engine.step()
        progress.append((report.running[0].query_tokens, state.cache_len, state.prefill_done, len(state.generated_ids)))
    assert progress == [(4, 4, 4, 0), (4, 8, 8, 0), (2, 10, 10, 1), (1, 11, 10, 2)]


def test_a_chunk_a_fault_broke_keeps_its_progress_and_the_others_advance(tiny):
    engine = make_engine(tiny["tiny-llama"].model, num_slots=2, max_len=64)
    a, b = make_requests(engine, [PROMPT[:5], PROMPT[:3]])
    engine.scheduler.admit(engine.now())
    plan = engine.scheduler.plan()
    engine.scheduler.update_from_output(plan, failed={0})
    assert [(r.cache_len, r.prefill_done) for r in (a, b)] == [(0, 0), (3, 3)]


def test_a_forked_sequence_starts_with_its_leads_prompt_in_its_kv(tiny):
    engine = make_engine(tiny["tiny-llama"].model, num_slots=3, max_len=64)
    engine.submit("p", PROMPT, SamplingParams(max_new_tokens=3, n=3, temperature=1.0, seed=4))
    engine.step()
    states = [engine.requests[i] for i in engine.sequence_ids("p")]
    assert [(s.cache_len, s.prefill_done, len(s.generated_ids)) for s in states] == [(12, 12, 1)] * 3
    assert len({s.scheduled_s for s in states}) == 1


def test_benchmarks_start_requests_on_a_synthetic_prefix_through_the_writer(tiny):
    from kvtui.bench.overhead import kvtui_steps
    from kvtui.calibrate import measure

    model = tiny["tiny-llama"].model
    # 2 rows feed 2 query tokens each over 6 "cached" ones: 4 query positions, not 16
    assert measure(model, rows=2, query=2, context=6, repeats=1)[0] == (2, 4, 16)
    assert len(kvtui_steps(model, batch=2, context=8, steps=3)) == 3  # it asserts each decoded a token per step
