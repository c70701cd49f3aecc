"""The dashboard as a demo is watched, at 100x30 and at 160x45: the passphrases readable in the request
table, every key in the footer, check marks in text, the event log wrapped at words, the closing reference
checks' progress, why checks were skipped, one findings count, screenshots under runs/, and the paced
clock's pace and determinism on the live dashboard.

DEMO is the committed SmolLM2 demo recording (r007 and r008 answer with r009's passphrase).
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import re
import time
from pathlib import Path

import pytest
from rich.console import Console

from kvtui.events import StepEvent
from kvtui.pacing import Pacer
from kvtui.record import read_recording
from kvtui.scenario import parse_scenario
from kvtui.session import Session
from kvtui.tui import panels
from kvtui.tui.app import KvtuiApp, screen_text
from kvtui.tui.live import LiveSource
from kvtui.tui.replay import ReplaySource
from kvtui.tui.snapshot import LogLine
from kvtui.tui.snapshot_build import build_snapshot
from kvtui.tui.state import DashboardState

DEMO = Path(__file__).parents[2] / "recordings" / "passphrase_demo.jsonl"
SIZES = [(100, 30), (160, 45)]
LIVE_DETECTORS = ("canary", "attention_flow", "slot_taint")
# tiny-llama, requests that keep the engine busy for seconds: the live keys are pressed meanwhile
BUSY = """
name: demo-busy
seed: 2
max_requests: 40
model: tiny-llama
engine: {slots: 4, max_len: 400, max_batch_size: 4}
arrivals: {process: poisson, rate_per_s: 20.0}
prompts: {kind: passphrase}
output_tokens: 300
sampling: {temperature: 0.0, ignore_eos: true}
"""
# six short requests with a fault from the start: the reference checks all wait for the close
SHORT = """
name: demo-short
seed: 4
max_requests: 6
model: tiny-llama
engine: {slots: 3, max_len: 128, max_batch_size: 3, faults: [stale_slot]}
arrivals: {process: poisson, rate_per_s: 8.0}
prompts: {kind: passphrase}
output_tokens: 10
sampling: {temperature: 0.0, ignore_eos: true}
"""


async def until(predicate, pilot, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await pilot.pause(0.05)


def replay_screen(size, t: float | None = None) -> str:
    async def run():
        source = ReplaySource.from_file(DEMO, start_paused=True)
        app = KvtuiApp(source)
        async with app.run_test(size=size) as pilot:
            source.seek_to(source.end_t if t is None else t)
            await pilot.pause(0.2)
            text = screen_text(app)
            await pilot.press("q")
        return text

    return asyncio.run(run())


@pytest.mark.parametrize("size", SIZES)
def test_victims_and_sources_passphrases_are_readable_in_the_request_table(size):
    """At 100x30 the text column was 8-11 cells wide and showed the tail ("N-GINGER"): now each row shows
    its answer around the passphrase it holds, whole, on the row of its status."""
    rows = {line.split("│")[1].split()[0]: line for line in replay_screen(size).splitlines()
            if re.match(r"│ ?r0\d\d ", line)}
    assert re.search(r"r008\s+LEAK←r009.*LANTERN-GINGER-90", rows["r008"]), rows["r008"]
    assert re.search(r"r007\s+LEAK←r009.*LANTERN-GINGER-90", rows["r007"]), rows["r007"]
    assert re.search(r"r011\s+LEAK←r004.*FALCON-AMBER-77", rows["r011"]), rows["r011"]
    assert "ANCHOR-BANJO-98" in rows["r014"] and "PEPPER-HARBOR-28" in rows["r015"]  # own ones, after 6 s


def test_the_text_window_keeps_the_passphrase_whole_with_the_words_before_it():
    text = "The passphrase is LANTERN-GINGER-90. I will remember it for you."
    assert panels.window(text, "LANTERN-GINGER-90", 31) == "…ssphrase is LANTERN-GINGER-90…"
    assert panels.window(text, "LANTERN-GINGER-90", 20) == "… LANTERN-GINGER-90…"
    assert panels.window(text, None, 20) == "…emember it for you."
    assert panels.window(text, "LANTERN-GINGER-90", 80) == text


def test_the_header_keeps_mode_isolation_and_leaks_at_100_columns_and_says_the_pace():
    header, events, summary, _ = read_recording(DEMO)
    state = DashboardState()
    state.apply(header)
    for e in events:
        state.apply(e)
    snap = dataclasses.replace(build_snapshot(state), pace=0.23)
    line = panels.header(snap, "CLOSING: checks 8/16 · q skips", 100).plain
    assert "0.2x" in line and "CLOSING: checks 8/16" in line and line.rstrip().endswith("LEAKS 11"), line
    assert "0.2x real time" in panels.header(snap, "LIVE", 100).plain
    assert "real time" not in panels.header(dataclasses.replace(snap, pace=0.97), "LIVE", 160).plain


def test_event_log_wraps_at_words():
    """A long entry once broke mid-word onto its next line (`on=Fals` / `e`, `(` / `timeline)`)."""
    text = "fault shared_cache off (timeline) while LANTERN-GINGER-90 was answering everyone"
    snap = dataclasses.replace(build_snapshot(DashboardState()), log=(LogLine(1, 6.1, "fault", text),))
    rows = panels.event_log(snap, 36, 10).plain.splitlines()
    assert len(rows) >= 3 and all(len(row) <= 36 for row in rows)
    assert " ".join(" ".join(rows).replace("6.1s ⚑", "").split()) == text  # every word whole, in order


def test_event_log_shows_whole_entries_from_the_top():
    """At 100x30 the log is 36x6: the demo's four timeline lines wrap to 7 rows, and the panel's top row
    was the tail of the oldest, `(timeline)`, without its time or symbol. An entry that does not fit whole
    is now left out; one taller than the panel alone shows its head."""
    log = (LogLine(1, 2.7, "fault", "fault shared_cache on (timeline)"),
           LogLine(2, 2.7, "marker", "isolation off (shared_cache)"),
           LogLine(3, 6.1, "fault", "fault shared_cache off (timeline)"),
           LogLine(4, 6.1, "marker", "isolation restored"))
    snap = dataclasses.replace(build_snapshot(DashboardState()), log=log)
    assert panels.event_log(snap, 36, 6).plain.splitlines() == [
        "    2.7s ▸ isolation off", "           (shared_cache)", "    6.1s ⚑ fault shared_cache off",
        "           (timeline)", "    6.1s ▸ isolation restored"]
    alone = dataclasses.replace(snap, log=(LogLine(5, 9.2, "error", "word " * 30),))
    rows = panels.event_log(alone, 36, 3).plain.splitlines()
    assert len(rows) == 3 and rows[0] == "    9.2s ! word word word word word", rows


def test_the_contamination_panel_never_splits_a_detector_from_its_count():
    """At 100 columns the witnesses line wrapped inside an entry: `canary` / `7`."""
    header, events, summary, _ = read_recording(DEMO)
    state = DashboardState()
    state.apply(header)
    for e in events:
        state.apply(e)
    console = Console(width=36, record=True, file=io.StringIO())
    console.print(panels.contamination(build_snapshot(state), 36, 20))
    lines = console.export_text().splitlines()  # as drawn: wrapped at the panel's width
    assert lines[1].startswith("witnesses attention_flow 21")
    witnesses = " ".join(lines[1:4])
    for entry in ("attention_flow 21", "canary 7", "reference 10", "slot_taint 22"):
        assert entry in witnesses, lines
    assert not any(re.match(r"\d", line) for line in lines), lines

@pytest.mark.parametrize("width", [31, 37, 55])
def test_the_findings_line_never_splits_a_kind_from_its_count(width):
    """The findings line was left to Rich's word wrap: at 55 cells (the panel on a 146 or 147 column
    terminal) it drew `findings corruption 1 · cross_request 10 · cross_tenant` and `3` alone on the next
    line. It now breaks between entries, as the witnesses line does."""
    findings = (("corruption", 1), ("cross_request", 10), ("cross_tenant", 3))
    snap = dataclasses.replace(build_snapshot(DashboardState()), findings=findings, by_detector=(("canary", 4),))
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(panels.contamination(snap, width, 20))
    lines = [line.rstrip() for line in console.export_text().splitlines()]
    head = lines[:lines.index("witnesses canary 4")]
    assert " ".join(head) == "findings corruption 1 · cross_request 10 · cross_tenant 3", lines
    for kind, n in findings:
        assert any(f"{kind} {n}" in line for line in head), lines



def test_the_contamination_panel_keeps_the_newest_report_in_a_short_panel():
    """At 100x30 the panel is 36x9: at the demo's end the counts, the reference line and four attention
    rows filled it, and the newest report (victim ← source, the evidence) was drawn below its last row,
    cropped. The report's rows are now kept first; the attention rows take what is left."""
    header, events, summary, _ = read_recording(DEMO)
    state = DashboardState()
    state.apply(header)
    for e in events:
        state.apply(e)
    console = Console(width=36, record=True, file=io.StringIO())
    console.print(panels.contamination(build_snapshot(state), 36, 9))
    lines = console.export_text().splitlines()
    assert len(lines) <= 9, lines
    assert lines[-2].startswith("#65 reference cross r013") and lines[-1].startswith("  token 1: 18 vs solo 1301")
    assert "attention on other requests' keys" in lines and any(line.startswith("  r012 ") for line in lines)


