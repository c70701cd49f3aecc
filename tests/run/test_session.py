"""Session, recording and replay: virtual-clock determinism, replay == live summary, truncated
recordings, clean stop on SIGTERM, and the CLI's exit codes and one-line errors."""

import json
import signal
import subprocess
import sys
import time

from kvtui.events import Arrive, Finish
from kvtui.metrics import SLO, Metrics
from kvtui.record import read_recording
from kvtui.scenario import parse_scenario
from kvtui.session import Session

KVTUI = [sys.executable, "-m", "kvtui.cli"]
MEASURED_KEYS = {"wall_s", "created_unix_s", "measured_step_wall_s"}

SCENARIO = """
name: session-test
seed: 5
max_requests: 7
model: tiny-llama
engine: {slots: 3, max_len: 128, max_tokens_per_step: 48}
arrivals: {process: gamma, rate_per_s: 20.0, burstiness: 0.5}
prompts: {kind: passphrase}
output_tokens: {dist: uniform, min: 2, max: 12}
slo: {ttft_s: 0.5, tpot_s: 0.1}
"""


def record(tiny, path, text=SCENARIO):
    session = Session(parse_scenario(text), tiny["tiny-llama"], clock="virtual", record_path=path)
    session.run()
    return session


def strip_measured(value):
    if isinstance(value, dict):
        return {k: strip_measured(v) for k, v in value.items() if k not in MEASURED_KEYS}
    if isinstance(value, list):
        return [strip_measured(v) for v in value]
    return value


