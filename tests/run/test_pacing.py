"""The paced clock (`--clock paced`): the virtual clock's steps and tokens, held to the wall clock.

The wall clock and the sleep are injected (a fake clock that moves only when the pacer sleeps, or when
the test says a step took time), so the waits are checked exactly and no test depends on timing.
"""

from __future__ import annotations

import pytest

from kvtui.events import Contamination, Header, ReferenceStatus, StepEvent, Summary
from kvtui.pacing import Pacer
from kvtui.scenario import parse_scenario
from kvtui.session import Session

# A small story on tiny-llama: requests keep arriving (idle gaps included), a fault switched on and off by
# the timeline, every detector on.
STORY = """
name: paced-story
seed: 3
max_requests: 10
model: tiny-llama
engine: {slots: 3, max_len: 128, max_batch_size: 3}
arrivals: {process: poisson, rate_per_s: 1.5}
prompts: {kind: passphrase}
output_tokens: 12
sampling: {temperature: 0.0, ignore_eos: true}
timeline:
  - {at_s: 1.0, set: {fault: stale_slot, on: true}, marker: "isolation off"}
  - {at_s: 2.5, set: {fault: stale_slot, on: false}, marker: "isolation restored"}
"""
# Everything arrives at once: the engine never idles, so only the engine's speed sets the pace.
BUSY = """
name: paced-busy
seed: 1
max_requests: 6
model: tiny-llama
engine: {slots: 3, max_len: 128, max_batch_size: 3}
arrivals: {process: burst, size: 6, every_s: 100.0}
prompts: {kind: passphrase}
output_tokens: 10
sampling: {temperature: 0.0, ignore_eos: true}
"""


