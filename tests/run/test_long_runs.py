"""Long runs stay bounded: what the engine, the detectors and the dashboard keep does not grow with
the number of requests served."""

from __future__ import annotations

from helpers import make_engine

from kvtui.detect.canary import CanaryDetector
from kvtui.detect.reference import PendingCheck, ReferenceDetector
from kvtui.engine import SamplingParams
from kvtui.events import Arrive, Finish
from kvtui.tui.state import MAX_FINISHED_KEPT, DashboardState


def test_engine_forgets_reported_requests(tiny):
    engine = make_engine(tiny["tiny-llama"].model, num_slots=2, max_len=32)
    for i in range(50):
        engine.submit(f"r{i}", [5 + i % 7, 6], SamplingParams(max_new_tokens=2))
    reports = engine.run_until_done()
    assert sum(len(r.finished) for r in reports) == 50
    assert engine.requests == {} and engine._serial == {} and engine.output.row_states == {}
    assert len(engine.output.rows.states) <= 2  # the rows of the last step, dropped at the next


def test_reference_detector_bounds_its_queue_and_cache(tiny):
    loaded = tiny["tiny-llama"]
    ref = ReferenceDetector(loaded, loaded.tokenizer, max_queue=5, batch=3, cache_size=4)
    params = SamplingParams(max_new_tokens=2)
    for i in range(12):
        ref.on_finish(PendingCheck(f"r{i}", (5 + i, 6), (7, 8), (1.0, 1.0), params))
    assert (ref.pending, ref.skipped) == (5, 7)  # the oldest seven were sampled out
    ref.drain(0.0)
    assert (ref.pending, ref.checked, ref.skipped) == (0, 5, 7)
    assert len(ref._cache) == 4


def test_canary_remembers_recent_passphrases_only():
    canary = CanaryDetector(memory=8)
    for i in range(100):
        canary.on_arrive(f"r{i}", f"WORD-OTHER-{i}")
    assert list(canary.passphrases) == [f"r{i}" for i in range(92, 100)]
    (leak,) = canary.on_piece("r99", "it is WORD-OTHER-95", 1.0, 3)
    assert leak.source == "r95"


def test_dashboard_state_forgets_old_finished_requests():
    state = DashboardState()
    for i in range(MAX_FINISHED_KEPT * 3):
        state.apply(Arrive(t=i, request_id=f"r{i}", prompt_len=4, max_new_tokens=2, passphrase=f"A-B-{i}"))
        state.apply(Finish(t=i + 0.5, request_id=f"r{i}", finish_reason="length", output_ids=(1, 2)))
    assert len(state.requests) <= MAX_FINISHED_KEPT
    assert state.finished == MAX_FINISHED_KEPT * 3 and state.metrics.requests_finished == MAX_FINISHED_KEPT * 3
