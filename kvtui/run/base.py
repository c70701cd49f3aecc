"""RunBase: what a local run (kvtui/session.py) and a target run (kvtui/remote/session.py) share over
their sink: the properties the CLI, the dashboard and `verdict` read, `emit`, the start of the
recording, the reference.status event, the observers' reports and deferred work (kvtui/run/observers.py) and
the closing path."""

from __future__ import annotations

from collections.abc import Callable

from kvtui.detect.observer import DrainBudget
from kvtui.events import Contamination, Header, Summary
from kvtui.metrics import Metrics
from kvtui.record import RecordingWriter
from kvtui.run.build import reference_status
from kvtui.run.sink import Listener, RunSink


class RunBase:
    """The shared half of a run (kvtui.run.outcome.RunOutcome). A subclass sets `sink` (a RunSink),
    `summary` (None until closed), `stop_requested` and `observers` (kvtui/run/observers.py
    build_observers), and gives `now()` (seconds on the run's clock) and, unless one of its observers
    keeps them, `_reference_counts()` (the reference.status fields it knows)."""

    sink: RunSink
    observers: list
    summary: Summary | None
    stop_requested: bool
    faults_known: bool

    @property
    def metrics(self) -> Metrics:
        return self.sink.metrics

    @property
    def recorder(self) -> RecordingWriter | None:
        return self.sink.recorder

    @property
    def listeners(self) -> list[Listener]:
        """Callables receiving every event; append to add one."""
        return self.sink.listeners

    @property
    def contamination(self) -> list[Contamination]:
        """The run's contamination reports (the first `sink.keep`), joined to their victims' findings
        (the metrics count them all)."""
        return self.sink.contamination

    @property
    def recording_error(self) -> str:
        """One line naming the recording, where it stopped and why; "" when it is whole (or none)."""
        return self.sink.recording_error

    def now(self) -> float:
        """Seconds on the run's clock."""
        raise NotImplementedError

    def observer(self, name: str):
        """The run's observer `name` (a detector name, or "engine" in a local run; kvtui/run/observers.py),
        or None when the run has none of that name. An observer's `detector` is its detector: the
        reference observer's the ReferenceDetector (checked, pending, tolerance), the canary's the
        CanaryDetector (passphrases)."""
        return next((o for o in self.observers if o.name == name), None)

    def _emit_all(self, reports) -> None:
        """Emit observers' reports: `reports` yields one list per observer, in the observers' order (each
        observer is asked as its turn comes, after the reports before it went out)."""
        for found in reports:
            for event in found:
                self.emit(event)

    def emit(self, event) -> None:
        """Send one typed event through the run's sink (kvtui/run/sink.py): a contamination report joins
        its victim's finding, then the recording, the metrics and every listener."""
        self.sink.emit(event)

    def _start_recording(self, header: Header) -> None:
        """Emit the header (the recording's first line), then watch the recording: from here a failed
        write stops the recording only.

        Raises:
            OSError: the header could not be written (e.g. /dev/full; the writer has closed the file)."""
        self.emit(header)
        self.sink.watch_recording()

    def _reference_counts(self) -> dict:
        """The reference.status fields of kvtui.run.build.reference_status but the time: checked,
        skipped_by_reason, pending (and cached, uncached_verified for a target run). Here: those of the
        observer that keeps them (the reference detector's); StopIteration when none does."""
        return next(counts for o in self.observers if (counts := o.counts()) is not None)

    def _pending_work(self) -> int:
        """Deferred observer work waiting for `_drain_observers` (completed requests whose reference check
        waits)."""
        return sum(o.pending for o in self.observers)

    def _drain_observers(self, should_stop: Callable[[], bool], *, one_batch: bool = False,
                         progress: Callable[[int, int], None] | None = None) -> None:
        """Run each counting observer's waiting work (the reference checks: one batch of them when
        `one_batch`, else all) until `should_stop()` turns true, between two steps of the work. Emits
        each request's reports as soon as it is compared, and a reference.status event; with `progress`,
        a reference.status event and `progress(checked, total)` after every request (the closing checks,
        shown as they go)."""
        for observer in self.observers:
            before = observer.counts()
            if before is None:
                continue
            total = before["checked"] + before["pending"]

            def checked(found: list, observer=observer, total=total) -> None:
                self._emit_all([found])
                if progress is not None:
                    done = observer.counts()["checked"]
                    self._reference_status(pending=total - done)
                    progress(done, total)

            if progress is not None and before["pending"]:  # say what is waiting before the first check
                self._reference_status()
            budget = DrainBudget(self.now, observer.batch if one_batch else None, should_stop, checked)
            self._emit_all([observer.drain(budget)])
            if progress is None or observer.counts()["checked"] == before["checked"]:
                self._reference_status()

    def _reference_status(self, pending: int | None = None) -> None:
        """A reference.status event with the run's counts (`pending` replaces its own when given),
        unless they are those of the last one."""
        counts = self._reference_counts()
        if pending is not None:
            counts["pending"] = pending
        self.sink.emit_reference_status(reference_status(self.now(), **counts))

    def _close_run(self, *, work_left: bool, requests_not_submitted: int, **fields) -> Summary:
        """The one closing path: the summary (stopped early when a stop left work undone: requests not
        submitted or cut off in flight), emitted last, and the recording closed. Once; later calls
        return the same summary.

        Args:
            work_left: requests were still waiting or in flight when the stop came.
            requests_not_submitted: planned requests never sent to the engine or server.
            fields: the run's own summary fields (kvtui.metrics.Metrics.summary).
        """
        if self.summary is None:
            self.summary = self.metrics.summary(t=self.now(), stopped_early=self.stop_requested and work_left,
                                                requests_not_submitted=requests_not_submitted, **fields)
            self.sink.finish(self.summary)
        return self.summary
