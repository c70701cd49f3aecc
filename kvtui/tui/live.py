"""LiveSource: a Session stepped in a Textual thread worker.

Threading: the worker thread owns the Session and the DashboardState. The UI thread never calls
the session; it queues commands (fault switches, bursts, a single step, restart) that the worker
runs between steps, so faults switch at step boundaries. The worker posts a snapshot at most
every `min_interval_s` (1/20 s, raised by the app when drawing costs more than its CPU share), and
builds one only when it is due; the UI never blocks it.

Once the run is closing or done, the controls that would change it (faults, bursts, rates, pause, a step)
are refused with the reason (`refusal`), so a key never seems to act on a run that will not go on; `r`
restarts, keeping the faults picked by key. With `interrupt_on_stop` (kvtui serve --dashboard) a stop
also interrupts the engine step in progress, as the server's own stop does.

On the paced clock (kvtui/pacing.py) the worker holds each step, and the snapshot that shows it, until
the wall clock reaches the engine's modeled time; it waits in slices of HOLD_SLICE_S, so a key press
is served at once, and spends the waits on waiting reference checks.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvtui.events import ReferenceStatus
from kvtui.tui.snapshot_build import build_snapshot
from kvtui.tui.sources import Source
from kvtui.tui.state import DashboardState

if TYPE_CHECKING:
    from textual.app import App
    from textual.worker import Worker

    from kvtui.session import Session

# make_session(listener, generation) -> a new Session whose listeners include `listener`;
# generation counts restarts (0 for the first run).
SessionFactory = Callable[[Callable[[dict], None], int], "Session"]
HOLD_SLICE_S = 0.05  # paced clock: the longest wait before the worker looks at its commands again
CONTROLS = frozenset({"isolation", "faults", "pause", "step", "rate_up", "rate_down", "burst"})  # change a running run


class LiveSource(Source):
    """Runs sessions made by `make_session`. Without `prepare` the first is made at once, in the
    caller's thread; with it, the worker first runs `prepare()` (loading the model) while the dashboard
    says so, then makes the session.

    Args:
        make_session: the factory (see SessionFactory).
        prepare: slow set-up to run in the worker before the first session (e.g. loading the model).
        loading_text: what the dashboard shows meanwhile.
        torch_threads: if set, torch.set_num_threads(n) in the worker before the first step.
        interrupt_on_stop: a stop (q, SIGTERM) also interrupts the engine step in progress at its next layer
            (kvtui serve --dashboard: a long prefill need not finish before its clients get "abort").
    """

    kind = "live"
    LIVE_ACTIONS = frozenset({"isolation", "faults", "rate", "burst", "restart", "step"})

    def __init__(self, make_session: SessionFactory, *, prepare: Callable[[], None] | None = None,
                 loading_text: str = "loading the model…", torch_threads: int | None = None,
                 interrupt_on_stop: bool = False) -> None:
        super().__init__()
        self.make_session = make_session
        self.prepare, self.loading_text = prepare, loading_text
        self.error: Exception | None = None  # set when preparing or making the first session failed
        self.torch_threads = torch_threads
        self.interrupt_on_stop = interrupt_on_stop
        self.picked: set[str] | None = None  # the faults last picked by key (f, i); a restart keeps them
        self.generation = 0
        self._closing = False
        self.parked = False  # the worker is waiting (paused or done), not stepping: tests read it
        self.closing_checks: tuple[int, int] | None = None  # (checked, total) of the closing reference checks
        self._unshown = False  # paced clock: a step ran whose snapshot waits for the wall clock
        self.state = DashboardState()
        self.session: Session | None = None if prepare else make_session(self._apply, 0)
        self._hear_compiles()
        self.done = False
        self.summary = None  # kvtui.events.Summary once the session closed
        self.worker: Worker | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._exited = threading.Event()

    def _apply(self, event) -> None:
        self.state.apply(event)
        if not self._closing:
            return
        # close() may take a minute (reference checks): show each check's result and progress at once
        if isinstance(event, ReferenceStatus):
            self.closing_checks = (event.checked, event.checked + event.pending)
        if isinstance(event, ReferenceStatus) or self.publish_due():
            self.publish(self._snapshot(), force=True)

    def _snapshot(self):
        """The state frozen for the UI, with the paced clock's pace (model seconds per wall second)."""
        pacer = self.session.clock.pacer if self.session is not None else None
        self.state.pace = pacer.pace() if pacer is not None else None
        return build_snapshot(self.state)

    def mode(self) -> str:
        if self.session is None:
            return "ERROR" if self.error else "LOADING"
        if self.done:
            return "DONE"
        if self._closing or self._stop.is_set():  # close() may run the reference detector's solo checks first
            if self.closing_checks is None or self._stop.is_set():
                return "CLOSING"
            checked, total = self.closing_checks
            return f"CLOSING: checks {checked}/{total} · q skips" if checked < total else "CLOSING"
        return "PAUSED" if self.paused else "LIVE"

    def refusal(self, action: str) -> str | None:
        """Why `action` cannot act now: the model is loading or failed, the app is quitting, or the run is
        closing or done (then only `r` acts: it restarts)."""
        if action not in CONTROLS and action != "restart":
            return None
        if self.session is None:
            if self.error is not None:
                return "the run did not start (the events panel says why); q quits"
            return "the model is still loading; keys act once the run starts"
        if self._stop.is_set():
            return "quitting: the session is closing"
        if action == "restart":
            return None
        if self.done:
            return "the run is over (DONE): nothing more runs; r restarts it, q quits"
        if self._closing:
            return "the run is closing (its last checks): nothing more runs; r restarts it, q quits"
        return None

    # -- worker -----------------------------------------------------------------------------------
    def attach(self, app: App) -> bool:
        if not super().attach(app):
            return False
        self.worker = app.run_worker(self._run, thread=True, name="engine", group="engine", exit_on_error=False)
        return True

    def _run(self) -> None:
        """The worker loop: commands, then one session step unless paused or done; publish."""
        try:
            self._loop()
        finally:
            self._exited.set()

    def _loop(self) -> None:
        if self.session is None:
            if not self._start():
                self._stop.wait()
                return
        else:
            self._set_threads()
        self.publish(self._snapshot(), force=True)
        while not self._stop.is_set():
            self._wake.clear()  # before draining, so a command queued from now on wakes the wait below
            ran = self._drain()
            if self.paused or self.done:
                if ran:
                    self.publish(self._snapshot(), force=True)
                self.parked = True
                self._wake.wait(0.5)
                continue
            self.parked = False
            if self._hold():  # paced clock: the engine is ahead of the wall; it waited a slice
                if ran:
                    self.publish(self._snapshot(), force=True)
                continue
            self._show_due()
            try:
                more = self.session.step_once()
            except Exception as e:  # keep the dashboard alive and say what failed
                from kvtui.engine import StepInterrupted  # (torch is loaded by now: a session runs)

                if self._stop.is_set() and isinstance(e, StepInterrupted):  # the stop cut the step short
                    break
                self._fail(e)
                continue
            if not more:
                self._finish()
            self._unshown = True
            if self.done or self.session.clock.pacer is None:
                self._show_due(force=self.done)
        self._finish(early=True)
        self.publish(self._snapshot(), force=True)

    def _hold(self) -> bool:
        """Paced clock: wait one slice (or until a command wakes the worker) while the wall clock has not
        reached the engine's modeled time; returns whether it is still ahead."""
        try:
            return self.session.clock.hold_for_wall(max_wait_s=HOLD_SLICE_S, wait=self._wake.wait) > 0
        except Exception as e:  # a reference check that failed: keep the dashboard alive
            self._fail(e)
            return True

    def _show_due(self, force: bool = False) -> None:
        """Post the steps run since the last snapshot when one is due (the snapshot is built only then)."""
        if self._unshown and (force or self.publish_due()):
            self._unshown = False
            self.publish(self._snapshot(), force=True)

    def _set_threads(self) -> None:
        if self.torch_threads:
            import torch

            torch.set_num_threads(self.torch_threads)

    def _start(self) -> bool:
        """Run `prepare` and make the first session, showing the loading text meanwhile (before torch is
        even imported); on failure keep the dashboard up with the error (q quits) and return False."""
        self.state.note("info", self.loading_text)
        self.publish(self._snapshot(), force=True)
        try:
            self._set_threads()
            t0 = time.perf_counter()
            self.prepare()
            self.state.note("info", f"model loaded in {time.perf_counter() - t0:.1f} s")
            self.session = self.make_session(self._apply, 0)
            self._hear_compiles()
        except Exception as e:
            self.error = e
            self.state.note("error", f"{type(e).__name__}: {e} (q quits)")
            self.publish(self._snapshot(), force=True)
            return False
        self._sync_clock()
        return True

    def _hear_compiles(self) -> None:
        """The compiled decode step's lines (kvtui/engine/compiled.py: a shape kind's first compile, or its
        code from cache) go to the event log at once: a first compile holds the step for a minute or more."""
        compiled = getattr(getattr(getattr(self.session, "engine", None), "runner", None), "compiled", None)
        if compiled is not None:
            compiled.announce = self._note_now

    def _note_now(self, line: str) -> None:
        self.state.note("info", line)
        self.publish(self._snapshot(), force=True)

    def _fail(self, error: Exception) -> None:
        self.state.note("error", f"{type(error).__name__}: {error} (paused; r restarts)")
        self.paused = True
        self.publish(self._snapshot(), force=True)

    def _finish(self, early: bool = False) -> None:
        """Close the session once (summary written); `early`: it was cut short (quit, restart)."""
        if not self.done and self.session is not None:
            if early:
                self.session.stop_requested = True
            self._closing = True
            try:
                if self.app is not None:
                    self.publish(self._snapshot(), force=True)  # shows CLOSING while close() runs
                self.summary = self.session.close()
            finally:
                self._closing = False
                self.closing_checks = None
            self.done = True

    def _drain(self) -> bool:
        ran = False
        while True:
            try:
                command, control = self._commands.get_nowait()
            except queue.Empty:
                return ran
            ran = True
            if control and self.done:  # queued just before the run ended: it would act on a closed session
                self.state.note("info", "a key pressed as the run ended was not applied: the run ended first")
                continue
            try:
                command()
            except Exception as e:
                self.state.note("error", f"{type(e).__name__}: {e}")

    def _queue(self, command: Callable[[], None], control: bool = True) -> None:
        """Run `command` in the worker between steps; a `control` changes the run, so it is dropped (and
        said) if the run has ended by then."""
        self._commands.put((command, control))
        self._wake.set()

    # -- controls (UI thread) ---------------------------------------------------------------------
    def toggle_pause(self) -> None:
        """Pause or resume: the worker stops stepping and the run's clock stops with it (so a pause never
        counts as latency); `n` steps while paused advance it by their own duration."""
        self.paused = not self.paused
        self._queue(self._sync_clock, control=False)  # also republishes with the new mode

    def _sync_clock(self) -> None:
        (self.session.clock.pause if self.paused else self.session.clock.resume)()

    def step(self) -> None:
        self._queue(self._step_one)

    def _step_one(self, max_wait_s: float = 2.0) -> None:
        """Call step_once until one engine step ran (idle calls only wait for arrivals), the run is
        done, or `max_wait_s` seconds passed with nothing to run."""
        before, deadline = self.state.step, time.monotonic() + max_wait_s
        while not self.done and self.state.step == before and time.monotonic() < deadline:
            if not self.session.step_once():
                self._finish()

    def set_faults(self, names: set[str], source: str = "key") -> None:
        """Switch faults so that exactly `names` are on (at the next step boundary); by key, they are the
        picked set a restart keeps."""
        wanted = set(names)
        if source == "key":
            self.picked = wanted

        def faults() -> None:  # runs in the worker, between steps
            self._switch(wanted, source)

        self._queue(faults)

    def _switch(self, wanted: set[str], source: str) -> None:
        current = set(self.session.engine.faults)
        for name in sorted(current - wanted):
            self.session.controls.set_fault(name, False, source=source)
        for name in sorted(wanted - current):
            self.session.controls.set_fault(name, True, source=source)

    def scale_rate(self, factor: float) -> None:
        def rate() -> None:
            self.session.controls.scale_arrival_rate(factor)

        self._queue(rate)

    def burst(self, count: int) -> None:
        def burst() -> None:
            if not self.session.controls.burst(count):
                self.state.note("info", "burst: no planned request is left to arrive")

        self._queue(burst)

    def restart(self) -> None:
        self._queue(self._restart, control=False)

    def _restart(self) -> None:
        """Close the current session (its recording gets a summary) and start a fresh one, with the faults
        picked by key when there are (else the scenario's)."""
        self._finish(early=True)
        self.generation += 1
        self.state = DashboardState()
        self.summary, self.done = None, False
        try:
            self.session = self.make_session(self._apply, self.generation)
            self._hear_compiles()
        except Exception as e:
            self.done = True
            self.state.note("error", f"restart failed: {type(e).__name__}: {e}")
            return
        self._sync_clock()  # a restart while paused starts paused
        if self.picked is None:
            self.state.note("info", f"restart #{self.generation}")
            return
        self._switch(self.picked, "key")  # the faults picked by key, not the scenario's start set
        kept = ", ".join(sorted(self.picked)) or "none (isolation ON)"
        self.state.note("info", f"restart #{self.generation} keeps the faults picked by key: {kept}")

    async def stop(self) -> dict | None:
        """Ask the worker to stop, wait for it (it closes the session), return the summary."""
        self.request_stop()
        if self.worker is not None:
            while not self._exited.is_set():
                await asyncio.sleep(0.02)
        else:
            self._finish(early=True)
        return self.summary

    def request_stop(self) -> None:
        """Tell the worker to close the session and end (any thread; returns at once). Reference checks
        still waiting are skipped (the summary counts them)."""
        if self.session is not None:
            self.session.stop_requested = True  # read between engine steps, also while closing
            if self.interrupt_on_stop:
                self.session.engine.interrupt()  # the step in progress stops at its next layer
        self._stop.set()
        self._wake.set()

    def shutdown(self, timeout_s: float = 60.0) -> dict | None:
        """From outside the app (after it exited): stop the worker and make sure the session is
        closed, so the recording ends with its summary. Safe to call more than once."""
        self.request_stop()
        if self.worker is not None and not self._exited.wait(timeout_s):
            return None  # a step is still running; the worker closes the session when it ends
        self._finish(early=True)
        return self.summary
