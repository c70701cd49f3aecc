"""The dashboard app driven by Pilot: on a replay of a recording and on a live tiny-llama session.

Screens are checked as text (kvtui.tui.app.screen_text), not pixel-exact SVG, so they survive
Textual upgrades. DEMO is the committed SmolLM2 demo recording (a real shared_cache leak the canary
catches); `make_demo_recording` makes a fresh tiny-llama one with the current engine and detectors.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from kvtui.events import Contamination, FaultSwitch
from kvtui.record import read_recording
from kvtui.tui.app import KvtuiApp, screen_text
from kvtui.tui.live import LiveSource
from kvtui.tui.replay import ReplaySource
from kvtui.tui.screens import FaultPicker, HelpScreen
from kvtui.tui.snapshot_build import build_snapshot

DATA = Path(__file__).parents[1] / "data"
DEMO = Path(__file__).parents[2] / "recordings" / "passphrase_demo.jsonl"
LONG = DATA / "tui_long.yaml"
SIZES = [(160, 45), (100, 30)]
# live tests leave out the reference detector: its solo reruns at close cost seconds and test nothing here
LIVE_DETECTORS = ("canary", "attention_flow", "slot_taint")


def make_demo_recording(path: Path, loaded) -> list:
    """scenarios/passphrase.yaml on tiny-llama (virtual clock), stale_slot on at step 20 and off at
    step 45, then a marker. The detectors' reports are their real output. Returns the typed events as
    the session's listener saw them."""
    from kvtui.events import Marker
    from kvtui.scenario import load_scenario
    from kvtui.session import Session

    events: list = []
    session = Session(load_scenario("scenarios/passphrase.yaml"), loaded, clock="virtual", record_path=path,
                      listeners=(events.append,))
    n = 0
    while session.step_once():
        n += 1
        if n == 20:
            session.controls.set_fault("stale_slot", True, source="key")
        if n == 45:
            session.controls.set_fault("stale_slot", False, source="key")
            session.emit(Marker(t=session.engine.now(), text="isolation restored"))
    session.close()
    return events


@pytest.fixture(scope="module")
def loaded():
    from kvtui.models import load_model

    return load_model("tiny-llama", progress=False)


@pytest.fixture(scope="module")
def demo(loaded, tmp_path_factory) -> tuple[Path, list[dict]]:
    """A fresh recording from the current engine (the same recipe as the fixed one) and the events
    its listener received."""
    path = tmp_path_factory.mktemp("tui") / "demo.jsonl"
    return path, make_demo_recording(path, loaded)


@pytest.fixture(scope="module")
def recording(demo) -> Path:
    return demo[0]


