"""How a run ends when it cannot do what it was asked: a recording whose writes fail (disk full, file
too large), a second writer on one recording, recordings' file mode; runs that would test nothing
(no request fits the engine, a fault that cannot act in the layout or KV mode, every request rejected);
and interrupted runs (SIGINT, SIGTERM) with their exit codes."""

from __future__ import annotations

import errno
import json
import os
import re
import resource
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from kvtui.cli import app
from kvtui.events import Finish, RecordingFailed
from kvtui.record import RecordingWriter, read_recording
from kvtui.scenario import parse_scenario, plan_requests
from kvtui.scenario.fit import check_fit
from kvtui.serve.server import ServeOptions, ServeServer
from kvtui.session import Session

ROOT = Path(__file__).resolve().parents[2]
KVTUI = [sys.executable, "-m", "kvtui.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
WAIT_S = 300  # subprocess waits: generous, a loaded 2-core machine runs these several times slower

SMALL = """
name: outcomes
seed: 3
max_requests: 8
model: tiny-llama
engine: {slots: 3, max_len: 256}
arrivals: {process: poisson, rate_per_s: 8.0}
prompts: {kind: passphrase}
output_tokens: 8
"""


class FullDisk:
    """A recording's file whose writes fail with ENOSPC after `good` of them (a disk that fills up)."""

    def __init__(self, inner, good: int) -> None:
        self.inner, self.good = inner, good

    def write(self, text: str) -> int:
        if self.good <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.good -= 1
        return self.inner.write(text)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def no_bigger_than(limit: int):
    """preexec_fn: files this process writes stop at `limit` bytes (EFBIG), SIGXFSZ ignored, as when the
    disk holding the recording fills up."""
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def write(tmp_path: Path, text: str, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


# -- recordings -----------------------------------------------------------------------------------------

def test_a_failed_write_stops_the_recording_and_the_run_finishes(tiny, tmp_path):
    path = tmp_path / "run.jsonl"
    seen: list = []
    session = Session(parse_scenario(SMALL), tiny["tiny-llama"], clock="virtual", record_path=path,
                      listeners=(seen.append,))
    session.recorder._file = FullDisk(session.recorder._file, good=5)
    summary = session.run()
    assert summary.requests_finished == 8 and summary.finish_reasons == {"length": 8}
    failed = [e for e in seen if isinstance(e, RecordingFailed)]
    assert len(failed) == 1 and failed[0].path == str(path) and failed[0].error == "No space left on device (ENOSPC)"
    assert failed[0].lines == 1 + 5 == len(path.read_text().splitlines())  # the header, then 5 good writes
    assert session.recording_error == f"{path}: recording stopped after 6 lines: No space left on device (ENOSPC)"
    header, events, recorded, truncated = read_recording(path)
    assert recorded is None and truncated and len(events) == 5


def test_the_dashboard_logs_a_stopped_recording():
    from kvtui.tui.state import DashboardState

    state = DashboardState()
    state.apply(RecordingFailed(t=2.5, path="runs/a.jsonl", lines=40, error="No space left on device (ENOSPC)"))
    (line,) = state.log
    assert (line.t, line.kind, line.text) == (2.5, "error", "recording stopped after 40 lines: No space left on "
                                                            "device (ENOSPC); the run goes on")


def test_a_run_whose_recording_fills_the_disk_prints_one_line_and_its_summary_and_exits_3(tmp_path):
    scenario = write(tmp_path, SMALL)
    path = tmp_path / "run.jsonl"
    limit = 20_000
    r = subprocess.run(KVTUI + ["run", str(scenario), "--headless", "--record", str(path)], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=WAIT_S, preexec_fn=no_bigger_than(limit))
    assert r.returncode == 3, r.stderr
    assert "Traceback" not in r.stderr
    (line,) = error_lines(r.stderr)
    found = re.fullmatch(rf"error: {re.escape(str(path))}: recording stopped after (\d+) lines: File too large "
                         r"\(EFBIG\); the run went on without it \(free space, or choose another --record path\)", line)
    assert found, line
    assert "outcomes on tiny-llama" in r.stdout and re.search(r"requests +8 \(length 8\)", r.stdout)
    assert "recording:" not in r.stdout
    kept = path.read_bytes()
    assert len(kept) <= limit
    header, events, recorded, truncated = read_recording(path)
    assert recorded is None and truncated
    assert kept.count(b"\n") == int(found.group(1)) == len(events) + 1


def test_a_recording_that_cannot_take_its_first_line_is_refused_at_start():
    r = subprocess.run(KVTUI + ["run", "scenarios/passphrase.yaml", "--model", "tiny-llama", "--headless",
                                "--record", "/dev/full"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=WAIT_S)
    assert r.returncode == 2 and error_lines(r.stderr) == [
        "error: /dev/full: cannot write the recording (No space left on device); choose another --record path"]


def test_serve_goes_on_when_its_recording_fails_and_counts_it(tmp_path):
    record = tmp_path / "serve.jsonl"
    server = ServeServer(ServeOptions(model="tiny-llama", port=0, max_len=512, record=record, detectors=()))
    warnings: list[str] = []
    server.warn = warnings.append
    with server:
        body = {"prompt": "hello", "max_tokens": 4, "ignore_eos": True}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code == 200
        server.session.recorder._file = FullDisk(server.session.recorder._file, good=0)
        for _ in range(3):
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
            assert r.json()["usage"]["completion_tokens"] == 4
        samples = {(s.name, s.labels.get("finished_reason")): s.value
                   for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text) for s in f.samples}
        assert samples[("kvtui:recording_errors_total", None)] == 1
        assert samples[("vllm:request_success_total", "length")] == 4
    assert server.error is None and server.summary is not None and server.summary.finish_reasons == {"length": 4}
    assert len(warnings) == 1 and warnings[0].startswith(f"{record}: recording stopped after ")
    assert warnings[0].endswith(": No space left on device (ENOSPC); serving goes on without it (counted in "
                                "kvtui:recording_errors_total)")


def test_the_serve_command_keeps_serving_past_a_full_disk_then_prints_its_summary_and_exits_3(tmp_path):
    record = tmp_path / "serve.jsonl"
    process = subprocess.Popen(KVTUI + ["serve", "--model", "tiny-llama", "--port", "0", "--record", str(record),
                                        "--detectors", "none", "--threads", "1"], cwd=ROOT, env=ENV,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=no_bigger_than(8_000))
    try:
        url = None
        for line in process.stderr:
            found = re.search(r"serving tiny-llama at (http://[\d.:]+)/v1", line)
            if found:
                url = found.group(1)
                break
        assert url, "no 'serving' line"
        body = {"prompt": "hello there", "max_tokens": 24, "ignore_eos": True}
        for _ in range(6):  # each answer records its steps: the file passes 8 kB on the way
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24
        text = httpx.get(url + "/metrics", timeout=30).text
        assert re.search(r'^kvtui:recording_errors_total\{model_name="tiny-llama"\} 1\.0$', text, re.M), text
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=WAIT_S)
    finally:
        process.kill()
    assert process.returncode == 3, err
    assert "Traceback" not in err
    assert re.search(rf"warning: {re.escape(str(record))}: recording stopped after \d+ lines: File too large \(EFBIG\); "
                     "serving goes on without it", err)
    assert err.strip().splitlines()[-1].startswith(f"error: {record}: recording stopped after ")
    assert "kvtui serve on tiny-llama" in out and re.search(r"requests +6 \(length 6\)", out)


def test_a_second_writer_of_one_recording_is_refused_and_the_first_ones_file_stays_whole(tmp_path):
    path = tmp_path / "one.jsonl"
    first = RecordingWriter(path)
    first._file.write('{"line": 1}\n')
    first._file.flush()
    with pytest.raises(OSError) as refused:
        RecordingWriter(path)
    assert refused.value.errno == errno.EAGAIN and "another process is writing this recording" in str(refused.value)
    assert path.read_text() == '{"line": 1}\n'
    first.close()
    RecordingWriter(path).close()  # free again once the first closed
    assert path.read_text() == ""


def test_two_runs_given_one_record_path_refuse_the_second_and_keep_the_first_whole(tmp_path):
    scenario = write(tmp_path, SMALL.replace("max_requests: 8", "max_requests: 400").replace("rate_per_s: 8.0",
                                                                                           "rate_per_s: 4.0"))
    path = tmp_path / "shared.jsonl"
    args = KVTUI + ["run", str(scenario), "--headless", "--clock", "wall", "--detectors", "none", "--record", str(path)]
    first = subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + WAIT_S
        while not path.exists() or '"type":"step"' not in path.read_text():
            assert time.monotonic() < deadline and first.poll() is None, "the first run never stepped"
            time.sleep(0.2)
        second = subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=WAIT_S)
        assert second.returncode == 2, second.stderr
        assert error_lines(second.stderr) == [
            f"error: {path}: cannot write the recording (another process is writing this recording (it holds the "
            "file's lock); wait for it to finish); choose another --record path"]
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=WAIT_S)
    finally:
        first.kill()
    assert first.returncode == 130
    header, events, summary, truncated = read_recording(path)
    assert not truncated and summary is not None and summary.stopped_early
    assert sum(1 for line in path.read_text().splitlines() if '"type":"header"' in line) == 1


