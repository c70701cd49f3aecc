"""What the local run loop drives, each alone with a stand-in engine (no model): the clock
(kvtui/run/clock.py: names, pause, the paced clock's hold to the wall), the live controls
(kvtui/run/controls.py: fault switches, arrival rate, bursts) and the timeline (kvtui/run/timeline.py)."""

from __future__ import annotations

import pytest

from kvtui.engine import SamplingParams
from kvtui.events import FaultSwitch, Marker, TimelineApplied
from kvtui.pacing import Pacer
from kvtui.request import PlannedRequest, TokenPrompt
from kvtui.run.clock import RunClock, check_clock, engine_clock
from kvtui.run.controls import Controls
from kvtui.run.timeline import Timeline
from kvtui.scenario.timeline import TimelineEvent


class StandInEngine:
    """The part of kvtui.engine.Engine the clock, controls and timeline use."""

    def __init__(self, faults=()) -> None:
        self.t, self.faults, self.calls = 0.0, frozenset(faults), []

    def now(self) -> float:
        return self.t

    def set_faults(self, names) -> None:
        self.faults = frozenset(names)

    def reconfigure(self, **knobs) -> None:
        self.calls.append(("reconfigure", knobs))

    def pause_clock(self) -> None:
        self.calls.append("pause")

    def resume_clock(self) -> None:
        self.calls.append("resume")


class FakeWall:
    def __init__(self) -> None:
        self.now, self.slept = 100.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _planned(request_id: str, arrival_s: float) -> PlannedRequest:
    return PlannedRequest(request_id, arrival_s, TokenPrompt((5, 6)), SamplingParams(max_new_tokens=2))


# -- the clock ------------------------------------------------------------------------------------
def test_clock_names_and_the_engines_own_clock():
    assert [check_clock(n) for n in ("virtual", "paced", "wall")] == ["virtual", "paced", "wall"]
    with pytest.raises(ValueError, match="clock 'walll': use 'virtual', 'paced' or 'wall'"):
        check_clock("walll")
    assert [engine_clock(n) for n in ("virtual", "paced", "wall")] == ["virtual", "virtual", "wall"]


def test_the_paced_clock_spends_its_wait_then_sleeps_the_rest_in_slices():
    engine, wall, spent = StandInEngine(), FakeWall(), []
    clock = RunClock("paced", engine, Pacer(wall=wall, sleep=wall.sleep), spend=lambda until: spent.append(until()))
    assert clock.modeled and clock.hold_for_wall() == 0.0  # the first call lines the clocks up
    engine.t = 2.0  # the engine is 2 modeled seconds ahead of the wall
    assert clock.hold_for_wall(max_wait_s=0.5) == pytest.approx(1.5)
    assert wall.slept == [pytest.approx(0.5)] and spent == [False]  # the wait was not over when spent
    waited = []
    assert clock.hold_for_wall(max_wait_s=10.0, wait=lambda s: (waited.append(s), wall.sleep(s))) == 0.0
    assert waited == [pytest.approx(1.5)] and wall.now == pytest.approx(102.0)


def test_other_clocks_never_hold_and_pause_reaches_the_engine_and_the_pacer():
    engine, spent = StandInEngine(), []
    wall_clock = RunClock("wall", engine, spend=spent.append)
    engine.t = 50.0
    assert wall_clock.pacer is None and not wall_clock.modeled and wall_clock.hold_for_wall() == 0.0 and spent == []
    wall_clock.pause()
    wall_clock.resume()
    assert engine.calls == ["pause", "resume"]
    paced = RunClock("paced", engine, Pacer(wall=FakeWall()))
    assert paced.hold_for_wall() == 0.0  # lined up at 50 modeled seconds
    engine.t = 53.0
    paced.pause()
    assert engine.calls[-1] == "pause" and paced.hold_for_wall() == 0.0  # paused: lined up afresh, no wait
    engine.t = 54.0
    paced.resume()
    assert engine.calls[-1] == "resume" and paced.hold_for_wall() == 0.0  # lined up again where it is
    engine.t = 55.0
    assert paced.hold_for_wall(max_wait_s=0.0) == pytest.approx(1.0)  # paced from there on