async def until(predicate, timeout_s: float = 10.0, pilot=None) -> None:
    """Wait (letting the app run) until predicate() is true."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await (pilot.pause(0.05) if pilot else asyncio.sleep(0.05))


async def quit_app(app, pilot, timeout_s: float = 60.0) -> None:
    """Press q and wait until the app has exited with the live summary. run_test's exit shuts the app
    down at once, cancelling a quit that is still closing the session (return value None)."""
    await pilot.press("q")
    await until(lambda: app.return_value is not None, pilot=pilot, timeout_s=timeout_s)


def test_a_newer_snapshot_replaces_an_unprocessed_older_one():
    from textual.message import Message

    from kvtui.tui.sources import SnapshotReady
    from kvtui.tui.state import DashboardState

    older, newer = (SnapshotReady(build_snapshot(DashboardState()), "LIVE") for _ in range(2))
    assert older.can_replace(newer) and not older.can_replace(Message())


# -- replay ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", SIZES)
def test_main_screen_from_the_fixed_recording(size):
    async def run():
        source = ReplaySource.from_file(DEMO, start_paused=True)
        app = KvtuiApp(source)
        async with app.run_test(size=size) as pilot:
            source.seek_to(source.times[next(i for i, e in enumerate(source.events)
                                             if isinstance(e, Contamination) and e.detector == "canary")])
            text = ""
            for _ in range(100):  # a loaded machine can draw the footer a few seconds after the panels
                await pilot.pause(0.1)
                text = screen_text(app)
                if "quit" in text and "⚑ fault shared_ca" in text:
                    break
            await pilot.press("q")
        return text

    text = asyncio.run(run())
    for needle in ("passphrase_demo", "isolation OFF: shared_cache", "LEAKS", "slots", "requests",
                   "contamination", "events", "canary", "findings", "r005 ← r003", "LEAK←r003", "tok/s", "TTFT", "p50",
                   "⚑ fault shared_ca", "quit"):
        assert needle in text, f"{needle!r} not on the {size} screen:\n{text}"
    assert "isolation" in text.splitlines()[0]
    assert len(text.splitlines()) == size[1]


def test_replay_plays_to_the_end_then_shows_the_summary_state(recording):
    async def run():
        source = ReplaySource.from_file(recording, speed=64.0)
        app = KvtuiApp(source)
        async with app.run_test(size=(160, 45)) as pilot:
            await until(lambda: source.at_end, pilot=pilot)
            await pilot.pause(0.1)
            text = screen_text(app)
            await pilot.press("q")
        return source, text

    source, text = asyncio.run(run())
    from kvtui.tui.sources import MIN_HZ, PUBLISH_HZ

    assert 1 / PUBLISH_HZ <= source.min_interval_s <= 1 / MIN_HZ  # paced by the measured drawing cost
    header, events, summary, _ = read_recording(recording)
    assert source.state.summary is not None and source.state.step == summary.steps - 1
    assert " END " in text and "isolation ON" in text and "isolation restored" in text


def test_replay_pause_step_and_seek(recording):
    async def run():
        source = ReplaySource.from_file(recording, speed=1.0)
        app = KvtuiApp(source)
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.press("space")
            assert source.paused
            seq = source.state.seq
            await pilot.pause(0.4)
            assert source.state.seq == seq  # nothing plays while paused
            step = source.state.step
            await pilot.press("n")
            assert source.state.step == step + 1
            await pilot.press("right", "right")
            forward = source.playhead
            assert forward > 5.0
            await pilot.press("left")
            rebuilt = build_snapshot(source.state)
            fresh = ReplaySource.from_file(recording, start_paused=True)
            fresh.seek_to(source.playhead)
            assert (rebuilt.step, rebuilt.seq, rebuilt.finished) == (fresh.state.step, fresh.state.seq,
                                                                     fresh.state.finished)
            await pilot.press("plus")
            assert source.speed == pytest.approx(1.25)
            await pilot.press("i", "b", "r")  # live-only keys do nothing on a replay
            assert not isinstance(app.screen, FaultPicker)
            await pilot.press("q")

    asyncio.run(run())


def test_replay_state_equals_live_state(demo):
    """The same events give the same snapshot, whether fed live (listener) or read back from the file."""
    from kvtui.tui.state import DashboardState

    path, events = demo
    live = DashboardState()
    for event in events:
        live.apply(event)
    replay = ReplaySource.from_file(path, start_paused=True)
    replay.seek_to(replay.end_t)
    a, b = build_snapshot(live), build_snapshot(replay.state)
    assert a.seq == b.seq and a.done and b.done
    for field in ("step", "t", "slots", "requests", "prefill_history", "decode_history", "padding_history",
                  "kv_history", "ttft", "tpot", "contamination", "by_detector", "log", "finished", "active_faults"):
        assert getattr(a, field) == getattr(b, field), field


def test_help_palette_and_screenshot(tmp_path):
    async def run():
        source = ReplaySource.from_file(DEMO, start_paused=True)
        app = KvtuiApp(source, screenshot_dir=tmp_path)
        async with app.run_test(size=(160, 45)) as pilot:
            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen)
            assert "isolation on/off" in screen_text(app)
            await pilot.press("escape")
            assert not isinstance(app.screen, HelpScreen)
            titles = [c.title for c in app.get_system_commands(app.screen)]
            assert "kvtui: pause" in titles and "kvtui: isolation" not in titles  # replay: no fault keys
            await pilot.press("ctrl+p")
            await pilot.pause(0.2)
            await pilot.press(*"kvtui: pause")
            await pilot.pause(0.3)
            paused = source.paused
            await pilot.press("enter")
            await until(lambda: source.paused != paused, pilot=pilot, timeout_s=5)
            await pilot.press("s")
            await pilot.pause(0.1)
            await pilot.press("q")

    asyncio.run(run())
    [svg] = tmp_path.glob("passphrase_demo-*.svg")
    assert "<svg" in svg.read_text()[:200]


# -- live (tiny-llama, wall clock) ---------------------------------------------------------------------
def live_source(loaded, record: Path, scenario: Path = LONG) -> LiveSource:
    from kvtui.record import restart_path
    from kvtui.scenario import load_scenario
    from kvtui.session import Session

    spec = load_scenario(scenario)

    def make(listener, generation):
        return Session(spec, loaded, clock="wall", record_path=restart_path(record, generation),
                       listeners=(listener,), detectors=LIVE_DETECTORS)

    return LiveSource(make)


def last_line(path: Path) -> dict:
    return json.loads(path.read_text().splitlines()[-1])


def test_live_keys_switch_faults_pause_step_and_quit_writes_the_summary(loaded, tmp_path):
    record = tmp_path / "live.jsonl"
    source = live_source(loaded, record)

    async def run():
        app = KvtuiApp(source)
        async with app.run_test(size=(160, 45)) as pilot:
            await until(lambda: source.state.step >= 3, pilot=pilot)
            await pilot.press("i")  # while running: the default isolation set, stale_slot
            await until(lambda: source.session.engine.faults == {"stale_slot"}, pilot=pilot)
            await until(lambda: any(line.text == "fault stale_slot on (key)" for line in source.state.log),
                        pilot=pilot)
            await until(lambda: "isolation OFF: stale_slot" in screen_text(app), pilot=pilot)

            # Pilot waits for an idle CPU after each key (up to 2 s while the engine runs): pause first
            await pilot.press("space")
            await until(lambda: source.parked, pilot=pilot)  # the step in flight has ended
            step = source.state.step
            await pilot.pause(0.5)
            assert source.state.step == step, "stepped while paused"
            assert " PAUSED " in screen_text(app)
            await pilot.press("n")
            await until(lambda: source.state.step == step + 1, pilot=pilot)
            await until(lambda: source.parked, pilot=pilot)
            await pilot.pause(0.2)
            assert source.state.step == step + 1

            await pilot.press("i")  # commands still apply while paused
            await until(lambda: not source.session.engine.faults, pilot=pilot)
            await pilot.press("f")
            assert isinstance(app.screen, FaultPicker)
            await pilot.press(*["down"] * 5, "space")  # the sixth fault in the list: stale_slot
            assert "on after apply: stale_slot" in screen_text(app)
            await pilot.press("enter")
            assert not isinstance(app.screen, FaultPicker)
            await until(lambda: source.session.engine.faults == {"stale_slot"}, pilot=pilot)
            await pilot.press("f", "escape")  # cancel changes nothing
            await pilot.press("f", *["down"] * 5, "space", "enter")  # and off again
            await until(lambda: not source.session.engine.faults, pilot=pilot)
            assert source.state.step == step + 1, "fault switches must not step the engine"
            await pilot.press("space")
            await until(lambda: source.state.step > step + 2, pilot=pilot)
            await quit_app(app, pilot)
        return app.return_value

    summary = asyncio.run(run())
    assert summary is not None and summary.stopped_early is True
    end = last_line(record)
    assert end["type"] == "summary" and end["steps"] == summary.steps
    header, events, _, truncated = read_recording(record)
    assert not truncated
    assert [(e.name, e.on, e.source) for e in events if isinstance(e, FaultSwitch)] == [
        ("stale_slot", True, "key"), ("stale_slot", False, "key")] * 2


def test_live_rate_burst_and_restart(loaded, tmp_path):
    record = tmp_path / "live.jsonl"
    source = live_source(loaded, record)

    async def run():
        app = KvtuiApp(source)
        async with app.run_test(size=(100, 30)) as pilot:
            await until(lambda: source.state.step >= 1, pilot=pilot)
            await pilot.press("space")  # keys are quicker for Pilot with the engine paused; commands still apply
            await pilot.press("plus", "b")
            await until(lambda: any(line.text.startswith("burst of") for line in source.state.log), pilot=pilot)
            assert any(line.text == "arrival rate x1.25" for line in source.state.log)
            await pilot.press("r")
            await until(lambda: source.generation == 1, pilot=pilot)
            assert source.state.step == -1 and source.paused  # a fresh state; still paused
            await pilot.press("space")
            await until(lambda: source.state.step >= 1, pilot=pilot)
            await pilot.press("q")

    asyncio.run(run())
    assert last_line(record)["type"] == "summary"
    assert last_line(tmp_path / "live.restart1.jsonl")["type"] == "summary"


def test_end_to_end_throughput_and_occupied_slots_on_screen(loaded, tmp_path):
    """A few seconds of the live app on tiny-llama: non-zero tokens/s and occupied slots are shown."""
    import re

    source = live_source(loaded, tmp_path / "e2e.jsonl")

    async def run():
        app = KvtuiApp(source)
        async with app.run_test(size=(160, 45)) as pilot:
            await until(lambda: source.state.step >= 20 and app.frames >= 5, pilot=pilot, timeout_s=30)
            await pilot.pause(1.0)
            text = screen_text(app)
            await pilot.press("q")
        return app, text

    app, text = asyncio.run(run())
    rate = re.search(r"decode\s+(\d+) tok/s", text)
    assert rate and int(rate.group(1)) > 0, text
    used = re.search(r"(\d+)/4 in use", text)
    assert used and int(used.group(1)) > 0, text
    assert " LIVE " in text and app.frames >= 5


def test_no_color_keeps_the_meaning_in_text(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")

    async def run():
        source = ReplaySource.from_file(DEMO, start_paused=True)
        app = KvtuiApp(source)
        async with app.run_test(size=(100, 30)) as pilot:
            source.seek_to(source.end_t)
            await pilot.pause(0.1)
            assert app.no_color
            text = screen_text(app)
            await pilot.press("q")
        return text

    text = asyncio.run(run())
    assert "isolation ON" in text and " END " in text


# -- entry points ----------------------------------------------------------------------------------------
def test_run_dashboard_wires_a_recorded_session_and_returns_its_summary(tmp_path, monkeypatch):
    """run_dashboard as the CLI calls it, with app.run made headless and driven by an autopilot."""
    import torch
    from textual.app import App

    from kvtui.tui import run_dashboard

    def headless_run(self, **kwargs):
        async def autopilot(pilot):
            await until(lambda: self.source.state.step >= 3, pilot=pilot)
            await pilot.press("q")

        return App.run(self, headless=True, size=(120, 36), auto_pilot=autopilot)

    monkeypatch.setattr(KvtuiApp, "run", headless_run)
    threads = torch.get_num_threads()
    try:
        summary, live_header = run_dashboard(LONG, model="tiny-llama", record=tmp_path / "run.jsonl",
                                             faults=("stale_slot",), detectors=LIVE_DETECTORS, progress=False)
    finally:
        torch.set_num_threads(threads)
    assert summary.stopped_early and summary.steps >= 3
    assert (live_header.model.id, live_header.engine["layout"]) == ("tiny-llama", "padded")
    header, events, recorded, truncated = read_recording(tmp_path / "run.jsonl")
    assert not truncated and recorded.steps == summary.steps and header.clock == "wall"
    assert header.engine["faults"] == ["stale_slot"] and header.detectors == LIVE_DETECTORS


def test_entry_points_fail_before_taking_the_terminal(tmp_path, monkeypatch):
    from kvtui.record import RecordingError
    from kvtui.scenario import ScenarioError
    from kvtui.tui import replay_dashboard, run_dashboard

    def taken(self, **kwargs):
        raise AssertionError("the app started")

    monkeypatch.setattr(KvtuiApp, "run", taken)
    with pytest.raises(ScenarioError):
        run_dashboard(tmp_path / "missing.yaml", model="tiny-llama")
    with pytest.raises(ValueError, match="unknown fault"):
        run_dashboard(LONG, model="tiny-llama", faults=("no_such_fault",))
    with pytest.raises(ValueError, match="clock"):
        run_dashboard(LONG, clock="sundial")
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):  # the recording's folder is a file
        run_dashboard(LONG, model="tiny-llama", record=tmp_path / "file" / "x.jsonl", progress=False)
    with pytest.raises(RecordingError):
        replay_dashboard(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="speed"):
        replay_dashboard(DEMO, speed=0)


def test_restart_pause_step_resume_keeps_every_latency_non_negative(loaded, tmp_path):
    """What a presenter does: restart, pause, step with `n` a few times, resume, quit. The run's clock
    never goes back (a pause does not count; a step while paused advances it by its own duration), so
    every TTFT, ITL and E2E is >= 0, and the live summary equals the recording's replay."""
    from kvtui.cli import replay_summary
    from kvtui.events import Finish, FirstToken, StepEvent

    record = tmp_path / "live.jsonl"
    source = live_source(loaded, record, scenario=DATA / "tui_clock.yaml")

    async def run():
        app = KvtuiApp(source)
        async with app.run_test(size=(120, 36)) as pilot:
            await until(lambda: source.state.step >= 2, pilot=pilot, timeout_s=30)
            await pilot.press("r")
            await until(lambda: source.generation == 1 and source.state.step >= 1, pilot=pilot, timeout_s=30)
            await pilot.press("space")
            await until(lambda: source.parked, pilot=pilot, timeout_s=30)
            await pilot.pause(1.0)  # paused time: not latency
            for _ in range(4):
                step = source.state.step
                await pilot.press("n")
                await until(lambda step=step: source.state.step > step, pilot=pilot, timeout_s=30)
            await pilot.pause(0.5)
            await pilot.press("space")
            await until(lambda: source.state.step >= step + 10, pilot=pilot, timeout_s=60)
            await quit_app(app, pilot)
        return app.return_value

    summary = asyncio.run(run())
    path = tmp_path / "live.restart1.jsonl"
    header, events, recorded, truncated = read_recording(path)
    assert not truncated and recorded == summary
    times = [e.t for e in events if isinstance(e, StepEvent)]
    assert times == sorted(times) and len(times) >= 14  # the clock never went back
    ttfts = [e.ttft_s for e in events if isinstance(e, FirstToken)]
    finishes = [e for e in events if isinstance(e, Finish)]
    assert ttfts and min(ttfts) >= 0
    assert all(b >= a for f in finishes for a, b in zip(f.token_times_s, f.token_times_s[1:]))
    assert all(f.finish_s >= f.arrival_s for f in finishes if f.finish_s is not None)
    for stats in (summary.time_to_first_token_seconds, summary.inter_token_latency_seconds,
                  summary.e2e_request_latency_seconds):
        assert stats.count == 0 or stats.p50 >= 0
    assert replay_summary(header, events, recorded) == summary


