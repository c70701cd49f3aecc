"""`kvtui run --target`: black-box runs against HTTP servers.

Fast and deterministic checks run against a fake OpenAI-compatible server (tests/fake_openai.py) as an
in-process httpx transport or over real HTTP in a thread: streaming TTFT/ITL/TPOT arithmetic (against
the formulas of vLLM's `bench serve`), per-request errors and timeouts, the concurrency cap, /metrics and
/slots parsing, the canary naming victim and source when the server leaks, and the reference check's
labels. The llama-server checks need scripts/build-llama-server.sh (skipped otherwise).
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys

import numpy
import pytest
from fake_openai import LLAMACPP_METRICS, FakeHTTPServer, FakeOpenAI

from kvtui.events import Finish, FirstToken, ServerSample
from kvtui.models import build_tiny_tokenizer
from kvtui.record import read_recording
from kvtui.remote.server_probe import parse_metrics, parse_slots
from kvtui.remote.session import TargetOptions, TargetSession
from kvtui.scenario import parse_scenario, plan_requests

KVTUI = [sys.executable, "-m", "kvtui.cli"]
TOK = build_tiny_tokenizer()


def scenario(n: int = 4, arrivals: str = "{process: burst, size: 16, every_s: 100}", extra: str = ""):
    return parse_scenario(f"name: target-test\nseed: 3\nmax_requests: {n}\nmodel: tiny-llama\n"
                          f"arrivals: {arrivals}\nprompts: {{kind: passphrase}}\noutput_tokens: 8\n"
                          f"slo: {{ttft_s: 1.0, tpot_s: 0.5}}\n{extra}")


def run(fake: FakeOpenAI, spec, *, detectors=("reference", "canary"), clock=None, record=None, **options):
    events = []
    kwargs = {"clock": clock} if clock is not None else {}
    session = TargetSession(spec, TOK, TargetOptions(url="http://fake", transport=fake.transport(), **options),
                            detectors=detectors, listeners=(events.append,), record_path=record, **kwargs)
    session.run()
    return session, events


def phrases(spec) -> dict[str, str]:
    """passphrase -> request id, from the scenario's own plan."""
    return {p.passphrase: p.request_id for p in plan_requests(spec, TOK)}


# -- timing --------------------------------------------------------------------------------------------
def test_ttft_itl_tpot_e2e_follow_vllm_bench_serve():
    """One chat request on a fake clock: send at 10.0; the role chunk at 10.5, five token chunks, the
    finish chunk at 11.5, the usage-only chunk at 11.9. vLLM's bench serve: TTFT = first choice chunk -
    send = 0.5; ITL = gaps between choice chunks; latency = last choice chunk - send = 1.5 (the usage
    chunk carries no token); TPOT = (latency - TTFT) / (output tokens - 1) = 1.0 / 4."""
    steps = [10.5, 10.6, 10.8, 11.1, 11.2, 11.4, 11.5, 11.9]
    fake = FakeOpenAI(clock_steps=steps, now=10.0)
    session, events = run(fake, scenario(1), detectors=("canary",), clock=fake.clock)
    s = session.summary
    assert s.time_to_first_token_seconds.p50 == pytest.approx(0.5)
    itl = [b - a for a, b in zip(steps[:7], steps[1:7])]
    assert s.inter_token_latency_seconds.count == 6
    assert s.inter_token_latency_seconds.mean == pytest.approx(sum(itl) / 6)
    assert s.inter_token_latency_seconds.p99 == pytest.approx(numpy.percentile(itl, 99))
    assert s.e2e_request_latency_seconds.p50 == pytest.approx(1.5)
    assert s.time_per_output_token_seconds.p50 == pytest.approx(1.0 / 4)
    assert (s.generated_tokens, s.prompt_tokens) == (5, 7)  # the server's usage, not our tokenizer
    first = next(e for e in events if isinstance(e, FirstToken))
    assert first.ttft_s == pytest.approx(0.5)


# -- errors, timeouts, the cap -----------------------------------------------------------------------
def test_errors_and_timeouts_are_recorded_per_request_without_retry():
    spec = scenario(4)
    by_phrase = phrases(spec)
    failing, hanging = sorted(by_phrase)[:2]
    fake = FakeOpenAI(fail=(failing,), hang=(hanging,))
    session, events = run(fake, spec, timeout_s=0.5)
    finishes = {e.request_id: e for e in events if isinstance(e, Finish)}
    assert finishes[by_phrase[failing]].finish_reason == "error"
    assert finishes[by_phrase[failing]].detail.startswith("HTTP 500") and failing in finishes[by_phrase[failing]].detail
    assert finishes[by_phrase[hanging]].finish_reason == "error"
    assert "timeout" in finishes[by_phrase[hanging]].detail
    others = [f for rid, f in finishes.items() if rid not in (by_phrase[failing], by_phrase[hanging])]
    assert [f.finish_reason for f in others] == ["stop", "stop"]
    sent = [json.dumps(b.get("messages")) for b in fake.requests]
    assert sum(failing in text for text in sent) == 1  # no retry (and no reference check of a failed request)
    s = session.summary
    assert s.finish_reasons == {"stop": 2, "error": 2}
    assert s.time_to_first_token_seconds.count == 2  # latency statistics count successful requests only