def live_source(tiny, text: str, detectors=LIVE_DETECTORS, clock: str = "wall", pacer=None) -> LiveSource:
    spec = parse_scenario(text)

    def make(listener, generation):
        return Session(spec, tiny["tiny-llama"], clock=clock, listeners=(listener,), detectors=detectors,
                       **({"pacer": pacer} if pacer else {}))

    return LiveSource(make)


def test_footer_keeps_help_and_quit_and_the_fault_picker_marks_in_text(tiny):
    """At 100 columns the footer lost `? help` and `q quit` (ctrl+p's hint pushed them off); the fault
    picker's boxes differed by colour only."""
    source = live_source(tiny, BUSY)

    async def run():
        app = KvtuiApp(source)
        async with app.run_test(size=(100, 30)) as pilot:
            await until(lambda: source.state.step >= 1, pilot)
            await pilot.press("space")
            footer = screen_text(app).splitlines()[-1]
            await pilot.press("f", *["down"] * 5, "space")
            picker = screen_text(app)
            await pilot.press("escape")
            await pilot.press("q")
            await until(lambda: app.return_value is not None, pilot, timeout_s=60)
        return footer, picker

    footer, picker = asyncio.run(run())
    assert "? help" in footer and "q quit" in footer and "i isolation" in footer and "+- rate" in footer, footer
    assert "[x] stale_slot" in picker and "[ ] shared_cache" in picker, picker


