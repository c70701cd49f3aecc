"""`kvtui run --target URL --workers N`: the load sent from Ray workers (kvtui/remote/workers.py), on a
local Ray runtime (two CPUs). Against `kvtui serve --fault stale_slot` with one slot (SmolLM2: each
request continues the previous owner's conversation and repeats its passphrase) a two-worker run finds
what the single-process run of the same plan finds, victims and sources alike; a worker killed mid-run
has its requests reported as errors naming it. Skipped without Ray (pip install 'kvtui[ray]').

Why stale_slot and not shared_cache: under shared_cache the victims depend on which requests share an
engine step, which differs between two single-process runs of one plan (a burst of three found r000 and
r001 once, r001 and r002 the next time), so no second run can be compared exactly. One slot serves the
requests one at a time in arrival order, the same order however they were sent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray")

from fake_openai import FakeHTTPServer, FakeOpenAI  # noqa: E402

from kvtui.events import Arrive, Finish  # noqa: E402
from kvtui.models import load_tokenizer  # noqa: E402
from kvtui.record import read_recording  # noqa: E402
from kvtui.remote.session import TargetOptions, TargetSession  # noqa: E402
from kvtui.remote.workers import RayTargetSession  # noqa: E402
from kvtui.scenario import parse_scenario  # noqa: E402

# one xdist worker runs the module: one local Ray runtime at a time on the machine (the CLI test starts its own)
pytestmark = pytest.mark.xdist_group("ray_workers")

# four requests 2 s apart: one slot serves them in this order (SmolLM2 answers within about 2 s)
SCENARIO = ("name: workers-test\nseed: 5\nmodel: default\narrivals: {process: scripted, requests: [{at_s: 0}, "
            "{at_s: 2}, {at_s: 4}, {at_s: 6}]}\nprompts: {kind: passphrase}\noutput_tokens: 16\n")


@pytest.fixture(scope="module")
def local_ray():
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the workers inherit it: one thread each
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def stale_slot_server(smollm2):
    from kvtui.serve.server import ServeOptions, ServeServer

    options = ServeOptions(model="default", port=0, slots=1, max_len=256, faults=("stale_slot",), detectors=(),
                           threads=1)
    with ServeServer(options, load=lambda _: smollm2) as server:
        yield server.url


def findings(session) -> set:
    return {(e.detector, e.kind, e.victim, e.source) for e in session.contamination if e.counts}


@pytest.mark.smollm
def test_two_workers_find_the_same_victims_and_sources_as_one_process(local_ray, stale_slot_server):
    spec = parse_scenario(SCENARIO)
    tok = load_tokenizer("default")
    options = TargetOptions(url=stale_slot_server)
    single = TargetSession(spec, tok, options, detectors=("reference", "canary"))
    single.run()
    events = []
    sharded = RayTargetSession(spec, tok, options, workers=2, detectors=("reference", "canary"),
                               listeners=(events.append,))
    sharded.run()
    # two worker processes, neither this one, each holding every other request in send order
    assert len(set(sharded.pids)) == 2 and os.getpid() not in sharded.pids
    assert sharded.shard == {"r000": 0, "r001": 1, "r002": 0, "r003": 1}
    assert not sharded.dead
    found = findings(single)
    # each later request answers with an earlier one's passphrase: the canary names victim and source
    assert {(v, src) for d, _, v, src in found if d == "canary"} >= {("r001", "r000")}
    assert findings(sharded) == found, (findings(sharded), found)
    # (their answers differ from run to run: the one slot starts each run holding the last run's state)
    finishes = [e for e in events if isinstance(e, Finish)]
    assert sorted(f.request_id for f in finishes) == ["r000", "r001", "r002", "r003"]
    assert all(f.finish_reason in ("stop", "length") and f.send_lag_s is not None for f in finishes)
    assert sharded.load_fidelity.requests_sent == 4


def test_a_killed_worker_has_its_requests_reported_as_errors(local_ray):
    spec = parse_scenario("name: workers-kill\nseed: 5\nmax_requests: 4\nmodel: tiny-llama\narrivals: {process: "
                          "burst, size: 4, every_s: 100}\nprompts: {kind: passphrase}\noutput_tokens: 8\n")
    tok = load_tokenizer("tiny-llama")
    events, held = [], {}

    def kill_on_first_arrival(event):
        events.append(event)
        if isinstance(event, Arrive) and event.request_id == "r000":
            ray.kill(held["session"].actors[1], no_restart=True)

    with FakeHTTPServer(FakeOpenAI(), chunk_delay_s=0.5) as url:  # each answer takes about 4 s
        session = held["session"] = RayTargetSession(spec, tok, TargetOptions(url=url), workers=2,
                                                     detectors=("canary",), listeners=(kill_on_first_arrival,))
        summary = session.run()
    finishes = {e.request_id: e for e in events if isinstance(e, Finish)}
    assert sorted(finishes) == ["r000", "r001", "r002", "r003"]  # none dropped
    assert {rid for rid, f in finishes.items() if f.finish_reason == "error"} == {"r001", "r003"}
    for rid in ("r001", "r003"):
        assert "Ray worker 1 of 2" in finishes[rid].detail and "was lost" in finishes[rid].detail
    assert {finishes[rid].finish_reason for rid in ("r000", "r002")} <= {"stop", "length"}
    assert summary.finish_reasons.get("error") == 2
    assert 1 in session.dead and 0 not in session.dead


def test_workers_without_ray_is_one_line_and_exit_2(tmp_path):
    """With Ray hidden from the import system, --workers says what to install."""
    path = tmp_path / "s.yaml"
    path.write_text(SCENARIO)
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "ray.py").write_text("raise ImportError('hidden for this test')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "kvtui.cli", "run", str(path), "--target", "http://127.0.0.1:9",
                          "--headless", "--workers", "2"], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["error: --workers sends the load from Ray workers, and Ray is not "
                                               "installed: pip install 'kvtui[ray]'"]


@pytest.mark.parametrize("address, line", [
    ("notanaddress", "error: --ray notanaddress: no Ray cluster there (Invalid address format: notanaddress); give "
                     "the address `ray start --head` printed (HOST:6379), or leave --ray out for a local runtime"),
    ("", "error: --ray '': give the cluster's address (HOST:6379, as `ray start --head` prints it), or leave --ray "
         "out for a local runtime"),
    ("127.0.0.1:1", "error: --ray 127.0.0.1:1: no Ray cluster there (nothing answers on 127.0.0.1:1); give the "
                    "address `ray start --head` printed (HOST:6379), or leave --ray out for a local runtime")])
def test_a_bad_ray_address_is_one_line_and_exit_2(tmp_path, address, line):
    """A malformed --ray address was a 77-line traceback and exit 1 (Ray's ValueError), an unreachable one
    "cannot write the recording" (Ray's ConnectionError read as the recording's OSError), one where nothing
    listens (127.0.0.1:1) Ray's GCS warnings for minutes (ray.init retries there: hence the timeout)."""
    path = tmp_path / "s.yaml"
    path.write_text(SCENARIO)
    with FakeHTTPServer(FakeOpenAI()) as url:
        out = subprocess.run([sys.executable, "-m", "kvtui.cli", "run", str(path), "--target", url, "--headless",
                              "--workers", "2", "--ray", address], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == line
    assert "Traceback" not in out.stderr


def test_the_command_line_sends_from_workers_and_its_recording_says_so(tmp_path):
    """`kvtui run --target URL --headless --workers 2` (a Ray runtime of its own) against the fake server."""
    path, rec = tmp_path / "s.yaml", tmp_path / "run.jsonl"
    path.write_text("name: workers-cli\nseed: 3\nmax_requests: 6\nmodel: tiny-llama\narrivals: {process: poisson, "
                    "rate_per_s: 10}\nprompts: {kind: passphrase}\noutput_tokens: 8\n")
    fake = FakeOpenAI()
    with FakeHTTPServer(fake) as url:
        out = subprocess.run([sys.executable, "-m", "kvtui.cli", "run", str(path), "--target", url, "--headless",
                              "--detectors", "canary", "--workers", "2", "--record", str(rec)],
                             capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    header, events, summary, _ = read_recording(rec)
    assert header.engine["workers"] == 2
    assert summary.finish_reasons == {"stop": 6} and summary.passphrase_echoed == 6
    assert len(fake.requests) == 6  # each planned request sent once, by one of the workers
    assert sorted(e.request_id for e in events if isinstance(e, Finish)) == [f"r00{k}" for k in range(6)]
    # the client's CPU is the workers' (they sent the load), summed, and the summary says whose it is
    assert summary.load_fidelity.senders == 2 and summary.load_fidelity.client_cpu_s > 0
    assert "client-side wall clock, sent from 2 Ray workers)" in out.stdout.splitlines()[0]
    assert "client CPU (the load, 2 Ray workers)" in out.stdout and "of a core each)" in out.stdout
    assert "Started a local Ray instance" not in out.stderr  # Ray's own log lines stay out of the report


def test_sigterm_mid_run_writes_the_summary_and_exits_143(tmp_path):
    """SIGTERM to `kvtui run --target URL --headless --workers 1` once its worker sends: the CLI's stop (as
    without --workers: the summary, the recording ended by its summary, exit 143), not Ray's handlers (ray.init
    had put its own over the CLI's: an exit 15, or absl's C++ stack dump and an abort, with no summary), and
    Ray's processes (the CLI's children) gone after it. One worker: on two busy cores the second one's start
    costs seconds and tests nothing more."""
    import psutil

    path, rec = tmp_path / "s.yaml", tmp_path / "run.jsonl"
    path.write_text("name: workers-term\nseed: 3\nmax_requests: 4\nmodel: tiny-llama\narrivals: {process: burst, "
                    "size: 4, every_s: 100}\nprompts: {kind: passphrase}\noutput_tokens: 8\n")
    fake = FakeOpenAI()
    with FakeHTTPServer(fake, chunk_delay_s=2.0) as url:  # each answer takes about 16 s: still in flight at the signal
        with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
            cli = subprocess.Popen([sys.executable, "-m", "kvtui.cli", "run", str(path), "--target", url, "--headless",
                                    "--detectors", "canary", "--workers", "1", "--record", str(rec)],
                                   stdout=out, stderr=err)
            try:
                # Ray's start is seconds on a quiet machine and minutes on two cores the other xdist worker keeps
                # busy (135 s measured under three 2-thread matmul loops): the deadline only guards against a hang
                deadline = time.monotonic() + 400
                while not fake.requests and cli.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert fake.requests, (f"the worker sent no request (CLI exit code {cli.poll()}): "
                                       f"{(tmp_path / 'err').read_text()[-3000:]}")
                ray_processes = psutil.Process(cli.pid).children(recursive=True)
                assert ray_processes  # the local runtime's GCS, raylet, worker
                cli.send_signal(signal.SIGTERM)
                code = cli.wait(timeout=180)
            finally:
                if cli.poll() is None:
                    cli.kill()
    stdout, stderr = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    assert code == 143, stderr[-3000:]
    assert "SIGTERM: stopping; writing the summary" in stderr and "SIGTERM received" not in stderr
    assert "interrupted by SIGTERM: the run stopped early" in stderr
    assert "stopped early" in stdout and "contamination findings" in stdout and f"recording: {rec}" in stdout
    header, _, summary, _ = read_recording(rec)
    assert header.engine["workers"] == 1 and summary is not None and summary.stopped_early
    assert rec.read_text().splitlines()[-1].startswith('{"type":"summary"')
    _, alive = psutil.wait_procs(ray_processes, timeout=10)
    assert not alive, [p.name() for p in alive]


def test_a_sigterm_while_ray_starts_reaches_the_handler_that_was_there():
    """Around ray.init (_kept_stop_handlers): Ray's own SIGTERM handler (sys.exit, set as ray.init begins) is not
    installed, a SIGTERM meanwhile reaches the handler that was there, which is in place afterwards, and the
    alarm absl's failure handler sets on a SIGTERM it caught (to abort 3 s later) is cancelled."""
    from kvtui.remote.workers import _kept_stop_handlers

    got = []

    def handler(signum, frame):
        got.append(signum)

    before = signal.signal(signal.SIGTERM, handler)
    try:
        with _kept_stop_handlers(ray):
            ray._private.utils.set_sigterm_handler(lambda signum, frame: sys.exit(signum))  # as ray.init begins
            signal.alarm(3)  # as absl's failure handler does when it catches a SIGTERM
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)  # Python runs the handler in this thread at its next check
        assert got == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is handler
        assert signal.alarm(0) == 0  # no alarm left
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGTERM, before)


def test_the_dashboard_runs_a_workers_load_to_its_end_and_quits(local_ray):
    """The target dashboard (Textual's pilot) on a two-worker run against the fake server: every request
    answered and shown, and `q` after the run's end quits cleanly (the workers are gone by then: the stop's
    hold asks nothing of them)."""
    import asyncio
    import time

    from kvtui.tui.app import KvtuiApp
    from kvtui.tui.target_source import TargetSource

    spec = parse_scenario("name: workers-dash\nseed: 3\nmax_requests: 6\nmodel: tiny-llama\narrivals: {process: "
                          "poisson, rate_per_s: 10}\nprompts: {kind: passphrase}\noutput_tokens: 8\n")
    tok = load_tokenizer("tiny-llama")
    with FakeHTTPServer(FakeOpenAI(), chunk_delay_s=0.01) as url:
        source = TargetSource(lambda listener: RayTargetSession(spec, tok, TargetOptions(url=url), workers=2,
                                                                detectors=("canary",), listeners=(listener,)))

        async def go():
            app = KvtuiApp(source)
            async with app.run_test(size=(160, 45)) as pilot:
                deadline = time.monotonic() + 300  # Ray's worker processes start slowly on a loaded machine
                while source.summary is None and time.monotonic() < deadline:
                    await pilot.pause(0.1)
                ended = source.summary is not None
                await pilot.pause(0.3)
                await pilot.press("q")
                return ended

        assert asyncio.run(go()), "the run did not end within 300 s (before q)"
    assert source.error is None and source.summary is not None
    assert source.summary.finish_reasons == {"stop": 6} and source.summary.passphrase_echoed == 6
    assert source.session.actors == [] and sorted(source.session.results) == [f"r00{k}" for k in range(6)]


def test_a_stop_while_workers_cannot_start_ends_the_run_and_the_wait_is_shown(local_ray, monkeypatch):
    """Three workers on a two-CPU runtime: the third cannot be placed. The wait is shown (a marker naming
    how many are ready) rather than a silent hang, and a stop then ends the run at once with nothing sent."""
    import threading

    import kvtui.remote.workers as workers

    monkeypatch.setattr(workers, "WAIT_NOTE_S", 0.5)
    spec = parse_scenario("name: workers-wait\nseed: 3\nmax_requests: 3\nmodel: tiny-llama\narrivals: {process: "
                          "burst, size: 3, every_s: 100}\nprompts: {kind: passphrase}\noutput_tokens: 8\n")
    tok = load_tokenizer("tiny-llama")
    notes = []

    def listen(event):
        if getattr(event, "text", "").startswith("waiting for the Ray workers"):
            notes.append(event.text)
            if " 2 of 3 ready" in event.text:  # the two that fit have started; the third never will
                held["session"].stop_requested = True

    held = {}
    fake = FakeOpenAI()
    with FakeHTTPServer(fake) as url:
        session = held["session"] = RayTargetSession(spec, tok, TargetOptions(url=url), workers=3,
                                                     detectors=("canary",), listeners=(listen,))
        ran = threading.Thread(target=session.run)
        ran.start()
        ran.join(timeout=300)
        assert not ran.is_alive(), "the run did not end after the stop"
    assert notes[-1].startswith("waiting for the Ray workers to start: 2 of 3 ready after"), notes
    assert fake.requests == [] and session.actors == []


def test_early_calls_to_a_shard_worker_wait_for_its_shard():
    """An async actor's calls need not run in the order sent: a hold, a stop or a take that reaches a
    worker before its prepare is kept (not an AttributeError) and applied to the shard prepare makes."""
    import asyncio

    from kvtui.remote.workers import ShardWorker

    spec = parse_scenario("name: early\nseed: 3\nmax_requests: 4\nmodel: tiny-llama\narrivals: {process: "
                          "poisson, rate_per_s: 10}\nprompts: {kind: passphrase}\noutput_tokens: 8\n")

    async def go():
        worker = ShardWorker()
        assert await worker.take() == ([], 0.0)
        await worker.hold(True)
        await worker.stop()
        _, ids = await worker.prepare(spec, "tiny-llama", TargetOptions(url="http://127.0.0.1:9"), 1, 2,
                                      "chat", None, None)
        return worker.session, ids

    session, ids = asyncio.run(go())
    import gc

    gc.unfreeze()
    assert ids == ["r001", "r003"]
    assert session.stop_requested is True and session._held_since is not None


def test_ray_starts_under_a_captured_stderr_and_stays_quiet():
    """Under the dashboard Textual captures sys.stderr (no file descriptor), where ray.init's faulthandler
    fails: the process's own stderr stands in while Ray starts, with Ray's log level at ERROR."""
    import faulthandler
    import io
    import logging

    from kvtui.remote.workers import _terminal_stderr

    class Captured(io.StringIO):  # as Textual's capture of sys.stderr: no file descriptor
        def fileno(self) -> int:
            return -1

    captured = Captured()
    before = sys.stderr
    sys.stderr = captured
    try:
        with _terminal_stderr() as quiet:
            assert quiet and sys.stderr is sys.__stderr__
            assert logging.getLogger("ray").level == logging.ERROR
            faulthandler.enable(all_threads=False)  # what ray.init does: no RuntimeError here
        assert sys.stderr is captured and logging.getLogger("ray").level != logging.ERROR
        with pytest.raises(RuntimeError):
            faulthandler.enable(all_threads=False)  # on the capture itself it fails
    finally:
        sys.stderr = before
        faulthandler.disable()
    with _terminal_stderr() as quiet:  # a real stderr: nothing changes
        assert not quiet and sys.stderr is before