@pytest.mark.parametrize("cap", [2, 6])
def test_concurrency_cap_bounds_requests_in_flight(cap):
    fake = FakeOpenAI(delay_s=0.02)
    session, events = run(fake, scenario(6), detectors=("canary",), max_concurrency=cap)
    assert fake.max_in_flight == cap  # six arrive at once: the cap, and nothing else, limits them
    assert session.summary.finish_reasons == {"stop": 6}
    finishes = [e for e in events if isinstance(e, Finish)]
    queued = sorted(f.sent_s - f.arrival_s for f in finishes)
    assert (queued[-1] > 0.05) == (cap == 2)  # with cap 2 the last ones waited for a place


# -- what the server exposes ---------------------------------------------------------------------------
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 5.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.375
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1234.0
vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7e9
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 9.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 9.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 1.5
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 99.0
"""


def test_metrics_parsing_vllm_and_llamacpp():
    assert parse_metrics(VLLM_METRICS) == {"vllm:num_requests_running": 7.0, "vllm:num_requests_waiting": 4.0,
                                           "vllm:kv_cache_usage_perc": 0.375, "vllm:prompt_tokens_total": 1234.0}
    assert parse_metrics(LLAMACPP_METRICS) == {"llamacpp:prompt_tokens_total": 58.0,
                                               "llamacpp:tokens_predicted_total": 16.0,
                                               "llamacpp:requests_processing": 3.0, "llamacpp:requests_deferred": 1.0}


SLOTS = [
    {"id": 0, "n_ctx": 512, "speculative": False, "is_processing": False},
    {"id": 1, "n_ctx": 512, "is_processing": True, "n_prompt_tokens": 351,
     "next_token": [{"has_next_token": True, "n_decoded": 9}], "prompt": "<|im_start|>user\nsay AMBER-CEDAR-11"},
    {"id": 2, "n_ctx": 512, "is_processing": True},
]


def test_slots_parsing_busy_context_and_owner():
    slots = parse_slots(SLOTS, {"r007": "AMBER-CEDAR-11", "r008": "TULIP-RIVER-20"})
    assert [(s.id, s.n_ctx, s.busy, s.context_tokens, s.request_id) for s in slots] == [
        (0, 512, False, None, None), (1, 512, True, 360, "r007"), (2, 512, True, None, None)]
    assert parse_slots({"error": "slots endpoint disabled"}) is None


def test_server_samples_in_the_run_and_the_summary():
    fake = FakeOpenAI(delay_s=0.01, metrics=VLLM_METRICS, slots=SLOTS)
    session, events = run(fake, scenario(2), detectors=("canary",), poll_interval_s=0.01)
    samples = [e for e in events if isinstance(e, ServerSample)]
    assert samples and all((s.running, s.waiting, s.kv_usage) == (7.0, 4.0, 0.375) for s in samples)
    assert [slot.id for slot in samples[0].slots] == [0, 1, 2]
    assert session.summary.kv_cache_usage_perc_peak == 0.375
    assert session.summary.num_requests_waiting_peak == 4


def test_a_server_without_metrics_or_slots_gives_no_samples():
    fake = FakeOpenAI()
    _, events = run(fake, scenario(2), detectors=("canary",), poll_interval_s=0.01)
    assert not [e for e in events if isinstance(e, ServerSample)]


# -- detectors -------------------------------------------------------------------------------------------
def test_leaking_server_is_caught_by_canary_with_victim_and_source():
    from kvtui.run.outcome import verdict

    spec = scenario(4)
    fake = FakeOpenAI(leak=True, delay_s=0.01)
    session, _ = run(fake, spec, detectors=("canary",))
    by_phrase = phrases(spec)
    truth = {(by_phrase[victim], by_phrase[leaked]) for victim, leaked in fake.leaks}
    assert len(truth) == 3  # every request after the first was answered with the one before's passphrase
    found = {(e.victim, e.source) for e in session.contamination if e.detector == "canary"}
    assert found == truth
    assert all(e.kind == "cross_request" for e in session.contamination)
    assert verdict(spec, session).failed


@pytest.mark.parametrize(("gap", "swap", "logprobs", "kind"), [
    (0.01, True, True, "numeric"),  # the same top two, swapped, within the tolerance: a flipped near tie
    (2.0, True, True, "corruption"),  # swapped but far apart
    (0.01, False, True, "corruption"),  # close, but the load run's runner-up is not the solo run's token
    (2.0, True, False, "unknown")])  # no logprobs: nothing to judge by
def test_reference_labels_a_load_dependent_answer(gap, swap, logprobs, kind):
    from kvtui.run.outcome import verdict

    spec = scenario(3)
    fake = FakeOpenAI(delay_s=0.02, vary_under_load=(2, gap, swap), logprobs=logprobs)
    session, _ = run(fake, spec)
    reports = [e for e in session.contamination if e.detector == "reference"]
    assert sorted(e.victim for e in reports) == sorted(phrases(spec).values())
    assert {e.kind for e in reports} == {kind}
    assert all(e.source is None for e in reports)  # a changed token names no source
    assert all(e.evidence.token_index == 2 for e in reports)
    assert all(len(e.evidence.suspects) == 2 for e in reports)  # the other two were in flight alongside
    assert session.summary.reference_checked == 3
    assert verdict(spec, session).failed == (kind == "corruption")


def test_arrive_and_finish_carry_each_requests_tenant_as_in_a_local_run():
    spec = scenario(6, extra="tenants: {count: 3, assign: round_robin}")
    planned = {p.request_id: p.tenant for p in plan_requests(spec, TOK)}
    assert sorted(set(planned.values())) == ["t0", "t1", "t2"]
    _, events = run(FakeOpenAI(), spec, detectors=("canary",))
    arrive = {e.request_id: e.tenant for e in events if e.type == "request.arrive"}
    finish = {e.request_id: e.tenant for e in events if isinstance(e, Finish)}
    assert arrive == finish == planned


def test_a_correct_server_passes_every_detector():
    spec = scenario(4)
    fake = FakeOpenAI(delay_s=0.01)
    session, _ = run(fake, spec)
    assert session.contamination == []
    assert session.summary.reference_checked == 4 and session.summary.passphrase_echoed == 4
    assert len(fake.requests) == 8  # the load, then each prompt once more alone


# -- the command line, over real HTTP ------------------------------------------------------------------
def write_scenario(tmp_path, n=4, expect="none"):
    path = tmp_path / "s.yaml"
    path.write_text(f"name: cli-target\nseed: 3\nmax_requests: {n}\nmodel: tiny-llama\n"
                    "arrivals: {process: poisson, rate_per_s: 40}\nprompts: {kind: passphrase}\n"
                    f"output_tokens: 8\nexpect: {{contamination: {expect}}}\n")
    return path


def test_cli_run_target_records_and_replays(tmp_path):
    path, rec = write_scenario(tmp_path), tmp_path / "run.jsonl"
    with FakeHTTPServer(FakeOpenAI(metrics=LLAMACPP_METRICS, slots=SLOTS[:1])) as url:
        out = subprocess.run(KVTUI + ["run", str(path), "--target", url, "--headless", "--record", str(rec)],
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    header, events, summary, truncated = read_recording(rec)
    assert header.target == url and header.clock == "wall" and not truncated
    assert summary.finish_reasons == {"stop": 4} and summary.reference_checked == 4
    assert any(isinstance(e, ServerSample) and e.running == 3.0 for e in events)
    replay = subprocess.run(KVTUI + ["replay", str(rec), "--summary"], capture_output=True, text=True, timeout=300)
    assert replay.returncode == 0
    assert re.search(r"own passphrase echoed +4/4", replay.stdout)
    assert re.search(r"reference checks +4 checked", replay.stdout)


def test_cli_run_target_leak_exits_1_naming_victim_and_source(tmp_path):
    fake = FakeOpenAI(leak=True)
    with FakeHTTPServer(fake) as url:
        out = subprocess.run(KVTUI + ["run", str(write_scenario(tmp_path)), "--target", url, "--headless"],
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    by_phrase = {p.passphrase: p.request_id
                 for p in plan_requests(parse_scenario(write_scenario(tmp_path).read_text()), TOK)}
    victim, leaked = fake.leaks[0]
    assert f"{by_phrase[victim]} <- {by_phrase[leaked]}" in out.stdout + out.stderr


def test_cli_target_bad_input_is_one_line_exit_2(tmp_path):
    path = write_scenario(tmp_path)
    cases = [(["--target", "localhost:8000"], "not an http(s) URL"),
             (["--target", "http://127.0.0.1:9", "--fault", "stale_slot"], "--fault"),
             (["--target", "http://127.0.0.1:9"], "cannot reach")]
    for args, message in cases:
        out = subprocess.run(KVTUI + ["run", str(path), "--headless", *args], capture_output=True, text=True,
                             timeout=300)  # a loaded 2-core machine takes minutes to import torch in a subprocess
        assert out.returncode == 2, (args, out.stderr)
        assert message in out.stderr and "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1


def test_a_recording_that_cannot_take_its_header_is_refused_before_any_request():
    """As a local run (tests/run/test_run_outcomes.py): the header is written, then the recording is watched,
    so an unwritable first line raises OSError instead of only stopping the recording."""
    fake = FakeOpenAI()
    seen: list = []
    session = TargetSession(scenario(4), TOK, TargetOptions(url="http://fake", transport=fake.transport()),
                            listeners=(seen.append,), record_path="/dev/full")
    with pytest.raises(OSError) as caught:
        session.run()
    assert caught.value.errno == errno.ENOSPC
    assert fake.requests == [] and [e.type for e in seen] == ["header"]  # no request sent, no RecordingFailed


def test_a_stop_after_every_request_finished_skips_the_references_but_is_not_stopped_early():
    """One closing rule for both kinds of run (kvtui.run.base.RunBase): stopped early means a stop left
    requests unsent or cut off in flight, as in a local run; the references it skipped count as `stopped`."""
    fake = FakeOpenAI()
    session = TargetSession(scenario(4), TOK, TargetOptions(url="http://fake", transport=fake.transport()))
    finished: list = []

    def stop_at_the_last_finish(event) -> None:
        if isinstance(event, Finish):
            finished.append(event)
            session.stop_requested = len(finished) == 4

    session.listeners.append(stop_at_the_last_finish)
    summary = session.run()
    assert summary.finish_reasons == {"stop": 4} and summary.requests_not_submitted == 0
    assert summary.reference_skipped_by_reason == {"stopped": 4} and summary.reference_checked == 0
    assert summary.stopped_early is False


def test_cli_run_target_refuses_a_recording_that_cannot_take_its_first_line(tmp_path):
    fake = FakeOpenAI()
    with FakeHTTPServer(fake) as url:
        out = subprocess.run(KVTUI + ["run", str(write_scenario(tmp_path)), "--target", url, "--headless",
                                      "--record", "/dev/full"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert [line for line in out.stderr.splitlines() if line.strip()] == [
        "error: /dev/full: cannot write the recording (No space left on device); choose another --record path"]
    assert fake.requests == [] and os.path.exists("/dev/full")


# -- noninterference -------------------------------------------------------------------------------------
def test_noninterference_audit_against_a_correct_and_a_leaking_server():
    from kvtui.remote.audit import run_target_audit

    spec = scenario(4)
    options = dict(url="http://fake", max_concurrency=8)
    clean = FakeOpenAI(delay_s=0.01)
    audit = run_target_audit(spec, TOK, TargetOptions(transport=clean.transport(), **options))
    assert audit.events == [] and audit.compared == 4 and audit.cached == 0
    assert len(clean.requests) == 12  # three runs of four
    leaky = FakeOpenAI(delay_s=0.01, leak=True)
    events = run_target_audit(spec, TOK, TargetOptions(transport=leaky.transport(), **options)).events
    assert events and {e.kind for e in events} == {"cross_request"}
    for e in events:  # a kept request, and the neighbours named were the replaced ones
        replaced_parity = 1 - int(e.victim[1:]) % 2
        assert e.evidence.replaced_neighbours
        assert all(int(n[1:]) % 2 == replaced_parity for n in e.evidence.replaced_neighbours)
        assert e.evidence.baseline_text != e.evidence.text_with_neighbours_replaced


# -- llama.cpp's llama-server ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_server_url():
    from kvtui.models import ModelLoadError, default_model_path
    from kvtui.remote.llama_server import LlamaServer, find_llama_server

    if find_llama_server() is None:
        pytest.skip("llama-server not built: run scripts/build-llama-server.sh")
    try:
        gguf = default_model_path()
    except ModelLoadError as exc:
        pytest.skip(str(exc))
    with LlamaServer(gguf, parallel=4, ctx_per_slot=512, threads=1, slots_debug=True) as server:
        yield server.url


@pytest.mark.llama_server
def test_passphrase_against_llama_server_is_clean_and_replays(llama_server_url, tmp_path):
    rec = tmp_path / "llama.jsonl"
    out = subprocess.run(KVTUI + ["run", "scenarios/passphrase.yaml", "--target", llama_server_url, "--headless",
                                  "--record", str(rec)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    header, events, summary, truncated = read_recording(rec)
    assert not truncated and header.target == llama_server_url
    assert summary.finish_reasons == {"stop": 8} and summary.passphrase_echoed == 8
    assert summary.reference_checked == 8 and summary.contamination_total() == 0
    finishes = [e for e in events if isinstance(e, Finish)]
    assert all(f.prompt_tokens == len(f.prompt_ids) for f in finishes)  # the server's count = our tokenizer's
    samples = [e for e in events if isinstance(e, ServerSample)]
    assert {len(s.slots) for s in samples} == {4} and {s.slots[0].n_ctx for s in samples} == {512}
    assert any(slot.busy and slot.request_id for s in samples for slot in s.slots)  # slots matched to requests
    replay = subprocess.run(KVTUI + ["replay", str(rec), "--summary"], capture_output=True, text=True, timeout=300)
    assert replay.returncode == 0 and re.search(r"requests +8 \(stop 8\)", replay.stdout)


# -- request bodies and the tokenizer ------------------------------------------------------------------
def test_request_bodies_per_api_and_prompt_kind():
    synthetic = parse_scenario("max_requests: 1\nmodel: tiny-llama\narrivals: {process: burst, size: 1, every_s: 9}\n"
                               "prompts: {kind: synthetic, prompt_tokens: 12}\noutput_tokens: 5\n"
                               'sampling: {temperature: 0.7, top_k: 5, stop: ["\\n"]}\n')
    fake = FakeOpenAI()
    run(fake, synthetic, detectors=(), api="completions")
    run(fake, synthetic, detectors=(), api="chat")
    planned = plan_requests(synthetic, TOK)[0]
    completions, chat = fake.requests
    assert completions["prompt"] == planned.prompt_ids  # no text: the token ids
    assert chat["messages"] == [{"role": "user", "content": TOK.decode(planned.prompt_ids)}]
    for body in (completions, chat):
        assert (body["max_tokens"], body["temperature"], body["top_k"], body["stop"]) == (5, 0.7, 5, ["\n"])
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["model"] == "fake-model"  # the first of /v1/models
    assert completions["logprobs"] == 5 and (chat["logprobs"], chat["top_logprobs"]) == (True, 5)
    passphrase = scenario(1)
    run(fake, passphrase, detectors=(), api="completions")
    text = plan_requests(passphrase, TOK)[0].text
    assert fake.requests[-1]["prompt"] == text  # a prompt with text is sent as text


@pytest.mark.smollm
def test_tokenizer_alone_plans_the_same_prompts_as_the_loaded_model(smollm2):
    from kvtui.models import load_tokenizer
    from kvtui.scenario import load_scenario

    spec = load_scenario("scenarios/passphrase.yaml")
    alone = plan_requests(spec, load_tokenizer("default"))
    assert [p.prompt_ids for p in alone] == [p.prompt_ids for p in plan_requests(spec, smollm2.tokenizer)]


def test_cli_sigterm_aborts_in_flight_requests_and_writes_the_summary(tmp_path):
    import signal
    import time

    rec = tmp_path / "stopped.jsonl"
    with FakeHTTPServer(FakeOpenAI(), chunk_delay_s=1.0) as url:  # each answer takes about 8 s
        proc = subprocess.Popen(KVTUI + ["run", str(write_scenario(tmp_path)), "--target", url, "--headless",
                                         "--record", str(rec)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not rec.exists() or "request.arrive" not in rec.read_text()):
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143, stderr  # 128 + SIGTERM, as for a local run
    assert "interrupted by SIGTERM" in stderr
    header, events, summary, truncated = read_recording(rec)
    assert not truncated and summary.stopped_early
    finishes = [e for e in events if isinstance(e, Finish)]
    assert finishes and {f.finish_reason for f in finishes} == {"abort"}
    # aborted requests have no answer to check: failed (abort), not reference checks skipped at the stop
    assert summary.reference_skipped == 0 and summary.reference_checked == 0


def test_cli_exits_3_when_no_request_completes(tmp_path):
    path = write_scenario(tmp_path)
    every = tuple(phrases(parse_scenario(path.read_text())))
    with FakeHTTPServer(FakeOpenAI(fail=every)) as url:
        out = subprocess.run(KVTUI + ["run", str(path), "--target", url, "--headless"], capture_output=True,
                             text=True, timeout=120)
    assert out.returncode == 3
    assert out.stderr.strip().splitlines()[-1].startswith("error: no request completed") and "HTTP 500" in out.stderr


# -- kvtui's own server (`kvtui serve`) as the target: ground truth from its own events ---------------------
@pytest.fixture
def kvtui_serve(tmp_path):
    """Start `kvtui serve` on SmolLM2 (4 slots of 512 tokens, as scenarios/passphrase.yaml's engine) with the
    given faults; yields (url, recording path); stopped with SIGINT (it then writes its summary)."""
    import contextlib
    import signal
    import time

    pytest.importorskip("kvtui.serve", reason="kvtui serve is not in this checkout")

    @contextlib.contextmanager
    def start(*faults: str):
        rec = tmp_path / f"serve{'-'.join(('',) + faults)}.jsonl"
        args = ["serve", "--model", "default", "--port", "0", "--slots", "4", "--max-len", "512", "--threads", "1",
                "--record", str(rec)] + [a for f in faults for a in ("--fault", f)]
        proc = subprocess.Popen(KVTUI + args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            url, deadline = None, time.monotonic() + 120
            while url is None and time.monotonic() < deadline:
                line = proc.stderr.readline()
                found = re.search(r"serving .* at (http://127\.0\.0\.1:\d+)/v1", line)
                url = found.group(1) if found else None
                assert line or proc.poll() is None, "kvtui serve exited during startup"
            assert url, "kvtui serve did not start"
            yield url, rec
        finally:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=300)
    return start


def server_truth(serve_rec, client_rec) -> tuple[set[str], set[str]]:
    """The server's own finding: (our ids of load-run requests its engine detectors saw contaminated, our
    ids of every load-run request), matched by prompt ids; the load is the server's first 8 arrivals."""
    from kvtui.events import Arrive, Contamination

    _, ours, _, _ = read_recording(client_rec)
    by_prompt = {tuple(f.prompt_ids): f.request_id for f in ours if isinstance(f, Finish)}
    _, theirs, _, _ = read_recording(serve_rec)
    load = [e.request_id for e in theirs if isinstance(e, Arrive)][:8]
    prompts = {f.request_id: tuple(f.prompt_ids) for f in theirs if isinstance(f, Finish)}
    victims = {by_prompt[prompts[e.victim]] for e in theirs if isinstance(e, Contamination) and e.victim in load
               and e.detector in ("slot_taint", "attention_flow") and e.kind == "cross_request"}
    return victims, {by_prompt[prompts[rid]] for rid in load}


