"""Fixtures of the dashboard room's snapshot tests: the committed passphrase demo recording, and a dashboard
that shows one moment of it as a live run's source would post it. A module of its own, not a conftest.py:
test_snapshots.py imports StillSource and DEMO by name, and with pytest's default import mode no test may
import a conftest: the module `conftest` is whichever conftest.py pytest loaded last
(tests/architecture/test_structure.py checks it, and keeps module names under tests/ unique).

The shared helpers at the top of tests/ stay importable here (`from helpers import ...`): pytest puts
tests/ on sys.path when it loads tests/conftest.py, which it does for every test below it.
"""

from __future__ import annotations

from pathlib import Path

from kvtui.tui.live import LiveSource
from kvtui.tui.snapshot_build import build_snapshot
from kvtui.tui.sources import Source
from kvtui.tui.state import DashboardState

DEMO = Path(__file__).resolve().parents[2] / "recordings" / "passphrase_demo.jsonl"


class StillSource(Source):
    """One moment of a recording, shown as the live source would show it: the header's mode is `mode`
    (LIVE, CLOSING: checks 11/16 ...), the footer offers a live run's keys, and the panels draw the
    state after `events` (the recording's own, in file order). It posts that one snapshot when the app
    mounts and never changes it: no worker, no timer, no wall clock, so every picture of it is the same.

    Args:
        header: the recording's Header.
        events: the typed events to apply after it (kvtui.events).
        mode: the header's mode text.
    """

    kind = "live"
    LIVE_ACTIONS = LiveSource.LIVE_ACTIONS

    def __init__(self, header, events, mode: str) -> None:
        super().__init__()
        self.state = DashboardState()
        for event in (header, *events):
            self.state.apply(event)
        self._mode = mode

    def mode(self) -> str:
        return self._mode

    def attach(self, app) -> bool:
        if not super().attach(app):
            return False
        self.publish(build_snapshot(self.state), force=True)
        return True