def test_quit_skips_the_waiting_reference_checks_and_counts_them(loaded, tmp_path):
    """Under steady load the reference checks wait for idle time that never comes; `q` does not run
    them: the summary counts them as skipped."""
    from kvtui.scenario import load_scenario
    from kvtui.session import Session

    spec = load_scenario(LONG)

    def make(listener, generation):
        return Session(spec, loaded, clock="wall", record_path=tmp_path / "refs.jsonl", listeners=(listener,),
                       detectors=("reference", "canary"))

    source = LiveSource(make)

    async def run():
        app = KvtuiApp(source)
        async with app.run_test(size=(100, 30)) as pilot:
            await until(lambda: source.session.observer("reference").pending >= 2, pilot=pilot, timeout_s=30)
            await quit_app(app, pilot)
        return app.return_value

    summary = asyncio.run(run())
    assert summary.reference_skipped >= 2 and summary.reference_checked == 0
    assert f"0 checked, {summary.reference_skipped} skipped" in screen_text_of_summary(summary)


def screen_text_of_summary(summary) -> str:
    from rich.console import Console

    from kvtui.events import Header
    from kvtui.summary import print_summary

    console = Console(width=200, record=True, file=open("/dev/null", "w"))
    print_summary(summary, Header(), console)
    return console.export_text()


