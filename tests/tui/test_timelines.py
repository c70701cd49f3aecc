"""Per-request timelines (kvtui/tui/lanes.py, lane_panel.py) from the demo recording's own events: each lane
holds what the recording says happened to its request, step by step."""

from __future__ import annotations

import pytest
from rich.console import Console
from still_source import DEMO

from kvtui.events import Contamination, FaultActed, Finish, StepEvent
from kvtui.record import read_recording
from kvtui.tui.lane_panel import LABEL, timelines
from kvtui.tui.snapshot_build import build_snapshot
from kvtui.tui.state import DashboardState


@pytest.fixture(scope="module")
def at_5s():
    """(the dashboard state 5 s into the demo, the events it applied)."""
    header, events, _, _ = read_recording(DEMO)
    shown = [e for e in events if e.t is not None and e.t <= 5.0]
    state = DashboardState()
    for event in (header, *shown):
        state.apply(event)
    return state, shown


def test_each_lane_marks_its_requests_steps_faults_findings_and_end(at_5s):
    state, events = at_5s
    lanes = state.lanes.lanes
    for rid in ("r000", "r003", "r005"):
        ran = {e.step: r.phase for e in events if isinstance(e, StepEvent) for r in e.running if r.request_id == rid}
        acted = {e.step for e in events if isinstance(e, FaultActed) and rid in e.request_ids}
        found = {e.step for e in events if isinstance(e, Contamination) and e.victim == rid}
        marks = lanes[rid].marks
        assert set(marks) == set(ran)  # one mark per step it ran in (its end falls on its last step)
        assert {s for s, c in marks.items() if c == "*"} == found
        assert {s for s, c in marks.items() if c == "!"} == acted - found
        assert all(c == {"prefill": "P", "decode": "="}[ran[s]] for s, c in marks.items() if s not in acted | found
                   and c != "|")
    finished = {e.request_id for e in events if isinstance(e, Finish)}
    assert {rid for rid, lane in lanes.items() if lane.ended is not None} == finished
    assert lanes["r000"].marks[lanes["r000"].ended] == "|" and not any(c == "!" for c in lanes["r000"].marks.values())


def test_a_queued_request_shows_dots_until_it_runs_and_the_panel_fits(at_5s):
    state, _ = at_5s
    snap = build_snapshot(state)
    waiting = next(lane for lane in snap.lanes if lane.request_id == "r010")
    assert waiting.marks and {c for _, c in waiting.marks} == {"·"} and waiting.marks[-1][0] == snap.step
    for width, height in ((58, 18), (94, 32)):
        console = Console(width=width, color_system=None, record=True)
        console.print(timelines(snap, width, height))
        lines = console.export_text().splitlines()
        assert len(lines) <= height
        row = next(line for line in lines if line.startswith("r010"))
        first = max(snap.step - (width - LABEL) + 1, 0)  # the newest step at the right edge, or step 0 at the left
        assert row.rstrip().endswith("·") and len(row.rstrip()) == LABEL + snap.step - first + 1
        assert (first == 0) is (width == 94)
