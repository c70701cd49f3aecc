"""RunSink: where every event of one run goes (a local run and a target run alike)."""

from __future__ import annotations

from collections.abc import Callable

from kvtui.events import Contamination, ReferenceStatus, Summary
from kvtui.metrics import SLO, Metrics
from kvtui.record import RecordingWriter

Listener = Callable[[object], None]


class RunSink:
    """One run's events in, in a fixed order: a contamination report first joins its victim's finding
    (kvtui/detect/findings.py) and is kept, then every event goes to the recording, the metrics and
    each listener, in that order.

    Args:
        slo: the scenario's SLO (the metrics' goodput).
        clock: the run's time now (seconds on the run's clock), for the RecordingFailed event.
        record_path: the JSONL recording to write, or None.
        listeners: callables receiving every event (e.g. the dashboard's publisher); `listeners` is a
            list that callers may append to.
        keep: contamination reports kept in `contamination` (the first `keep`; None: all); every
            report still goes to the recording, the metrics count them all.
        on_finding: called with each joined report before it is written (a local run counts it for
            the faults that were on).
        background_sync: the recording's periodic fsync in a thread (kvtui.record.RecordingWriter): a
            target run's sending loop is not held up by the disk.

    Raises:
        OSError: the recording cannot be created or opened (kvtui.record.RecordingWriter).
    """

    def __init__(self, slo: SLO, *, clock: Callable[[], float], record_path=None,
                 listeners: tuple[Listener, ...] = (), keep: int | None = None,
                 on_finding: Callable[[Contamination], None] | None = None, background_sync: bool = False) -> None:
        self.metrics = Metrics(slo)
        self.recorder = RecordingWriter(record_path, background_sync=background_sync) if record_path else None
        self.listeners: list[Listener] = list(listeners)
        self.contamination: list[Contamination] = []
        self.keep = keep
        self.on_finding = on_finding
        self._clock = clock

    def watch_recording(self) -> None:
        """From now on a failed write stops the recording only and listeners get a RecordingFailed
        event; a recording whose lines so far could not be written (e.g. /dev/full) is refused.

        Raises:
            OSError: a write before this call failed (the recording's first lines)."""
        if self.recorder is None:
            return
        if self.recorder.failed:
            raise self.recorder.error
        self.recorder.on_error = self._recording_failed

    def _recording_failed(self, recorder: RecordingWriter) -> None:
        event = recorder.failed_event(self._clock())
        for listener in self.listeners:
            listener(event)

    def emit(self, event) -> None:
        """Send one typed event (kvtui.events) to the findings join, the recording, the metrics and
        every listener."""
        if isinstance(event, Contamination):
            event = self.metrics.findings.add(event)
            if self.keep is None or len(self.contamination) < self.keep:
                self.contamination.append(event)
            if self.on_finding is not None:
                self.on_finding(event)
        if self.recorder is not None:
            self.recorder.write(event)
        self.metrics.add_event(event)
        for listener in self.listeners:
            listener(event)

    def emit_reference_status(self, status: ReferenceStatus) -> None:
        """Emit a reference.status event unless its counts are those of the last one (its time aside)."""
        last = self.metrics.reference
        if last is None or status.model_copy(update={"t": last.t}) != last:
            self.emit(status)

    @property
    def recording_error(self) -> str:
        """One line naming the recording, where it stopped and why; "" when it is whole (or none)."""
        return self.recorder.describe_error() if self.recorder is not None else ""

    def finish(self, summary: Summary) -> Summary:
        """Emit the run's summary, its last line, then flush and close the recording (a failure is
        kept in `recording_error`); returns `summary`."""
        self.emit(summary)
        if self.recorder is not None:
            self.recorder.close()
        return summary

    def abandon_recording(self) -> None:
        """The run never started: close the recording and remove it when nothing was written to it."""
        if self.recorder is not None:
            self.recorder.close()
            if self.recorder.path.is_file() and self.recorder.path.stat().st_size == 0:  # never /dev/full
                self.recorder.path.unlink()
            self.recorder = None