# -- the controls ---------------------------------------------------------------------------------
def test_a_fault_switch_is_an_event_and_a_line_of_history_once():
    engine, events = StandInEngine(faults={"stale_slot"}), []
    controls = Controls(engine, [], events.append)
    assert controls.fault_history == [(0.0, "stale_slot", True)]
    engine.t = 1.25
    controls.set_fault("stale_slot", True)  # already on: nothing
    controls.set_fault("shared_cache", True, source="timeline")
    controls.set_fault("stale_slot", False)
    assert engine.faults == {"shared_cache"}
    assert controls.fault_history[1:] == [(1.25, "shared_cache", True), (1.25, "stale_slot", False)]
    assert [(e.name, e.on, e.source, e.active) for e in events] == [
        ("shared_cache", True, "timeline", ("shared_cache", "stale_slot")),
        ("stale_slot", False, "key", ("shared_cache",))]
    assert all(isinstance(e, FaultSwitch) and e.t == 1.25 for e in events)
    with pytest.raises(ValueError):
        controls.set_fault("stale_slott", True)


def test_rate_and_burst_move_the_pending_requests_in_place():
    engine, events = StandInEngine(), []
    pending = [_planned("a", 1.0), _planned("b", 6.0), _planned("c", 10.0)]
    controls = Controls(engine, pending, events.append)
    engine.t = 2.0
    controls.scale_arrival_rate(2.0)  # the wait left from now is halved; one already due keeps its time
    assert [p.arrival_s for p in pending] == [1.0, 4.0, 6.0]
    assert controls.burst(2) == 2 and [p.arrival_s for p in pending] == [1.0, 2.0, 6.0]
    assert [e.text for e in events] == ["arrival rate x2", "burst of 2 requests"]
    pending.clear()
    assert controls.burst(3) == 0 and len(events) == 2  # nothing left: no marker
    with pytest.raises(ValueError, match="must be > 0"):
        controls.scale_arrival_rate(0.0)


# -- the timeline ---------------------------------------------------------------------------------
def _timeline(engine, pending, events, *, fault_switches=True) -> Timeline:
    items = [TimelineEvent(at_s=1.0, set={"fault": "stale_slot", "on": True}, marker="isolation off"),
             TimelineEvent(at_s=1.0, set={"arrivals.rate_per_s": 8.0}),
             TimelineEvent(at_s=2.0, set={"max_batch_size": 2}),
             TimelineEvent(at_s=9.0, marker="late")]
    return Timeline(items, Controls(engine, pending, events.append), None, events.append, base_rate_per_s=4.0,
                    fault_switches=fault_switches)


def test_the_timeline_applies_what_is_due_in_order():
    engine, events, pending = StandInEngine(), [], [_planned("a", 5.0)]
    timeline = _timeline(engine, pending, events)
    timeline.apply_due()
    assert events == [] and len(timeline.items) == 4
    engine.t = 1.0
    timeline.apply_due()
    assert [type(e).__name__ for e in events] == ["TimelineApplied", "FaultSwitch", "Marker", "TimelineApplied",
                                                  "Marker"]
    assert events[2].text == "isolation off" and events[4].text == "arrival rate x2"
    assert engine.faults == {"stale_slot"} and pending[0].arrival_s == 3.0  # 4 s left, at twice the rate
    engine.t = 2.5
    timeline.apply_due()
    assert engine.calls == [("reconfigure", {"max_batch_size": 2})]
    assert isinstance(events[-1], TimelineApplied) and events[-1].at_s == 2.0 and events[-1].t == 2.5


def test_fault_switches_off_are_ignored_and_what_is_left_is_named_at_the_end():
    engine, events = StandInEngine(), []
    timeline = _timeline(engine, [], events, fault_switches=False)
    engine.t = 3.0
    timeline.apply_due()
    assert engine.faults == frozenset() and not any(isinstance(e, FaultSwitch) for e in events)
    left = timeline.unapplied(stopped=False)
    assert [e.at_s for e in left] == [9.0]
    assert isinstance(events[-1], Marker) and events[-1].text == (
        "timeline events after the run's end were not applied (at 9 s)")
    before = len(events)
    assert [e.at_s for e in timeline.unapplied(stopped=True)] == [9.0] and len(events) == before