def test_virtual_clock_runs_are_identical_apart_from_measured_times(tiny, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    record(tiny, a)
    record(tiny, b)
    lines_a = [strip_measured(json.loads(x)) for x in a.read_text().splitlines()]
    lines_b = [strip_measured(json.loads(x)) for x in b.read_text().splitlines()]
    assert len(lines_a) == len(lines_b) > 20
    assert lines_a == lines_b
    finishes = [x for x in lines_a if x["type"] == "request.finish"]
    assert len(finishes) == 7 and all(x["output_ids"] for x in finishes)


def test_replay_summary_equals_live_summary(tiny, tmp_path):
    path = tmp_path / "run.jsonl"
    session = record(tiny, path)
    header, events, summary, truncated = read_recording(path)
    assert not truncated and header.clock == "virtual" and header.scenario["name"] == "session-test"
    metrics = Metrics(SLO(0.5, 0.1))
    for event in events:
        metrics.add_event(event)
    replayed = metrics.summary(t=summary.t, stopped_early=summary.stopped_early)
    assert replayed == session.summary == summary
    assert summary.requests_finished == 7
    out = subprocess.run(KVTUI + ["replay", str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "session-test" in out.stdout and "7 (" in out.stdout


def test_truncated_recording_replays_up_to_its_last_whole_line(tiny, tmp_path):
    path = tmp_path / "run.jsonl"
    record(tiny, path)
    lines = path.read_text().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(lines[:15]) + lines[15][:20])
    header, events, summary, truncated = read_recording(cut)
    assert truncated and summary is None and len(events) == 14
    in_flight = sum(isinstance(e, Arrive) for e in events) - sum(isinstance(e, Finish) for e in events)
    assert in_flight > 0
    out = subprocess.run(KVTUI + ["replay", str(cut)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ends early" in out.stderr
    assert f"{in_flight} requests arrived but never finished" in out.stdout


def test_sigterm_stops_cleanly_with_summary_written(tmp_path):
    scenario = tmp_path / "long.yaml"
    scenario.write_text(SCENARIO.replace("max_requests: 7", "max_requests: 400").replace("rate_per_s: 20.0",
                                                                                       "rate_per_s: 5.0"))
    path = tmp_path / "run.jsonl"
    proc = subprocess.Popen(KVTUI + ["run", str(scenario), "--headless", "--clock", "wall", "--record", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and (not path.exists() or path.read_text().count('"type":"step"') < 5):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err  # 128 + SIGTERM, as a shell reports a process a signal ended
    last = json.loads(path.read_text().splitlines()[-1])
    assert last["type"] == "summary" and last["stopped_early"] is True
    assert last["requests_not_submitted"] > 0
    assert "SIGTERM" in err


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: 1\nmax_requests: 2\nengine: {slots: 0}\n")
    out = subprocess.run(KVTUI + ["run", str(bad), "--headless"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "engine.slots" in lines[0] and "bad.yaml:3" in lines[0]
    assert "Traceback" not in out.stderr
    out = subprocess.run(KVTUI + ["run", str(tmp_path / "missing.yaml"), "--headless"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2 and "missing.yaml" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run(KVTUI + ["run", "scenarios/passphrase.yaml", "--headless", "--fault", "nope"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "'--fault': 'nope' is not one of 'shared_cache'" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run(KVTUI + ["replay", str(tmp_path / "none.jsonl")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "no such recording" in out.stderr


def test_exit_codes_follow_expect(tmp_path):
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SCENARIO)
    base = KVTUI + ["run", str(scenario), "--headless", "--detectors", "slot_taint,attention_flow"]
    clean = subprocess.run(base, capture_output=True, text=True, timeout=300)
    assert clean.returncode == 0, clean.stderr
    leaky = subprocess.run(base + ["--fault", "stale_slot"], capture_output=True, text=True, timeout=300)
    assert leaky.returncode == 1 and "unexpected contamination" in leaky.stderr
    scenario.write_text(SCENARIO + "expect: {contamination: detected}\n")
    missed = subprocess.run(base, capture_output=True, text=True, timeout=300)
    assert missed.returncode == 1 and "no detector fired" in missed.stderr
    caught = subprocess.run(base + ["--isolation", "off"], capture_output=True, text=True, timeout=300)
    assert caught.returncode == 0 and "detected as expected" in caught.stdout


def _planned(request_id: str, prompt: list[int], arrival_s: float):
    from kvtui.engine.request import SamplingParams
    from kvtui.request import PlannedRequest, TokenPrompt

    return PlannedRequest(request_id, arrival_s, TokenPrompt(tuple(prompt)), SamplingParams(max_new_tokens=6,
                                                                                           ignore_eos=True))


def test_an_idle_reference_check_gives_way_to_a_request_that_arrives(tiny):
    """On the wall clock the reference detector checks finished requests while the engine is idle.
    A request that arrives meanwhile is served first: the idle drain stops, the check stays queued and
    later resumes. (kvtui serve once made each of four back-to-back clients wait about a second behind
    the previous one's reference check: 0.9 s, then 2.2 s per request.)"""
    spec = parse_scenario("name: serve-like\nmax_requests: 1\nmodel: tiny-llama\nengine: {slots: 2, max_len: 64}")
    finished = []
    session = Session(spec, tiny["tiny-llama"], clock="wall", detectors=("reference",), serving=True,
                      listeners=(lambda e: isinstance(e, Finish) and finished.append(e.request_id),))

    def step_until_finished(request_id: str) -> None:
        for _ in range(200):
            if request_id in finished:
                return
            session.step_once()
        raise AssertionError(f"{request_id} never finished")

    session.intake.put(_planned("a", [5, 6, 7, 8], session.engine.now()))
    step_until_finished("a")
    assert session.observer("reference").pending == 1
    session.intake.put(_planned("b", [9, 10, 11], session.engine.now()))
    session._idle()  # what step_once does between requests: here it must yield to "b"
    assert (session.observer("reference").pending, session.observer("reference").checked) == (1, 0)
    step_until_finished("b")
    for _ in range(20):
        if not session.observer("reference").pending:
            break
        session._idle()
    assert (session.observer("reference").pending, session.observer("reference").checked) == (0, 2)
    session.close()


def test_an_interrupted_reference_run_resumes_where_it_stopped(tiny):
    """The checks a new arrival interrupted resume on the same clean engine: the steps taken before and
    after the interruption add up to one uninterrupted run's, and the verdict is the same."""
    from kvtui.detect.reference import PendingCheck, ReferenceDetector
    from kvtui.engine.request import SamplingParams

    loaded = tiny["tiny-llama"]
    sampling = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompt = [3, 4, 5, 6, 7]

    def detector_with_a_check():
        ref = ReferenceDetector(loaded, loaded.tokenizer)
        solo = ref._run([(prompt, sampling)], frozenset())[0][0]
        ref._cache.clear()
        ref._clean = None
        ref.on_finish(PendingCheck("x", prompt, solo, [1.0] * len(solo), sampling, [0] * len(solo), [()] * len(solo),
                                   (), frozenset()))
        return ref

    def counting(ref):
        steps = []
        engine = ref._clean_engine(64)
        original = engine.step
        engine.step = lambda: steps.append(1) or original()
        return steps

    whole = detector_with_a_check()
    whole_steps = counting(whole)
    assert whole.drain(0.0) == [] and whole.checked == 1

    cut = detector_with_a_check()
    cut_steps = counting(cut)
    calls = iter([False, False, False, True])  # drain's own check, then one per reference step
    assert cut.drain(0.0, should_stop=lambda: next(calls, False)) == []
    assert (cut.pending, cut.checked, len(cut_steps)) == (1, 0, 2)
    assert cut.drain(0.0) == [] and (cut.pending, cut.checked) == (0, 1)
    assert len(cut_steps) == len(whole_steps) > 2


def test_reference_checks_take_short_steps_so_an_arrival_waits_at_most_one(tiny):
    """The clean reference engine prefills in steps of REFERENCE_STEP_TOKENS tokens at most, whatever the
    run's budget (1024 here), so a check of three 200-token prompts that a new arrival interrupts stops
    after one step of at most 128 tokens, not one 600-token prefill; its verdict is unchanged."""
    from kvtui.config import EngineConfig
    from kvtui.detect.reference import REFERENCE_STEP_TOKENS, PendingCheck, ReferenceDetector
    from kvtui.engine.request import SamplingParams

    loaded = tiny["tiny-llama"]
    sampling = SamplingParams(max_new_tokens=4, ignore_eos=True)
    prompts = [[3 + (i * 7 + j) % 200 for j in range(200)] for i in range(3)]
    ref = ReferenceDetector(loaded, loaded.tokenizer, engine_config=EngineConfig(max_tokens_per_step=1024, max_len=256))
    solos = [run[0] for run in ref._run([(p, sampling) for p in prompts], frozenset())]
    ref._cache.clear()
    engine = ref._clean_engine(256)
    assert engine.config.max_tokens_per_step == REFERENCE_STEP_TOKENS == 128
    tokens = []
    original = engine.step
    engine.step = lambda: tokens.append(original().prefill_tokens)
    for i, (p, solo) in enumerate(zip(prompts, solos)):
        ref.on_finish(PendingCheck(f"r{i}", p, solo, [1.0] * len(solo), sampling, [0] * len(solo),
                                   [()] * len(solo), (), frozenset()))
    calls = iter([False, False, True])  # drain's own check, the first step's, then an arrival
    assert ref.drain(0.0, should_stop=lambda: next(calls, False)) == [] and ref.checked == 0
    assert len(tokens) == 1 and 0 < tokens[0] <= 128
    assert ref.drain(0.0) == [] and ref.checked == 3
    assert max(tokens) <= 128 and sum(tokens) == 600