def test_recordings_are_created_readable_by_their_owner_only(tmp_path):
    old = os.umask(0o022)
    try:
        fresh = tmp_path / "fresh.jsonl"
        RecordingWriter(fresh).close()
        existing = tmp_path / "existing.jsonl"
        existing.write_text("old\n")
        existing.chmod(0o644)
        RecordingWriter(existing).close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o600
    assert stat.S_IMODE(existing.stat().st_mode) == 0o600 and existing.read_text() == ""


# -- runs that test nothing -----------------------------------------------------------------------------

def planned_lengths(text: str, tiny) -> list[int]:
    return [len(p.prompt_ids) + p.sampling.max_new_tokens
            for p in plan_requests(parse_scenario(text), tiny["tiny-llama"].tokenizer)]


def test_validate_and_run_refuse_a_scenario_in_which_no_request_fits(tiny, tmp_path):
    text = SMALL.replace("max_len: 256", "max_len: 128").replace("output_tokens: 8", "output_tokens: 64")
    longest = max(planned_lengths(text, tiny))
    prompts = sorted(n - 64 for n in planned_lengths(text, tiny))
    assert prompts[0] < 128 < prompts[0] + 64  # each prompt fits alone; with its output, none does
    scenario = write(tmp_path, text)
    expected = (f"error: {scenario}: engine.max_len: none of the 8 planned requests fits the engine: each has prompt "
                f"+ output_tokens above max_len 128 (up to {longest} tokens; prompts of {prompts[0]}-{prompts[-1]} "
                "tokens), so every one would be rejected and the run would test nothing; raise engine.max_len to "
                f"{longest} or lower output_tokens, or set engine.on_too_long: cap")
    result = invoke("validate", str(scenario))
    assert result.exit_code == 2 and result.stderr.splitlines() == [expected] and result.stdout == ""
    result = invoke("run", str(scenario), "--headless", "--detectors", "none")
    assert result.exit_code == 2 and result.stderr.splitlines() == [expected]
    assert "requests" not in result.stdout  # refused before it ran


