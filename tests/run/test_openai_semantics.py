"""What users of OpenAI-compatible servers expect: stop strings cut from the returned text (kept
with include_stop_str_in_output), latency statistics over completed requests only, a clear error
for aborting an unknown request, and faults whose symptoms are events, never a crash."""

from __future__ import annotations

import pytest
from helpers import make_engine

from kvtui.engine import SamplingParams
from kvtui.events import Finish
from kvtui.metrics import Metrics
from kvtui.scenario import parse_scenario
from kvtui.session import Session

PASSPHRASE = "The passphrase is BISCUIT-DRAGON-67. Reply with only the passphrase."


@pytest.mark.smollm
@pytest.mark.parametrize("stop, include, text", [
    ("hras", False, "The passp"),  # inside the token "phrase"
    ("hras", True, "The passphras"),
    ("passphrase", False, "The "),  # across the tokens " pass" and "phrase"
    ("passphrase", True, "The passphrase"),
    ("DRAGON", False, "The passphrase is BISCUIT-"),  # across "DR", "AG", "ON"
])
def test_stop_strings_are_cut_from_the_returned_text(smollm2, stop, include, text):
    scenario = parse_scenario(f"""
name: stops
max_requests: 1
prompts: {{kind: file, path: prompts.txt, chat: true}}
arrivals: {{process: constant, rate_per_s: 1}}
output_tokens: 24
sampling: {{stop: ["{stop}"], include_stop_str_in_output: {str(include).lower()}}}
""", base_dir=_prompt_dir())
    finishes = []
    Session(scenario, smollm2, detectors=(), listeners=(lambda e: isinstance(e, Finish) and finishes.append(e),)).run()
    (finish,) = finishes
    assert (finish.finish_reason, finish.output_text) == ("stop", text)
    pieces = [smollm2.tokenizer.decode([t]) for t in finish.output_ids]
    assert "".join(pieces).startswith(text) and stop in "".join(pieces)  # the ids keep the stopping token
    assert stop not in "".join(pieces[:-1])  # and stop at it


_DIR = None


def _prompt_dir():
    import tempfile
    from pathlib import Path

    global _DIR
    if _DIR is None:
        _DIR = Path(tempfile.mkdtemp())
        (_DIR / "prompts.txt").write_text(PASSPHRASE + "\n")
    return _DIR


def test_aborting_an_unknown_request_says_so(tiny):
    engine = make_engine(tiny["tiny-llama"].model, num_slots=1)
    with pytest.raises(KeyError, match="cannot abort 'nope': no such request"):
        engine.abort("nope")
    engine.submit("done", [5, 6], SamplingParams(max_new_tokens=1))
    engine.run_until_done()
    with pytest.raises(KeyError, match="already finished and reported"):
        engine.abort("done")


def test_latency_statistics_count_completed_requests_only(tiny):
    """One request completes, one is aborted mid-decode, one is rejected: TTFT/TPOT/ITL/E2E cover the
    completed one alone; the others are counted by finish reason."""
    engine = make_engine(tiny["tiny-llama"].model, num_slots=2, max_len=32, clock="virtual")
    done = engine.submit("done", [5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True))
    engine.submit("aborted", [8, 9], SamplingParams(max_new_tokens=20, ignore_eos=True))
    engine.submit("rejected", list(range(40)), SamplingParams(max_new_tokens=4))
    reports = [engine.step(), engine.step()]
    engine.abort("aborted")
    reports += engine.run_until_done()
    metrics = Metrics()
    for f in (f for r in reports for f in r.finished):
        metrics.add_event(Finish(t=f.finish_s, request_id=f.request_id, finish_reason=f.finish_reason,
                                 arrival_s=f.arrival_s, first_token_s=f.first_token_s, finish_s=f.finish_s,
                                 scheduled_s=f.scheduled_s, token_times_s=f.token_times_s, output_ids=f.output_ids,
                                 prompt_ids=f.prompt_ids))
    summary = metrics.summary()
    assert summary.finish_reasons == {"rejected": 1, "abort": 1, "length": 1} and summary.requests_completed == 1
    times = done.token_times_s
    assert summary.time_to_first_token_seconds.count == 1
    assert summary.time_to_first_token_seconds.p50 == pytest.approx(done.first_token_s - done.arrival_s)
    assert summary.inter_token_latency_seconds.count == len(times) - 1 == 3
    assert summary.e2e_request_latency_seconds.count == 1


def test_racy_threads_with_chunked_prefill_reports_events_and_never_crashes(tiny):
    def run(n):
        spec = parse_scenario(f"""
name: racy-chunked
max_requests: {n}
model: tiny-llama
engine: {{slots: 3, max_len: 128, max_tokens_per_step: 16, faults: [racy_threads]}}
arrivals: {{process: constant, rate_per_s: 100}}
prompts: {{kind: synthetic, prompt_tokens: 40}}
output_tokens: 8
sampling: {{ignore_eos: true}}
""")
        session = Session(spec, tiny["tiny-llama"], detectors=("reference", "slot_taint"))
        return session, session.run()

    alone, summary = run(1)  # one thread cannot race itself: a clean run
    assert summary.finish_reasons == {"length": 1} and alone.contamination == []
    raced, summary = run(3)
    assert summary.requests_finished == 3
    assert {e.kind for e in raced.contamination} & {"corruption", "cross_request"}
