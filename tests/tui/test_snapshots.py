"""SVG snapshots of the dashboard, one per screen state and terminal size (pytest-textual-snapshot).

Each test draws the app at 100x30 and at 160x45 and compares the picture with the SVG committed under
tests/tui/__snapshots__/test_snapshots/. The pictures come from the committed passphrase demo recording
(recordings/passphrase_demo.jsonl) through StillSource (still_source.py): the state after a chosen prefix of
the recording's events, the header's mode given, no worker, no timer and no wall clock, so every run
draws the same picture on any machine.

- LIVE: a run in progress before the fault (isolation ON, r003 and r004 decoding, r005 waiting).
- LEAK: shared_cache on and the canary's report that r008 answers with r009's passphrase (r008 ← r009).
- CLOSING: every request finished, the reference checks draining (11 of 16 done).
- block map: `m` at the LEAK moment: whose KV is where, marked where the fault acted and the detectors fired.
- timelines: `t` in a replay of the demo paused at 5 s: one lane per request.
- help: `?` over the LIVE screen.

When a picture changes on purpose (a panel, a colour, the help text, a Textual upgrade), open the new
pictures and, if they are right, rewrite the SVGs:

    python -m pytest tests/tui --snapshot-update

A failed comparison writes snapshot_report.html in the folder pytest runs from (`--snapshot-report PATH`
puts it elsewhere; git ignores it): the committed and the new picture side by side, for each test that
failed. An SVG left behind by a renamed or removed test fails a run without -n as unused (syrupy does not
look for unused snapshots under pytest-xdist); `--snapshot-update` deletes it.

The pictures are Textual's and Rich's drawing: they were made with Textual 8.2.8 and Rich 15.0.0, and
another version of either may draw some cell differently; then compare in the report and update.
"""

from __future__ import annotations

import itertools

import pytest
from still_source import DEMO, StillSource

from kvtui.events import Contamination, Finish, ReferenceStatus
from kvtui.record import read_recording
from kvtui.tui.app import KvtuiApp

SIZES = pytest.mark.parametrize("size", [(100, 30), (160, 45)], ids=["100x30", "160x45"])


async def shown(pilot) -> None:
    """Wait until the app drew the source's one snapshot (it is posted when the app mounts)."""
    for _ in range(100):
        if pilot.app.frames:
            break
        await pilot.pause(0.05)
    assert pilot.app.frames == 1


async def help_shown(pilot) -> None:
    await shown(pilot)
    await pilot.press("question_mark")


def until_t(events, t: float) -> list:
    """The events of the recording's first `t` seconds (run clock), in file order."""
    return list(itertools.takewhile(lambda e: e.t <= t, events))


def through(events, found) -> list:
    """The events up to and including the first for which `found(event)` is true."""
    end = next(i for i, e in enumerate(events) if found(e))
    return events[:end + 1]



@pytest.fixture(scope="session")
def demo():
    """The passphrase demo recording (SmolLM2; shared_cache on from 2.5 s to 6 s, r007 and r008 answer
    with r009's passphrase): (header, typed events in file order), the summary left out."""
    header, events, _summary, _lines = read_recording(DEMO)
    return header, events


@pytest.fixture
def dashboard(demo):
    """A factory: `dashboard(events, mode="LIVE")` -> a KvtuiApp on a StillSource of the demo's header
    and `events`."""

    def make(events, mode: str = "LIVE") -> KvtuiApp:
        return KvtuiApp(StillSource(demo[0], events, mode))

    return make


class TestLive:
    @SIZES
    def test_run_in_progress_with_isolation_on(self, snap_compare, dashboard, demo, size):
        """2.45 s into the demo: r003 and r004 decoding in slots 0 and 1, r005 waiting, three finished."""
        app = dashboard(until_t(demo[1], 2.45))
        assert snap_compare(app, terminal_size=size, run_before=shown)


class TestLeak:
    @SIZES
    def test_fault_on_and_the_canary_finding_victim_from_source(self, snap_compare, dashboard, demo, size):
        """shared_cache on since 2.7 s; the canary has just reported r008 answering with r009's passphrase
        (LEAK←r009 in the request table, `r008 ← r009` in the contamination panel)."""
        app = dashboard(through(demo[1], lambda e: isinstance(e, Contamination) and e.detector == "canary"
                                and e.victim == "r008"))
        assert snap_compare(app, terminal_size=size, run_before=shown)


class TestClosing:
    @SIZES
    def test_reference_checks_draining_after_the_last_request(self, snap_compare, dashboard, demo, size):
        """Every request finished; the closing reference checks have reported 3 of the last 8 (11 of 16
        checked, 5 waiting), as the live source shows them while the session closes."""
        events = through(demo[1], lambda e: isinstance(e, Finish) and e.request_id == "r013")
        last = events[-1].t
        drained = [e for e in demo[1][len(events):] if isinstance(e, Contamination) and e.detector == "reference"]
        status = ReferenceStatus(t=last, checked=11, skipped=0, pending=5)
        app = dashboard([*events, *drained[:3], status], mode="CLOSING: checks 11/16 · q skips")
        assert snap_compare(app, terminal_size=size, run_before=shown)


async def block_map_shown(pilot) -> None:
    await shown(pilot)
    await pilot.press("m")


class TestBlockMap:
    @SIZES
    def test_block_map_marks_where_the_fault_acted_and_the_detectors_fired(self, snap_compare, dashboard, demo, size):
        """The LEAK moment with `m` pressed: the block map in place of the requests, every slot marked `!`
        (shared_cache acted on each running request's rows), each owner's line naming the fault and the
        detector that fired on it (r008: the canary), its age and the slot's previous owner."""
        app = dashboard(through(demo[1], lambda e: isinstance(e, Contamination) and e.detector == "canary"
                                and e.victim == "r008"))
        assert snap_compare(app, terminal_size=size, run_before=block_map_shown)


class TestTimelines:
    @SIZES
    def test_replay_timelines_after_seeking_into_the_leak(self, snap_compare, size):
        """`kvtui replay` of the demo, paused and moved to 5 s, `t` pressed: one lane per request, the newest
        step at the right; r003 onwards marked `!` where shared_cache acted on them and `*` where a detector
        reported them, r010 and r011 still queued."""
        from kvtui.tui.replay import ReplaySource

        source = ReplaySource.from_file(DEMO, start_paused=True)
        source.seek_to(5.0)

        async def timelines_shown(pilot) -> None:
            await pilot.pause(0.1)
            await pilot.press("t")

        assert snap_compare(KvtuiApp(source), terminal_size=size, run_before=timelines_shown)


class TestHelp:
    @SIZES
    def test_help_over_the_live_screen(self, snap_compare, dashboard, demo, size):
        app = dashboard(until_t(demo[1], 2.45))
        assert snap_compare(app, terminal_size=size, run_before=help_shown)