def test_validate_warns_when_some_requests_cannot_fit_and_the_engine_rejects_exactly_those(tiny, tmp_path):
    text = SMALL.replace("max_len: 256", "max_len: 128").replace(
        "output_tokens: 8", "output_tokens: {dist: uniform, min: 2, max: 60}")
    lengths = planned_lengths(text, tiny)
    too_long = sum(n > 128 for n in lengths)
    assert 0 < too_long < 8
    scenario = write(tmp_path, text)
    result = invoke("validate", str(scenario))
    assert result.exit_code == 0 and "max_requests: 8" in result.stdout
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"warning: {scenario}: engine.max_len: {too_long} of the 8 planned requests have prompt + "
                           f"output_tokens above max_len 128 (up to {max(lengths)} tokens;"), line
    session = Session(parse_scenario(text), tiny["tiny-llama"], clock="virtual", detectors=())
    summary = session.run()
    assert summary.finish_reasons["rejected"] == too_long and summary.requests_completed == 8 - too_long
    assert summary.rejection_reasons == {"too_long": too_long}


@pytest.mark.parametrize("engine", [
    "{slots: 2, max_len: 128, on_too_long: cap}",
    "{kv: paged, block_size: 16, num_blocks: 12, watermark: 0.3, max_len: 128}",
    "{kv: paged, block_size: 16, num_blocks: 10, max_len: 144, on_too_long: cap}",
])
def test_the_predicted_rejections_are_the_engines(tiny, engine):
    text = SMALL.replace("engine: {slots: 3, max_len: 256}", f"engine: {engine}").replace(
        "output_tokens: 8", "output_tokens: {dist: uniform, min: 2, max: 90}").replace("max_requests: 8",
                                                                                     "max_requests: 16")
    scenario = parse_scenario(text)
    report = check_fit(scenario, plan_requests(scenario, tiny["tiny-llama"].tokenizer))
    seen: list = []
    Session(scenario, tiny["tiny-llama"], clock="virtual", detectors=(), listeners=(seen.append,)).run()
    rejected = sum(1 for e in seen if isinstance(e, Finish) and e.finish_reason == "rejected")
    assert report.total == 16 and report.num_rejected == rejected