class PostedSnapshots:
    """Stands in for the app: keeps what the worker posts."""

    def __init__(self) -> None:
        self.posted: list = []

    def post_message(self, message) -> None:
        self.posted.append((message.mode, message.snapshot))


def test_closing_shows_each_reference_check_and_ends_on_the_summarys_counts(tiny):
    """While closing, the dashboard once posted one snapshot and then nothing until the end (frames were
    rate-limited and no event came between checks): CLOSING showed no progress, and a quit then left the
    panel short of the findings the summary counted. Now every check is posted as it is done."""
    source = live_source(tiny, SHORT, detectors=("reference", "canary", "attention_flow", "slot_taint"),
                         clock="virtual")
    source.app = PostedSnapshots()
    source.min_interval_s = 1e9  # no frame is ever due by time: only what must show is posted
    while source.session.step_once():
        pass
    assert source.session.observer("reference").pending == 6
    source._finish()
    closing = [(mode, snap) for mode, snap in source.app.posted if mode.startswith("CLOSING")]
    modes = [mode for mode, _ in closing]
    assert "CLOSING: checks 0/6 · q skips" in modes and "CLOSING: checks 5/6 · q skips" in modes, modes
    checked = [snap.reference[0] for _, snap in closing if snap.reference]
    assert checked == sorted(checked) and checked[-1] == 6
    summary, last = source.summary, closing[-1][1]
    assert summary.findings_by_kind and dict(last.findings) == summary.findings_by_kind
    assert dict(last.by_detector)["reference"] == sum(c.value for c in summary.contamination_events_total
                                                      if c.detector == "reference")


def test_a_stopped_run_says_how_many_checks_it_skipped_and_why(tiny):
    """`q` once said "8 skipped (sampled out or left at a stop)" for a greedy run: now the reason is the
    one that applies, counted."""
    from rich.console import Console

    from kvtui.detect.reference import PendingCheck, ReferenceDetector
    from kvtui.engine import SamplingParams
    from kvtui.summary import print_summary

    session = Session(parse_scenario(SHORT), tiny["tiny-llama"], clock="virtual", detectors=("reference",))
    while session.observer("reference").pending < 2:
        session.step_once()
    session.stop_requested = True
    summary = session.close()
    skipped = summary.reference_skipped
    assert skipped >= 2 and summary.reference_skipped_by_reason == {"stopped": skipped}
    console = Console(width=200, record=True, file=open("/dev/null", "w"))
    print_summary(summary, session.header(), console)
    assert f"0 checked, {skipped} skipped: the run was stopped before they were checked" in console.export_text()

    ref = ReferenceDetector(tiny["tiny-llama"], tiny["tiny-llama"].tokenizer, max_queue=2)
    for i in range(5):
        ref.on_finish(PendingCheck(f"r{i}", (1, 2, 3), (4,), (1.0,), SamplingParams(max_new_tokens=1)))
    ref.skip_pending()
    assert dict(ref.skipped_by_reason) == {"queue_full": 3, "stopped": 2} and ref.skipped == 5