@pytest.mark.smollm
def test_kvtui_serve_without_faults_is_clean_from_outside_and_inside(kvtui_serve, tmp_path, smollm2):
    rec = tmp_path / "clean.jsonl"
    with kvtui_serve() as (url, serve_rec):
        out = subprocess.run(KVTUI + ["run", "scenarios/passphrase.yaml", "--target", url, "--headless", "--record",
                                      str(rec)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    _, events, summary, _ = read_recording(rec)
    assert summary.contamination_events_total == () and summary.reference_checked == 8
    victims, load = server_truth(serve_rec, rec)
    assert victims == set() and len(load) == 8  # the server's own detectors agree: nothing leaked


@pytest.mark.smollm
def test_kvtui_serve_with_stale_slot_is_caught_from_outside(kvtui_serve, tmp_path, smollm2):
    """stale_slot on the server: the requests its in-engine detectors saw reading an earlier request's KV
    are all reported from outside. The reference check reports more: on this server a request sent alone
    also lands in a used slot, so its solo run is damaged too and differs from a clean load-run answer."""
    rec = tmp_path / "stale.jsonl"
    with kvtui_serve("stale_slot") as (url, serve_rec):
        out = subprocess.run(KVTUI + ["run", "scenarios/passphrase.yaml", "--target", url, "--headless", "--record",
                                      str(rec)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 1 and "unexpected contamination" in out.stderr
    _, events, summary, _ = read_recording(rec)
    caught = {e.victim for e in events if getattr(e, "detector", None) in ("reference", "canary")
              and e.kind in ("cross_request", "corruption")}
    victims, load = server_truth(serve_rec, rec)
    assert victims  # the fault acted on the load
    assert victims <= caught <= load


# -- the dashboard -----------------------------------------------------------------------------------------
def dashboard_run(session, *, size=(160, 45), keys=(), done=True):
    """Drive a TargetSource in the app until the run is done; returns (source, screen text)."""
    import asyncio

    from kvtui.tui.app import KvtuiApp, screen_text
    from kvtui.tui.target_source import TargetSource

    async def go():
        source = TargetSource(lambda listener: (session.listeners.append(listener), session)[1])
        app = KvtuiApp(source)
        async with app.run_test(size=size) as pilot:
            for key in keys:
                await pilot.press(key)
            deadline = asyncio.get_running_loop().time() + 30
            while done and source.summary is None:
                assert asyncio.get_running_loop().time() < deadline, "the run did not finish"
                await pilot.pause(0.05)
            await pilot.pause(0.3)
            text = screen_text(app)
            await pilot.press("q")
        return source, text

    return asyncio.run(go())


@pytest.mark.parametrize("size", [(160, 45), (100, 30)])
def test_dashboard_shows_what_the_server_exposes(size, tmp_path):
    fake = FakeOpenAI(delay_s=0.02, metrics=VLLM_METRICS, slots=SLOTS)
    spec = scenario(4, arrivals="{process: poisson, rate_per_s: 20}")
    session = TargetSession(spec, TOK, TargetOptions(url="http://fake", transport=fake.transport(),
                                                     poll_interval_s=0.05), record_path=tmp_path / "d.jsonl")
    source, text = dashboard_run(session, size=size)
    for needle in ("target http://fake", "DONE", "idle · n_ctx 512", "360/512", "2/3 slots busy (llama.cpp /slots)",
                   "KV usage   37.5%", "running 7  waiting 4", "spec     not exposed", "TTFT", "r000", "r003",
                   "finished 4", "no contamination detected"):
        assert needle in text, f"{needle!r} not on the {size} screen:\n{text}"
    assert "isolation" not in text.splitlines()[0]  # the client cannot know a server's faults
    header, events, summary, truncated = read_recording(tmp_path / "d.jsonl")
    assert summary is not None and summary.finish_reasons == {"stop": 4}


def test_dashboard_slot_map_names_the_requests_in_the_servers_slots():
    fake = FakeOpenAI(delay_s=0.2, slots="live")  # each answer takes about 1.6 s
    session = TargetSession(scenario(3), TOK, TargetOptions(url="http://fake", transport=fake.transport(),
                                                            poll_interval_s=0.05), detectors=("canary",))
    _, text = dashboard_run(session, done=False, keys=())
    assert "3/4 slots busy" in text and all(f"r00{i}" in text.split("╰")[0] for i in range(3))


def test_dashboard_says_what_a_bare_server_does_not_expose():
    session = TargetSession(scenario(2), TOK, TargetOptions(url="http://bare", transport=FakeOpenAI().transport(),
                                                            poll_interval_s=0.05), detectors=("canary",))
    _, text = dashboard_run(session)
    for needle in ("the server exposes no slot map", "KV usage not exposed", "running not exposed",
                   "prompt   not exposed"):
        assert needle in text, f"{needle!r} not on the screen:\n{text}"


def test_dashboard_replays_a_target_recording(tmp_path):
    import asyncio

    from kvtui.tui.app import KvtuiApp, screen_text
    from kvtui.tui.replay import ReplaySource

    rec = tmp_path / "r.jsonl"
    fake = FakeOpenAI(delay_s=0.01, metrics=LLAMACPP_METRICS, slots=SLOTS, leak=True)
    run(fake, scenario(4), record=rec, poll_interval_s=0.02)

    async def go():
        source = ReplaySource.from_file(rec, speed=64.0)
        app = KvtuiApp(source)
        async with app.run_test(size=(160, 45)) as pilot:
            while not source.at_end:
                await pilot.pause(0.05)
            await pilot.pause(0.2)
            text = screen_text(app)
            await pilot.press("q")
        return text

    text = asyncio.run(go())
    for needle in ("target http://fake", "END", "slots busy", "running 3", "waiting 1", "KV usage not exposed",
                   "LEAK←", "canary"):
        assert needle in text, f"{needle!r} not on the screen:\n{text}"


def test_holding_arrivals_delays_the_rest_of_the_plan_by_the_time_held():
    import threading
    import time

    from kvtui.events import Arrive

    spec = scenario(3, arrivals="{process: constant, rate_per_s: 5}")  # planned at 0, 0.2, 0.4 s
    planned = [p.arrival_s for p in plan_requests(spec, TOK)]
    fake = FakeOpenAI()
    arrivals = []

    finishes = {}

    def on_event(event):
        if isinstance(event, Finish):
            finishes[event.request_id] = event.arrival_s
        if isinstance(event, Arrive):
            arrivals.append((event.request_id, event.t))
            if event.request_id == "r000":
                session.hold(True)
                threading.Timer(0.6, session.hold, args=(False,)).start()

    session = TargetSession(spec, TOK, TargetOptions(url="http://fake", transport=fake.transport()),
                            detectors=(), listeners=(on_event,))
    started = time.perf_counter()
    session.run()
    assert time.perf_counter() - started >= 0.6 + planned[2]
    held = session.held_s
    assert 0.55 <= held <= 1.0
    assert [rid for rid, _ in arrivals] == ["r000", "r001", "r002"]
    assert [t for _, t in arrivals][1:] == pytest.approx([planned[1] + held, planned[2] + held])
    assert finishes == dict(arrivals)  # latencies count from the arrival as it happened


def test_divergence_labels_from_both_runs_top_logprobs():
    """Hand-made logprobs in the two shapes servers send; the labels follow from the numbers here."""
    from kvtui.remote.openai import StreamResult, parse_logprobs
    from kvtui.remote.solo_check import first_divergence

    def result(*entries) -> StreamResult:
        tokens = parse_logprobs({"content": [{"token": tok, "logprob": top[0][1],
                                              "top_logprobs": [{"token": k, "logprob": v} for k, v in top]}
                                             for tok, top in entries]})
        return StreamResult(sent_s=0.0, tokens=tokens, pieces=[tok for tok, _ in entries])

    same = (" x", [(" x", -0.1), (" y", -4.0)])
    three_way_a = (" A", [(" A", -1.0), (" C", -1.01), (" B", -1.02)])
    three_way_b = (" B", [(" B", -1.0), (" A", -1.015), (" C", -1.03)])
    d = first_divergence(result(same, three_way_a), result(same, three_way_b), tolerance=0.5)
    assert (d.index, d.kind, d.batched_piece, d.solo_piece) == (1, "numeric", " A", " B")
    assert d.gap == pytest.approx(0.02)  # the larger of 0.02 (B under A's run) and 0.015 (A under B's run)
    far = (" Z", [(" Z", -0.2), (" Q", -3.0), (" R", -4.0)])  # A is not in its top 3, the last of which is 3.8 below
    assert first_divergence(result(three_way_a), result(far), tolerance=0.5).kind == "corruption"
    flat = (" Z", [(" Z", -1.0), (" Q", -1.05)])  # A is not listed, but the list spans only 0.05 nats
    assert first_divergence(result(three_way_a), result(flat), tolerance=0.5).kind == "unknown"
    assert first_divergence(result(same, three_way_a), result(same, three_way_a), tolerance=0.5) is None
    legacy = parse_logprobs({"tokens": [" a", " b"], "token_logprobs": [-0.1, -0.5],
                             "top_logprobs": [{" c": -0.12, " a": -0.1}, {" b": -0.5, " d": -3.0}]})
    assert [(t.key, t.top) for t in legacy] == [(" a", ((" a", -0.1), (" c", -0.12))),
                                                (" b", ((" b", -0.5), (" d", -3.0)))]
    assert legacy[0].top2_gap == pytest.approx(0.02)


def test_logprob_drift_is_the_largest_move_of_a_token_both_runs_list():
    """Two answers with the same tokens: the drift is the largest |logprob difference| over the tokens both
    runs list at a position; answers that differ, or carry no logprobs, have none."""
    from kvtui.remote.openai import StreamResult, parse_logprobs
    from kvtui.remote.solo_check import logprob_drift

    def result(*entries) -> StreamResult:
        tokens = parse_logprobs({"content": [{"token": tok, "logprob": top[0][1],
                                              "top_logprobs": [{"token": k, "logprob": v} for k, v in top]}
                                             for tok, top in entries]})
        return StreamResult(sent_s=0.0, tokens=tokens, pieces=[tok for tok, _ in entries])

    cached = result((" The", [(" The", -0.30), (" GARDEN", -1.50)]), (" pass", [(" pass", -0.01), (" key", -5.0)]))
    solo = result((" The", [(" The", -0.43), (" GARDEN", -1.40)]), (" pass", [(" pass", -0.01), (" word", -5.2)]))
    drift = logprob_drift(cached, solo)
    assert (drift.index, drift.token) == (0, " The") and drift.nats == pytest.approx(0.13)
    assert logprob_drift(solo, solo).nats == 0.0
    other = result((" GARDEN", [(" GARDEN", -0.2), (" The", -1.7)]), (" pass", [(" pass", -0.01)]))
    assert logprob_drift(cached, other) is None  # a different token: first_divergence judges it
    assert logprob_drift(StreamResult(sent_s=0.0, pieces=[" The"]), solo) is None  # no logprobs
    # two ids with one text (byte tokens shown as "\ufffd") are left out: their logprobs cannot be told apart
    twin = result((" x", [(" x", -0.1), ("\ufffd", -3.0), ("\ufffd", -5.0)]))
    assert logprob_drift(twin, twin).nats == 0.0


def test_cli_audit_target_names_the_replaced_neighbours(tmp_path):
    path = write_scenario(tmp_path)
    with FakeHTTPServer(FakeOpenAI()) as url:
        clean = subprocess.run(KVTUI + ["audit", str(path), "--target", url], capture_output=True, text=True,
                               timeout=120)
    assert clean.returncode == 0, clean.stderr
    assert "noninterference holds" in clean.stdout
    with FakeHTTPServer(FakeOpenAI(leak=True)) as url:
        leaky = subprocess.run(KVTUI + ["audit", str(path), "--target", url], capture_output=True, text=True,
                               timeout=120)
    assert leaky.returncode == 1 and "noninterference violated" in leaky.stderr
    assert "cross_request" in leaky.stdout and "noninterference" in leaky.stdout