def test_every_request_rejected_at_run_time_fails_with_the_reasons_counted(tiny, tmp_path):
    from kvtui.models.compat import shape_from_config

    # the pool comes from a byte budget, so the rejections show only once the model's geometry is known
    per_block = shape_from_config(tiny["tiny-llama"].model.config).kv_bytes_per_token(4) * 16
    text = SMALL.replace("engine: {slots: 3, max_len: 256}",
                         f"engine: {{kv: paged, block_size: 16, kv_budget_bytes: {per_block * 12}, watermark: 0.5, "
                         "max_len: 128}").replace("output_tokens: 8", "output_tokens: 30")
    assert min(planned_lengths(text, tiny)) > 16 * 6  # 12 blocks, 11 usable, 5 kept free: 6 for a request
    scenario = write(tmp_path, text)
    result = invoke("run", str(scenario), "--headless", "--detectors", "none")
    assert result.exit_code == 3, result.output
    assert re.search(r"requests +8 \(rejected 8: too_long 8\)", result.stdout), result.stdout
    assert result.stderr.splitlines() == [
        "error: no request completed: all 8 were rejected (too_long 8), so nothing was tested; raise engine.max_len "
        "or lower output_tokens (or set engine.on_too_long: cap)"]


def test_a_fault_that_cannot_act_in_the_layout_is_refused_naming_the_layout_it_needs(tmp_path):
    scenario = write(tmp_path, SMALL.replace("engine: {slots: 3, max_len: 256}",
                                             "engine: {slots: 3, max_len: 256, faults: [no_request_mask]}")
                     + "expect: {contamination: detected}\n")
    result = invoke("validate", str(scenario))
    assert result.exit_code == 2 and result.stderr.splitlines() == [
        f"error: {scenario}:6: engine.faults: fault no_request_mask acts in the packed layout only, not padded: it "
        "would never fire and the run would test nothing; set engine.layout: packed or drop no_request_mask"]
    result = invoke("run", str(scenario), "--headless")
    assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1

    timeline = write(tmp_path, SMALL.replace("max_len: 256}", "max_len: 256, layout: packed}")
                     + "timeline:\n  - {at_s: 0.1, set: {layout: padded}}\n  - {at_s: 0.2, set: {fault: "
                       "no_request_mask}}\n", "timeline.yaml")
    result = invoke("validate", str(timeline))
    assert result.exit_code == 2 and result.stderr.splitlines() == [
        f"error: {timeline}:12: timeline.1.set.fault: fault no_request_mask acts in the packed layout only, not "
        "padded: it would never fire and the run would test nothing; switch it on while engine.layout is packed, "
        "or drop it"]

    plain = write(tmp_path, SMALL, "plain.yaml")
    for command in ("validate", "run"):
        result = invoke(command, str(plain), "--fault", "no_request_mask", *(["--headless"] if command == "run" else []))
        assert result.exit_code == 2 and result.stderr.splitlines() == [
            "error: --fault no_request_mask: acts in the packed layout only, not padded, so it would never fire; use "
            "--layout packed (`kvtui faults` lists where each fault acts)"]
    result = invoke("run", "scenarios/faults/no_request_mask.yaml", "--model", "tiny-llama", "--headless",
                    "--layout", "padded")
    assert result.exit_code == 2 and result.stderr.splitlines() == [
        "error: scenarios/faults/no_request_mask.yaml: engine.faults: fault no_request_mask acts in the packed layout "
        "only, not padded (with --layout padded), so it would never fire; drop --layout padded, or add "
        "--clear-faults to run without the scenario's faults"]
    result = invoke("run", "scenarios/faults/block_refcount.yaml", "--model", "tiny-llama", "--headless",
                    "--no-prefix-caching")
    assert result.exit_code == 2 and "fault block_refcount acts in the prefix cache, which is off (with " \
                                     "--no-prefix-caching)" in result.stderr