def test_screenshots_go_to_the_ignored_runs_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    async def run():
        source = ReplaySource.from_file(DEMO, start_paused=True)
        app = KvtuiApp(source)
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.press("s")
            await pilot.pause(0.1)
            await pilot.press("q")

    asyncio.run(run())
    [svg] = (tmp_path / "runs").glob("passphrase_demo-*.svg")
    assert "<svg" in svg.read_text()[:200] and not (tmp_path / "recordings").exists()
    ignored = (Path(__file__).parents[2] / ".gitignore").read_text().split()
    assert "/runs/" in ignored


STORY = """
name: demo-story
seed: 3
max_requests: 8
model: tiny-llama
engine: {slots: 3, max_len: 128, max_batch_size: 3}
arrivals: {process: burst, size: 8, every_s: 100.0}
prompts: {kind: passphrase}
output_tokens: 10
sampling: {temperature: 0.0, ignore_eos: true}
timeline:
  - {at_s: 0.5, set: {fault: stale_slot, on: true}, marker: "isolation off"}
  - {at_s: 1.2, set: {fault: stale_slot, on: false}, marker: "isolation restored"}
"""


def test_the_live_dashboard_on_the_paced_clock_runs_the_virtual_steps_and_says_the_pace(tiny, tmp_path):
    """The dashboard's worker on the paced clock: the same steps and tokens as a headless virtual run,
    and when the machine is slower than the model (here a wall clock that each step moves by twice its
    modeled time) the header says so."""
    from test_pacing import FakeWall, comparable

    wall = FakeWall()

    def slow(event):
        if isinstance(event, StepEvent):
            wall.now += 2 * (event.t - event.start_s)

    events: list = []
    spec = parse_scenario(STORY)

    def make(listener, generation):
        return Session(spec, tiny["tiny-llama"], clock="paced", listeners=(listener, events.append, slow),
                       pacer=Pacer(wall=wall, sleep=wall.sleep))

    source = LiveSource(make)

    async def run():
        app = KvtuiApp(source)
        async with app.run_test(size=(100, 30)) as pilot:
            await until(lambda: source.done, pilot, timeout_s=60)
            await until(lambda: app.snapshot is not None and app.snapshot.done, pilot)
            text = screen_text(app)
            await pilot.press("q")
        return text

    text = asyncio.run(run())
    assert "0.5x real time" in text.splitlines()[0], text.splitlines()[0]
    virtual: list = []
    Session(spec, tiny["tiny-llama"], clock="virtual", listeners=(virtual.append,)).run()
    assert comparable(events) == comparable(virtual)


def test_a_stop_does_not_wait_for_the_replay_that_attributes_a_divergence(tiny):
    """`q` while closing once waited for a divergent check's replay with its faults (13 s per check on a
    loaded 2-core machine): the replay now stops between its steps, and the check waits (then is
    counted as skipped for the stop)."""
    from kvtui.detect.reference import PendingCheck, ReferenceDetector
    from kvtui.engine import SamplingParams

    loaded = tiny["tiny-llama"]
    ref = ReferenceDetector(loaded, loaded.tokenizer)
    prompt, sampling = (5, 6, 7, 8), SamplingParams(max_new_tokens=6, ignore_eos=True)
    [(tokens, gaps, _draws)] = ref._references([(prompt, sampling)])  # the clean reference, now cached
    wrong = tuple(tokens[:3]) + ((tokens[3] + 1) % 100,) + tuple(tokens[4:])
    check = PendingCheck("r1", prompt, wrong, (10.0,) * 6, sampling, steps=tuple(range(6)),
                         cobatched=(("r0",),) * 6, faults=frozenset({"stale_slot"}))
    ref.on_finish(check)
    calls = iter([False])  # the drain's first look says go on; from then on, stop
    assert ref.drain(0.0, should_stop=lambda: next(calls, True)) == []
    assert (ref.pending, ref.checked) == (1, 0)
    [report] = ref.drain(0.0)  # not stopped: the replay runs and the check is done
    assert (report.kind, report.evidence.token_index, ref.checked, ref.pending) == ("cross_request", 3, 1, 0)