def test_a_dashboard_recording_path_that_is_not_a_regular_file_is_refused_before_the_terminal_is_taken(tmp_path):
    """/dev/full takes the open and fails at the first line, /dev/null would lose the recording: both are
    refused up front (the CLI turns it into one line and exit 2); a new file's check leaves no file."""
    from kvtui.tui.launch import check_writable

    for device in ("/dev/full", "/dev/null"):
        with pytest.raises(OSError, match="not a regular file"):
            check_writable(Path(device))
    fresh = tmp_path / "sub" / "run.jsonl"
    check_writable(fresh)
    assert not fresh.exists() and fresh.parent.is_dir()


def test_the_compiled_steps_first_compile_is_announced_in_the_event_log(tiny, monkeypatch):
    """A first compile holds the step for a minute or more: its lines (kvtui/engine/compiled.py) reach the
    dashboard's log at once, in the first session and in a restarted one."""
    from kvtui.engine import cpu_kernels
    from kvtui.scenario import load_scenario
    from kvtui.session import Session

    monkeypatch.setattr(cpu_kernels, "compiler_path", lambda: "/usr/bin/g++")  # nothing is compiled here
    spec = load_scenario(LONG)
    source = LiveSource(lambda listener, generation: Session(spec, tiny["tiny-llama"], listeners=(listener,),
                                                             detectors=(), engine_overrides={"compile": True}))
    source.session.engine.runner.compiled.announce("compiling the decode step for this machine (once; ...)")
    assert source.state.log[-1].text == "compiling the decode step for this machine (once; ...)"
    source._restart()
    assert source.session.engine.runner.compiled.announce == source._note_now
    source.session.engine.runner.compiled.announce = None  # the graphs stay on the session's tiny-llama
