"""`kvtui run SCENARIO --target URL` in the dashboard: a TargetSession driven in a Textual thread worker.

The worker thread runs the session's asyncio loop; every event goes through the same DashboardState as
a local run (kvtui/tui/state.py), which keeps what the server exposes in a ServerTrack, and the slot
map and stats panel draw that instead of engine internals (kvtui/tui/server_panels.py). Snapshots go out
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


class TargetSource(Source):
    """Runs one TargetSession (kvtui/remote/session.py) made by `make_session(listener)`: at once in the
    caller's thread, or, with `loading_text`, in the worker while the dashboard shows that text (loading
    the scenario model's tokenizer and planning take seconds; the dashboard is up meanwhile). A failure to make it stays on
    screen (q quits) and is kept in `setup_error` for the caller to report.
    """

    kind = "live"
    LIVE_ACTIONS = frozenset()

    def __init__(self, make_session, *, loading_text: str | None = None) -> None:
        super().__init__()
        self.state = DashboardState()
        self.make_session, self.loading_text = make_session, loading_text
        self.session = None if loading_text else make_session(self._apply)  # a TargetSession once made
        self.summary = None
        self.error: BaseException | None = None
        self.setup_error: Exception | None = None  # making the session failed (the run never started)
        self.worker: Worker | None = None
        self._exited = threading.Event()
        self._stop_asked = False

    def _apply(self, event) -> None:
        self.state.apply(event)
        if self.publish_due():
            self.publish(build_snapshot(self.state), force=True)

    def _tick(self, session) -> None:
        """At every poll of the server: a snapshot even when no event came (the clock moves)."""
        if self.publish_due():
            self.publish(build_snapshot(self.state), force=True)

    def mode(self) -> str:
        if self.session is None:
            return "ERROR" if self.setup_error else "LOADING"
        if self.summary is not None:
            return "DONE"
        if self.session.stop_requested:
            return "CLOSING"
        return "ARRIVALS HELD" if self.paused else "LIVE"

    def refusal(self, action: str) -> str | None:
        """Holding arrivals (space) needs a run that started and has not ended."""
        if action != "pause":
            return None
        if self.session is None:
            return "the run has not started (see the events panel): nothing to hold yet; q quits"
        if self.summary is not None or self.session.stop_requested:
            return "the run is over: no arrivals left to hold; q quits"
        return None

    def attach(self, app: App) -> bool:
        if not super().attach(app):
            return False
        self.worker = app.run_worker(self._run, thread=True, name="target", group="target", exit_on_error=False)
        return True

    def _start(self) -> bool:
        """Make the session in the worker, the loading text on screen meanwhile; False when that failed
        (the error stays on screen)."""
        self.state.note("info", self.loading_text)
        self.publish(build_snapshot(self.state), force=True)
        try:
            session = self.make_session(self._apply)
            session.stop_requested = self._stop_asked
            self.session = session
        except Exception as e:  # a bad model or recording path: said on screen, reported by the caller
            self.setup_error = e
            self.state.note("error", f"{e} (q quits)")
            self.publish(build_snapshot(self.state), force=True)
            return False
        return True

    def _run(self) -> None:
        if self.session is None and not self._start():
            self._exited.set()
            return
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
        if self.session is None:
            return
        self.paused = not self.paused
        self.session.hold(self.paused)
        self.state.note("info", "arrivals held (requests in flight go on)" if self.paused else "arrivals resumed")
        self.publish(build_snapshot(self.state), force=True)

    def request_stop(self) -> None:
        self._stop_asked = True  # also when the session is still being made: it then stops at once
        if self.session is not None:
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
        if self.summary is None and self.session is not None:
            self.summary = self.session.close()
        return self.summary


def run_target_dashboard(make_session, loading_text: str | None = None, on_signal=None):
    """Run the dashboard on a TargetSession until `q` or the run's end and `q`. With `loading_text` the
    session is made in the dashboard's worker (see TargetSource). `on_signal` is called with the signal's
    number when SIGTERM or SIGINT stopped it (after the run closed).

    Returns:
        (summary, header, session): the summary (None if the run did not close), its Header, the session;
        (None, None, None) when the session could not be made.

    Raises:
        Exception: what `make_session` raised, once the dashboard has closed.
    """
    from kvtui.tui.app import KvtuiApp
    from kvtui.tui.launch import run_app

    source = TargetSource(make_session, loading_text=loading_text)
    signum = run_app(KvtuiApp(source), source)
    summary = source.shutdown()
    if signum is not None and on_signal is not None:
        on_signal(signum)
    if source.setup_error is not None:
        raise source.setup_error
    if source.session is None:
        return None, None, None
    return summary, source.session.header(), source.session