# -- interrupted runs -----------------------------------------------------------------------------------

@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupted_run_writes_its_summary_says_so_and_exits_128_plus_the_signal(tmp_path, sig, code):
    scenario = write(tmp_path, SMALL.replace("max_requests: 8", "max_requests: 400").replace(
        "rate_per_s: 8.0", "rate_per_s: 4.0") + "expect: {contamination: detected}\n"
        "timeline:\n  - {at_s: 90, marker: late}\n")
    path = tmp_path / "run.jsonl"
    process = subprocess.Popen(KVTUI + ["run", str(scenario), "--headless", "--clock", "wall", "--detectors", "none",
                                        "--record", str(path)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + WAIT_S
        while not path.exists() or '"type":"step"' not in path.read_text():
            assert time.monotonic() < deadline and process.poll() is None, "the run never stepped"
            time.sleep(0.2)
        process.send_signal(sig)
        out, err = process.communicate(timeout=WAIT_S)
    finally:
        process.kill()
    assert process.returncode == code, err
    name = signal.Signals(sig).name
    last = json.loads(path.read_text().splitlines()[-1])
    assert last["type"] == "summary" and last["stopped_early"] is True and last["requests_not_submitted"] > 0
    assert re.search(r"stopped early +yes \(\d+ requests not submitted\)", out)
    assert f"error: interrupted by {name}: the run stopped early; {last['requests_not_submitted']} planned requests " \
           f"not submitted; the summary above covers what ran (exit {code})" in err
    assert "after the run's end" not in err and "no detector fired" not in err and "Traceback" not in err


def test_a_fault_that_finds_no_request_of_its_kind_is_refused_naming_what_the_scenario_needs(tmp_path):
    """cow_missing acts on forked sequences (sampling.n > 1), stale_bitmask on structured output: a run
    without such requests would test nothing."""
    plain = write(tmp_path, SMALL, "plain.yaml")
    result = invoke("validate", str(plain), "--fault", "stale_bitmask")
    assert result.exit_code == 2 and result.stderr.splitlines() == [
        "error: --fault stale_bitmask: acts on structured output's bitmask rows (sampling.structured), and this "
        "scenario has no constrained request, so it would never fire; use a scenario with sampling.structured "
        "(`kvtui faults` lists where each fault acts)"]
    paged = write(tmp_path, SMALL.replace("engine: {slots: 3, max_len: 256}", "engine: {kv: paged, max_len: 256}"),
                  "paged.yaml")
    result = invoke("validate", str(paged), "--fault", "cow_missing")
    assert result.exit_code == 2 and result.stderr.splitlines() == [
        "error: --fault cow_missing: acts on the sequences of a request with n > 1 (sampling.n), and this scenario "
        "has none, so it would never fire; use a scenario with sampling.n of 2 or more (`kvtui faults` lists where "
        "each fault acts)"]
    in_scenario = write(tmp_path, SMALL.replace("engine: {slots: 3, max_len: 256}",
                                                "engine: {slots: 3, max_len: 256, faults: [stale_bitmask]}"), "in.yaml")
    result = invoke("validate", str(in_scenario))
    assert result.exit_code == 2 and "fault stale_bitmask acts on the bitmask rows of structured output" in result.stderr
    assert invoke("validate", "scenarios/faults/cow_missing.yaml").exit_code == 0
    assert invoke("validate", "scenarios/faults/stale_bitmask.yaml").exit_code == 0


def test_a_fault_for_another_kind_of_model_is_refused_first_naming_the_kind_it_needs(tmp_path):
    """An image fault on a text model: one line naming the model's kind and the kind the fault needs, before
    any engine setting is checked (no setting makes it act); validate says what run says."""
    plain = write(tmp_path, SMALL, "plain.yaml")
    for command in ("validate", "run"):
        args = (command, str(plain), "--fault", "mm_hash_missing", "--model", "tiny-llama")
        result = invoke(*args, "--headless") if command == "run" else invoke(*args)
        assert result.exit_code == 2 and result.stderr.splitlines() == [
            f"error: {plain}: --fault mm_hash_missing does not act on decoder-only models like tiny-llama; it acts "
            "on image-text models (`kvtui faults` lists them)"], (command, result.stderr)


def test_validate_refuses_image_prompts_for_a_text_model_given_with_model(tmp_path):
    result = invoke("validate", "scenarios/images.yaml", "--model", "tiny-llama")
    assert result.exit_code == 2 and "has no image encoder" in result.stderr and "dinov2-smollm2" in result.stderr
    assert invoke("validate", "scenarios/images.yaml", "--model", "tiny-vision").exit_code == 0


def test_image_prompts_against_a_target_are_refused_in_one_line_not_sent_as_text():
    """kvtui's target client sends no image parts: an image scenario against a server would send the
    prompt text alone and audit something else, so it is refused before anything is sent."""
    result = invoke("run", "scenarios/images.yaml", "--target", "http://127.0.0.1:9", "--headless",
                    "--model", "tiny-vision")
    assert result.exit_code == 2 and result.stderr.splitlines() == [
        "error: scenarios/images.yaml: prompts kind image_passphrase cannot be sent to a --target yet: kvtui's "
        "client sends no image parts; run it locally (--model dinov2-smollm2), or serve that model with `kvtui "
        "serve` and send image_url parts (docs/serve.md, Images)"]


# -- a fault that never acted: no detector miss -------------------------------------------------------------

def test_a_fault_that_never_acted_gives_its_own_line_and_exit_4_not_a_miss(tmp_path):
    # three slots, three requests at once: no request ever takes a slot another left, so stale_slot never acts
    text = SMALL.replace("engine: {slots: 3, max_len: 256}", "engine: {slots: 3, max_len: 256, faults: [stale_slot]}")
    scenario = write(tmp_path, text.replace("max_requests: 8", "max_requests: 3")
                     .replace("poisson, rate_per_s: 8.0", "burst, size: 3, every_s: 100") + "expect: {contamination: detected}\n")
    result = invoke("run", str(scenario), "--headless")
    assert result.exit_code == 4, result.output
    assert error_lines(result.stderr) == [
        "expected contamination to be detected, yet no fault that was on ever acted: the run tested nothing (exit 4; "
        "a detector miss, where a fault acted, exits 1)",
        "stale_slot acted 0 times: no request was admitted into a slot another request had left"]
    assert re.search(r"steps a fault acted in +stale_slot 0", result.stdout), result.stdout


def test_a_fault_that_acted_unseen_is_a_miss_and_its_acts_are_recorded_and_replayed(tmp_path):
    text = SMALL.replace("engine: {slots: 3, max_len: 256}", "engine: {slots: 2, max_len: 256, faults: [stale_slot]}")
    scenario = write(tmp_path, text + "expect: {contamination: detected}\n")
    path = tmp_path / "run.jsonl"
    result = invoke("run", str(scenario), "--headless", "--detectors", "none", "--record", str(path))
    header, events, summary, _ = read_recording(path)
    acted = [e for e in events if e.type == "fault.acted"]
    # 2 slots, 8 requests: the 6 requests admitted into a used slot, each in the step that admitted it
    assert len(acted) == summary.fault_acts["stale_slot"] == 6 and {e.fault for e in acted} == {"stale_slot"}
    assert all(e.where == "slot" and len(e.request_ids) == len(e.ids) for e in acted)
    assert result.exit_code == 1 and "(stale_slot acted in 6 steps)" in result.stderr, result.output
    replayed = invoke("replay", str(path), "--summary")
    assert re.search(r"steps a fault acted in +stale_slot 6", replayed.stdout), replayed.stdout
