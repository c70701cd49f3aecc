"""The dashboard's keys where the run cannot go on, driven by Pilot on live tiny-llama sessions: every key
acts or says why it cannot now (loading, closing, done), the fault picker marks and refuses faults the run's
layout or KV mode cannot act on and never confirms a fault that is not applied, a restart keeps the faults
picked by key, the help fits and scrolls at 100x30, SIGTERM exits 143 with the summary, and `kvtui serve
--dashboard`'s quit interrupts the engine as Ctrl-C does."""

from __future__ import annotations

import asyncio
import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest
from textual.widgets import Static

from kvtui.events import FaultSwitch, StepEvent
from kvtui.record import read_recording
from kvtui.tui.app import KvtuiApp, screen_text
from kvtui.tui.live import LiveSource
from kvtui.tui.replay import ReplaySource
from kvtui.tui.screens import HELP, FaultPicker, HelpScreen

DATA = Path(__file__).parents[1] / "data"
ROOT = Path(__file__).resolve().parents[2]
LIVE_DETECTORS = ("canary", "attention_flow", "slot_taint")  # the reference detector's reruns cost seconds


@pytest.fixture(scope="module")
def loaded():
    from kvtui.models import load_model

    return load_model("tiny-llama", progress=False)


def live_source(loaded, record: Path, scenario: str = "tui_short.yaml", **engine) -> LiveSource:
    from kvtui.record import restart_path
    from kvtui.scenario import load_scenario
    from kvtui.session import build_session

    spec = load_scenario(DATA / scenario)

    def make(listener, generation):
        return build_session(spec, loaded, clock="wall", record=restart_path(record, generation),
                             listeners=(listener,), detectors=LIVE_DETECTORS, **engine)

    return LiveSource(make)