class FakeWall:
    """A wall clock that moves only when told: by the pacer's sleeps, or by `spend` (compute time)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.slept.append(seconds)
        self.now += seconds


def comparable(events: list) -> list[dict]:
    """The events as dicts, leaving out what a paced run may differ in by design: the header's clock and
    creation time, measured step times, and the reference detector's reports and progress (on the paced
    clock they run while the engine waits for the wall clock, so they are stamped at other times; the
    finding ids follow the order reports come in)."""
    kept = []
    for e in events:
        if isinstance(e, (Header, ReferenceStatus)) or (isinstance(e, Contamination) and e.detector == "reference"):
            continue
        d = e.to_dict()
        d.pop("wall_s", None)
        d.pop("finding", None)
        if isinstance(e, Summary):
            d.pop("measured_step_wall_s")
        kept.append(d)
    return kept


def run(text: str, clock: str, pacer: Pacer | None = None, listener=None) -> tuple[Session, list]:
    events: list = []
    listeners = (events.append,) + ((listener,) if listener else ())
    session = Session(parse_scenario(text), TINY[0], clock=clock, listeners=listeners, pacer=pacer)
    session.run()
    return session, events


TINY: list = []


@pytest.fixture(autouse=True, scope="module")
def _tiny(tiny):
    TINY[:] = [tiny["tiny-llama"]]


def test_a_paced_run_has_the_steps_tokens_and_events_of_the_virtual_run():
    wall = FakeWall()
    paced, paced_events = run(STORY, "paced", Pacer(wall=wall, sleep=wall.sleep))
    virtual, virtual_events = run(STORY, "virtual")
    steps = [e for e in virtual_events if isinstance(e, StepEvent)]
    assert len(steps) > 30
    assert comparable(paced_events) == comparable(virtual_events)
    assert paced_events[0].clock == "paced" and paced_events[0].modeled == virtual_events[0].modeled
    fault_steps = [e for e in steps if e.faults]
    assert fault_steps and min(e.start_s for e in fault_steps) >= 1.0  # the timeline's window, on modeled time
    # the reference detector checked every request in both runs and found the same findings
    assert paced.summary.reference_checked == virtual.summary.reference_checked == 10
    assert paced.summary.findings_by_kind == virtual.summary.findings_by_kind
    assert paced.summary.findings_by_kind.get("cross_request", 0) > 0


def test_pacing_waits_until_the_wall_clock_reaches_each_steps_modeled_start():
    """Steps that compute in no time (the fake wall stands still) wait for their modeled time: every step
    starts once the wall clock has reached its modeled start, and the run takes its modeled duration."""
    wall = FakeWall()
    start = wall.now
    late: list[float] = []

    def check(event):
        if isinstance(event, StepEvent):
            late.append((wall.now - start) - event.start_s)  # wall time at the step minus its modeled start

    session, events = run(STORY, "paced", Pacer(wall=wall, sleep=wall.sleep), listener=check)
    assert late and min(late) >= -1e-9, "a step started before its modeled time"
    assert max(late) <= 1e-9  # and none later: the engine was never behind
    last = [e for e in events if isinstance(e, StepEvent)][-1]
    assert sum(wall.slept) == pytest.approx(last.start_s, abs=1e-6)  # the run took its modeled time
    steps = [e for e in events if isinstance(e, StepEvent)]
    gaps = [b.start_s - a.t for a, b in zip(steps, steps[1:])]
    assert max(gaps) > 0.2  # an idle gap between arrivals, waited out in real time too (late == 0 after it)


def test_a_slow_machine_is_not_asked_to_catch_up_and_the_pace_says_how_slow():
    """Every step takes twice its modeled time on the wall: no waits, and pace() reads 0.5."""
    wall = FakeWall()
    pacer = Pacer(wall=wall, sleep=wall.sleep)

    def slow(event):
        if isinstance(event, StepEvent):
            wall.now += 2 * (event.t - event.start_s)

    session, events = run(BUSY, "paced", pacer, listener=slow)
    assert wall.slept == []
    assert pacer.pace() == pytest.approx(0.5, rel=1e-6)
    assert comparable(events) == comparable(run(BUSY, "virtual")[1])


def test_pacer_waits_lines_up_after_falling_behind_and_restarts_after_a_pause():
    wall = FakeWall()
    pacer = Pacer(wall=wall, sleep=wall.sleep, window_s=10.0)
    assert pacer.delay(0.0) == 0.0 and pacer.pace() is None  # the first call lines the clocks up
    assert pacer.delay(0.25) == pytest.approx(0.25)  # the engine is 0.25 s ahead
    wall.now += 0.25
    assert pacer.delay(0.25) == 0.0
    wall.now += 1.0  # a step modeled at 0.5 s took 1 s: behind
    assert pacer.delay(0.75) == 0.0
    assert pacer.delay(1.0) == pytest.approx(0.25)  # no rush to catch up: paced from where it is
    wall.now += 0.25
    assert pacer.delay(1.0) == 0.0
    assert pacer.pace() == pytest.approx(1.0 / 1.5)  # 1 s of model in 1.5 s of wall
    pacer.pause()
    wall.now += 30.0  # paused: neither waited for nor counted
    pacer.resume()
    assert pacer.delay(1.5) == 0.0 and pacer.pace() is None
    assert pacer.delay(1.75) == pytest.approx(0.25)


def test_headless_cli_and_validate_know_the_paced_clock(tmp_path):
    """`--clock paced` is accepted where the engine is kvtui's, and refused against a target server."""
    from typer.testing import CliRunner

    from kvtui.cli import app

    path = tmp_path / "s.yaml"
    path.write_text(BUSY + "dashboard: {clock: paced}\n")
    spec = parse_scenario(path.read_text())
    assert spec.dashboard.clock == "paced" and parse_scenario(BUSY).dashboard.clock == "wall"
    result = CliRunner().invoke(app, ["run", str(path), "--target", "http://127.0.0.1:9", "--clock", "paced",
                                      "--headless"])
    assert result.exit_code == 2 and "--clock paced models kvtui's engine" in result.output
    result = CliRunner().invoke(app, ["run", str(path), "--headless", "--clock", "paced", "--detectors", "none",
                                      "--quiet"])
    assert result.exit_code == 0, result.output
    assert "paced-busy on tiny-llama (paced clock" in result.output
