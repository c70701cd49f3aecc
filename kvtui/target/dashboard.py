"""`kvtui run SCENARIO --target URL` in the dashboard: a TargetSession driven in a Textual thread worker.

The worker thread runs the session's asyncio loop; every event goes through the same DashboardState as
a local run (kvtui/tui/state.py), which keeps what the server exposes in a ServerTrack, and the slot
map and stats panel draw that instead of engine internals (kvtui/target/panels.py). Snapshots go out
on events and at every poll of the server, at most the app's frame rate. There are no engine controls
(faults, rate, bursts, steps); `space` holds new arrivals (requests in flight go on), `q` stops the run:
in-flight requests are aborted and the summary is written.
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING

from kvtui.tui.snapshot_build import build_snapshot
from kvtui.tui.sources import Source
from kvtui.tui.state import DashboardState

if TYPE_CHECKING:
    from textual.app import App
    from textual.worker import Worker

    from kvtui.target.session import TargetSession


class TargetSource(Source):
    """Runs one TargetSession (made by `make_session(listener)`, at once, in the caller's thread)."""

    kind = "live"
    LIVE_ACTIONS = frozenset()

    def __init__(self, make_session) -> None:
        super().__init__()
        self.state = DashboardState()
        self.session: TargetSession = make_session(self._apply)
        self.summary = None
        self.error: BaseException | None = None
        self.worker: Worker | None = None
        self._exited = threading.Event()

    def _apply(self, event) -> None:
        self.state.apply(event)
        if self.publish_due():
            self.publish(build_snapshot(self.state), force=True)

    def _tick(self, session) -> None:
        """At every poll of the server: a snapshot even when no event came (the clock moves)."""
        if self.publish_due():
            self.publish(build_snapshot(self.state), force=True)

    def mode(self) -> str:
        if self.summary is not None:
            return "DONE"
        if self.session.stop_requested:
            return "CLOSING"
        return "ARRIVALS HELD" if self.paused else "LIVE"

    def attach(self, app: App) -> bool:
        if not super().attach(app):
            return False
        self.worker = app.run_worker(self._run, thread=True, name="target", group="target", exit_on_error=False)
        return True

    def _run(self) -> None:
        try:
            self.publish(build_snapshot(self.state), force=True)
            self.summary = asyncio.run(self.session.run_async(self._tick))
        except BaseException as e:  # keep the dashboard up and say what failed
            self.error = e
            self.state.note("error", f"{type(e).__name__}: {e}")
            self.summary = self.session.close()
        finally:
            self._exited.set()
            self.publish(build_snapshot(self.state), force=True)

    def toggle_pause(self) -> None:
        """Hold new arrivals / let them go (a server cannot be paused from outside)."""
        self.paused = not self.paused
        self.session.hold(self.paused)
        self.state.note("info", "arrivals held (requests in flight go on)" if self.paused else "arrivals resumed")
        self.publish(build_snapshot(self.state), force=True)

    def request_stop(self) -> None:
        self.session.stop_requested = True
        self.session.hold(False)

    async def stop(self):
        """Stop the run (in-flight requests aborted, summary written) and return the summary."""
        self.request_stop()
        while self.worker is not None and not self._exited.is_set():
            await asyncio.sleep(0.02)
        return self.summary

    def shutdown(self, timeout_s: float = 60.0):
        """After the app exited: make sure the run ended and the recording has its summary."""
        self.request_stop()
        if self.worker is not None and not self._exited.wait(timeout_s):
            return None
        if self.summary is None:
            self.summary = self.session.close()
        return self.summary


def run_target_dashboard(make_session):
    """Run the dashboard on a TargetSession until `q` or the run's end and `q`.

    Returns:
        (summary, header, session): the summary (None if the run did not close), its Header, the session.
    """
    from kvtui.tui.app import KvtuiApp
    from kvtui.tui.launch import _run_app

    source = TargetSource(make_session)
    _run_app(KvtuiApp(source), source)
    summary = source.shutdown()
    return summary, source.session.header(), source.session