async def until(predicate, pilot, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await pilot.pause(0.05)


def noting(app: KvtuiApp) -> list[str]:
    """The app's notifications, as they are raised (the toasts' text)."""
    notes: list[str] = []
    real = app.notify

    def notify(message, **kwargs):
        notes.append(str(message))
        return real(message, **kwargs)

    app.notify = notify
    return notes


def fault_switches(path: Path) -> list[tuple[str, bool, float]]:
    _, events, _, _ = read_recording(path)
    return [(e.name, e.on, e.t) for e in events if isinstance(e, FaultSwitch)]


# -- keys once the run is over -------------------------------------------------------------------------
def test_every_key_after_the_run_ended_says_why_and_changes_nothing(loaded, tmp_path):
    record = tmp_path / "done.jsonl"
    source = live_source(loaded, record)

    async def run():
        app = KvtuiApp(source)
        async with app.run_test(size=(100, 30)) as pilot:
            notes = noting(app)
            await until(lambda: source.done and " DONE " in screen_text(app), pilot)
            pending, seq = list(source.session.pending), source.state.seq
            for key in ("i", "f", "b", "space", "n", "plus", "minus"):
                await pilot.press(key)
                await pilot.pause(0.1)
                assert not isinstance(app.screen, FaultPicker)
            await pilot.pause(0.3)
            text = screen_text(app)
            await pilot.press("q")
        return notes, text, pending, seq

    notes, text, pending, seq = asyncio.run(run())
    assert notes[:7] == ["the run is over (DONE): nothing more runs; r restarts it, q quits"] * 7
    assert "isolation ON" in text.splitlines()[0] and " DONE " in text.splitlines()[0]  # `i` flipped nothing
    assert source.session.pending == pending and not source.paused and source.state.seq == seq
    assert fault_switches(record) == []


def test_the_picker_applies_nothing_when_the_run_ended_while_it_was_open(loaded, tmp_path):
    record = tmp_path / "picker.jsonl"
    source = live_source(loaded, record, "tui_long.yaml")

    async def run():
        app = KvtuiApp(source)
        async with app.run_test(size=(100, 30)) as pilot:
            notes = noting(app)
            await until(lambda: source.state.step >= 2, pilot)
            await pilot.press("space")
            await until(lambda: source.parked, pilot)
            await pilot.press("f", *["down"] * 5, "space")  # stale_slot
            assert "on after apply: stale_slot" in screen_text(app)
            source._queue(source._finish, control=False)  # the run ends (its summary written) meanwhile
            await until(lambda: source.done, pilot)
            await pilot.press("enter")
            await pilot.pause(0.5)
            await pilot.press("q")
        return notes

    notes = asyncio.run(run())
    assert notes[0] == "not applied: the run is over (DONE): nothing more runs; r restarts it, q quits"
    assert source.session.engine.faults == frozenset() and fault_switches(record) == []


def test_keys_while_the_model_loads_say_so(tmp_path):
    release = threading.Event()
    source = LiveSource(lambda listener, generation: None, prepare=lambda: release.wait(30),
                        loading_text="loading the model (tiny-llama)…")

    async def run():
        app = KvtuiApp(source)
        async with app.run_test(size=(100, 30)) as pilot:
            notes = noting(app)
            header = screen_text(app).splitlines()[0]  # the first frame, before the source's first snapshot
            await until(lambda: "loading the model" in screen_text(app), pilot, 5)
            for key in ("i", "f", "b", "space", "r"):
                await pilot.press(key)
            release.set()
            source.request_stop()
            await pilot.press("q")
        return header, notes

    header, notes = asyncio.run(run())
    assert "LOADING" in header and "LIVE" not in header
    assert notes[:5] == ["the model is still loading; keys act once the run starts"] * 5


def test_n_while_running_says_it_steps_while_paused(loaded, tmp_path):
    source = live_source(loaded, tmp_path / "n.jsonl", "tui_long.yaml")

    async def run():
        app = KvtuiApp(source)
        async with app.run_test(size=(100, 30)) as pilot:
            notes = noting(app)
            await until(lambda: source.state.step >= 1, pilot)
            await pilot.press("n")
            await pilot.press("q")
        return notes

    assert asyncio.run(run())[0] == "n takes one step while paused: space pauses first"


# -- the fault picker and restart ----------------------------------------------------------------------
@pytest.mark.parametrize("layout, misfit, why", [
    ("padded", "no_request_mask", "acts in the packed layout only, not padded"),
    ("packed", "unmasked_cache_padding", "acts in the padded layout only, not packed"),
])
def test_the_picker_marks_and_refuses_faults_that_cannot_act_in_the_run(loaded, tmp_path, layout, misfit, why):
    source = live_source(loaded, tmp_path / "misfit.jsonl", "tui_long.yaml", layout=layout)

    async def run():
        app = KvtuiApp(source)
        async with app.run_test(size=(100, 30)) as pilot:
            await until(lambda: source.state.step >= 1 and app.snapshot is not None and app.snapshot.layout == layout,
                        pilot)
            await pilot.press("space")
            await pilot.press("f")
            listed = screen_text(app)
            picker = app.screen
            index = picker.names.index(misfit)
            await pilot.press(*["down"] * index, "space")
            await pilot.pause(0.3)
            refused = str(picker.query_one("#picker-choice", Static).render())
            await pilot.press("enter")
            await pilot.pause(0.3)
            await pilot.press("q")
        return picker, listed, refused

    picker, listed, refused = asyncio.run(run())
    assert f"{misfit:<24} ✗ {why}" in listed
    assert "block_refcount           ✗ acts with kv: paged only, not slots" in listed
    assert f"{misfit} is not applied: fault {misfit} {why}, so it would never fire" in refused
    assert "on after apply: none (isolation ON)" in refused
    assert set(picker.misfits) >= {misfit, "unsalted_prefix", "block_refcount"} and "stale_slot" not in picker.misfits
    assert source.session.engine.faults == frozenset()


def test_restart_keeps_the_faults_picked_by_key(loaded, tmp_path):
    record = tmp_path / "restart.jsonl"
    source = live_source(loaded, record, "tui_long.yaml")

    async def run():
        app = KvtuiApp(source)
        async with app.run_test(size=(100, 30)) as pilot:
            notes = noting(app)
            await until(lambda: source.state.step >= 1, pilot)
            await pilot.press("space")
            await pilot.press("f", *["down"] * 5, "space", "enter")  # stale_slot
            await until(lambda: source.session.engine.faults == {"stale_slot"}, pilot)
            await pilot.press("r")
            await until(lambda: source.generation == 1 and source.session.engine.faults == {"stale_slot"}, pilot)
            await until(lambda: "isolation OFF: stale_slot" in screen_text(app).splitlines()[0], pilot)
            await pilot.press("space")
            await until(lambda: source.state.step >= 2, pilot)
            await pilot.press("q")
            await until(lambda: app.return_value is not None, pilot, 60)
        return notes

    notes = asyncio.run(run())
    assert notes[-2:] == ["restarting the scenario with the faults picked by key: stale_slot", "closing the session…"]
    _, events, _, _ = read_recording(tmp_path / "restart.restart1.jsonl")
    kinds = [type(e).__name__ for e in events if isinstance(e, (FaultSwitch, StepEvent))]
    assert kinds[:2] == ["FaultSwitch", "StepEvent"]  # on before the restart's first step ...
    assert [(e.name, e.on) for e in events if isinstance(e, FaultSwitch)] == [("stale_slot", True)]  # ... and kept
    assert any(line.text == "restart #1 keeps the faults picked by key: stale_slot" for line in source.state.log)


# -- help ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [(160, 45), (100, 30)])
def test_help_fits_and_scrolls(size):
    """The help fits at once on a 160x45 terminal; on 100x30 (since it explains the block map's marks, the
    timelines and the request statuses) its top shows first and the rest by scrolling."""
    from kvtui.tui.replay import ReplaySource

    last = HELP.splitlines()[-1].strip()  # "… r restarts a run that has ended, q quits."

    async def run():
        app = KvtuiApp(ReplaySource.from_file(ROOT / "recordings" / "passphrase_demo.jsonl", start_paused=True))
        async with app.run_test(size=size) as pilot:
            await pilot.press("question_mark")
            await pilot.pause(0.3)
            assert isinstance(app.screen, HelpScreen)
            first = screen_text(app)
            await pilot.press("end")
            await pilot.pause(0.3)
            scrolled = screen_text(app)
            await pilot.press("escape", "q")
        return first, scrolled

    first, scrolled = asyncio.run(run())
    assert "q    quit (live: the recording gets its summary)" in scrolled and last in scrolled
    if size == (160, 45):  # everything at once
        assert "kvtui dashboard" in first and last in first and "space    pause / resume" in first
    else:  # the top first, the rest by scrolling
        assert "kvtui dashboard" in first and last not in first and "kvtui dashboard" not in scrolled


def help_text(app: KvtuiApp) -> str:
    return str(app.screen.query_one("#help-text", Static).render())


def test_the_help_opened_while_loading_follows_the_runs_header(loaded, tmp_path):
    """`?` while LOADING names no fault set it cannot know yet (not the default stale_slot), and the open help
    shows the run's own set (the demo's shared_cache) once the header arrives."""
    from kvtui.scenario import load_scenario
    from kvtui.session import build_session

    spec = load_scenario(ROOT / "scenarios" / "passphrase_demo.yaml")
    release = threading.Event()

    def make(listener, generation):
        return build_session(spec, loaded, clock="wall", record=tmp_path / "demo.jsonl", listeners=(listener,),
                             detectors=LIVE_DETECTORS)

    source = LiveSource(make, prepare=lambda: release.wait(30), loading_text="loading the model (tiny-llama)…")

    async def run():
        app = KvtuiApp(source)
        async with app.run_test(size=(100, 30)) as pilot:
            await until(lambda: "loading the model" in screen_text(app), pilot, 5)
            await pilot.press("question_mark")
            await pilot.pause(0.2)
            assert isinstance(app.screen, HelpScreen)
            loading = help_text(app)
            release.set()
            await until(lambda: source.state.header is not None and app.snapshot is not None
                        and app.snapshot.clock != "?", pilot)
            await pilot.pause(0.2)
            started = help_text(app)
            await pilot.press("escape", "q")
        return loading, started

    loading, started = asyncio.run(run())
    i_line = lambda text: next(line for line in text.splitlines() if line.lstrip().startswith("i "))  # noqa: E731
    assert (i_line(loading).strip(), i_line(started).strip()) == (
        "i        isolation on/off (switches the scenario's fault set, shown once loaded)",
        "i        isolation on/off (switches the scenario's fault set: shared_cache)")
    assert "stale_slot" not in loading


# -- start, SIGTERM, serve --------------------------------------------------------------------------------
@pytest.mark.parametrize("model, label", [("tiny-llama", "tiny-llama"), ("default", "SmolLM2-135M-Instruct"),
                                          ("smollm2", "SmolLM2-135M-Instruct")])
def test_the_command_shows_a_loading_line_before_any_slow_check(tmp_path, monkeypatch, model, label):
    """kvtui run (dashboard) loads the tokenizer, and with it torch, before it takes the screen: seconds.
    A spinner says so before the first check that imports anything heavy, naming the model as people know it
    (it said "default's tokenizer")."""
    import types

    from typer.testing import CliRunner

    import kvtui.cli.run as command
    from kvtui.cli import app as cli

    order: list[str] = []

    class Status:
        def __init__(self, text):
            order.append(f"status: {text}")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            order.append("status closed")

    tty = types.SimpleNamespace(isatty=lambda: True)
    monkeypatch.setattr(command, "sys", types.SimpleNamespace(stdout=tty, stderr=tty))
    monkeypatch.setattr(command.err, "status", Status)
    monkeypatch.setattr(command, "refuse_misfit_faults", lambda *a: order.append("model kind checked"))
    monkeypatch.setattr(command, "load_tokenizer", lambda name: order.append(f"tokenizer {name}") or object())
    monkeypatch.setattr(command, "check_lengths", lambda *a: order.append("lengths checked"))
    monkeypatch.setattr(command, "_dashboard", lambda *a, **k: order.append("dashboard"))
    result = CliRunner().invoke(cli, ["run", str(DATA / "tui_short.yaml"), "--model", model])
    assert result.exit_code == 0, result.output
    assert order == [f"status: checking the scenario with {label}'s tokenizer; the dashboard opens next",
                     "model kind checked", f"tokenizer {model}", "lengths checked", "status closed", "dashboard"]


def read_until(fd: int, pattern: str, timeout_s: float, seen: bytearray) -> bool:
    """Read the pty into `seen` until `pattern` shows (True) or the time is up / the output ends (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if re.search(pattern, seen.decode("utf-8", "replace")):
            return True
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                return False
            if not chunk:
                return False
            seen.extend(chunk)
    return bool(re.search(pattern, seen.decode("utf-8", "replace")))


def test_sigterm_stops_the_dashboard_with_its_summary_and_exit_143(tmp_path):
    """The command in a 100x30 terminal (a pty): SIGTERM while the run is live closes the session, prints the
    summary and the interrupted line, and exits 143 as a headless run does (it exited 0)."""
    record = tmp_path / "term.jsonl"
    main, child = os.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TERM": "xterm-256color"}
    process = subprocess.Popen([sys.executable, "-m", "kvtui.cli", "run", str(DATA / "tui_long.yaml"), "--record",
                                str(record), "--detectors", "canary"], cwd=ROOT, env=env, stdin=child,
                               stdout=child, stderr=child, close_fds=True, start_new_session=True)
    os.close(child)
    seen = bytearray()
    try:
        assert read_until(main, r"LIVE", 300, seen), seen.decode("utf-8", "replace")[-2000:]
        time.sleep(1.0)
        process.send_signal(signal.SIGTERM)
        read_until(main, r"\(exit 143\)", 120, seen)
        process.wait(120)
    finally:
        process.kill()
        os.close(main)
    out = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", seen.decode("utf-8", "replace"))
    assert process.returncode == 143, out[-2000:]
    assert "stopped early" in out and "error: interrupted by SIGTERM: the run stopped early" in out
    _, _, summary, truncated = read_recording(record)
    assert not truncated and summary is not None and summary.stopped_early


def test_the_serve_dashboards_quit_interrupts_the_engine(monkeypatch):
    """q in `kvtui serve --dashboard` stops the engine as the plain server's Ctrl-C does: the step in progress
    is interrupted and the client in flight gets finish_reason "abort"."""
    import httpx
    from textual.app import App

    from kvtui.serve.main import _dashboard
    from kvtui.serve.server import ServeOptions, ServeServer

    server = ServeServer(ServeOptions(model="tiny-llama", port=0, max_len=4096, detectors=()))
    server.start_http()
    server.load()
    interrupts, finishes, streaming = [], [], threading.Event()

    def ask():
        body = {"prompt": "hi", "max_tokens": 4000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as response:
            for line in response.iter_lines():
                streaming.set()
                if line.startswith("data: {"):
                    reason = httpx.Response(200, content=line[6:]).json()["choices"][0]["finish_reason"]
                    finishes.extend([reason] if reason else [])

    def headless_run(self, **kwargs):
        async def autopilot(pilot):
            engine = self.source.session.engine
            real = engine.interrupt
            engine.interrupt = lambda: (interrupts.append(time.monotonic()), real())
            asker.start()
            await until(streaming.is_set, pilot, 120)
            await pilot.press("q")

        return App.run(self, headless=True, size=(100, 30), auto_pilot=autopilot)

    asker = threading.Thread(target=ask)
    monkeypatch.setattr(KvtuiApp, "run", headless_run)
    try:
        result = _dashboard(server)
        asker.join(120)
    finally:
        server.stop()
    assert interrupts and finishes == ["abort"]
    assert result.summary is not None and result.summary.finish_reasons == {"abort": 1}


def test_sigterm_stops_the_target_dashboard_and_says_which_signal(tmp_path, monkeypatch):
    """`kvtui run --target`'s dashboard: SIGTERM stops the run (the recording gets its summary) and the
    caller is told which signal, so the command exits 143 as a headless --target run does."""
    from fake_openai import FakeOpenAI
    from textual.app import App

    from kvtui.models import build_tiny_tokenizer
    from kvtui.remote.session import TargetOptions, TargetSession
    from kvtui.scenario import parse_scenario
    from kvtui.tui.target_source import run_target_dashboard

    spec = parse_scenario("name: term\nseed: 3\nmax_requests: 64\nmodel: tiny-llama\narrivals: {process: poisson, "
                          "rate_per_s: 4}\nprompts: {kind: passphrase}\noutput_tokens: 8\n")
    fake = FakeOpenAI(delay_s=0.05)

    def make_session(listener):
        return TargetSession(spec, build_tiny_tokenizer(), TargetOptions(url="http://fake", transport=fake.transport()),
                             listeners=(listener,), record_path=tmp_path / "target.jsonl")

    def headless_run(self, **kwargs):
        async def autopilot(pilot):
            await until(lambda: self.source.state.finished >= 1, pilot, 60)
            os.kill(os.getpid(), signal.SIGTERM)

        return App.run(self, headless=True, size=(100, 30), auto_pilot=autopilot)

    monkeypatch.setattr(KvtuiApp, "run", headless_run)
    signals: list[int] = []
    summary, header, session = run_target_dashboard(make_session, on_signal=signals.append)
    assert signals == [signal.SIGTERM]
    assert summary is not None and summary.stopped_early and summary.requests_not_submitted > 0
    assert read_recording(tmp_path / "target.jsonl")[2] == summary


def test_q_in_the_open_help_quits_the_dashboard_at_once():
    """The help lists `q quit`; pressed while the help is open it quits (it used to close the help only)."""
    async def run():
        app = KvtuiApp(ReplaySource.from_file(ROOT / "recordings" / "passphrase_demo.jsonl", start_paused=True))
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.press("question_mark")
            await pilot.pause(0.2)
            assert isinstance(app.screen, HelpScreen)
            await pilot.press("q")
            await pilot.pause(0.5)
            return app.is_running

    assert asyncio.run(run()) is False
