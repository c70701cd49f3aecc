"""ReplaySource: a recording played back at a chosen speed, with pause, single steps and seeking.

No model is loaded. The events go through the same DashboardState as a live run. Playback runs on
the UI thread from a timer (applying events is cheap); seeking back rebuilds the state from the
start up to the target time.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvtui.events import StepEvent
from kvtui.tui.snapshot_build import build_snapshot
from kvtui.tui.sources import Source
from kvtui.tui.state import DashboardState

if TYPE_CHECKING:
    from textual.app import App

TICK_S = 0.05  # playback timer period (seconds of real time)
MIN_SPEED, MAX_SPEED = 1 / 64, 256.0


class ReplaySource(Source):
    """Plays `events` (as read by kvtui.record.read_recording, the summary appended when present).

    Args:
        header: the recording's Header.
        events: its typed events in file order.
        summary: its Summary, or None (cut recording).
        speed: run-clock seconds played per real second.
        start_paused: begin paused (tests, or to seek before playing).
    """

    kind = "replay"
    LIVE_ACTIONS = frozenset({"seek", "rate", "step"})

    def __init__(self, header, events: list, summary=None, *, speed: float = 1.0,
                 start_paused: bool = False) -> None:
        super().__init__()
        self.header = header
        self.events = list(events) + ([summary] if summary else [])
        # event times made monotone (an arrival may carry an earlier t than the step before it)
        self.times: list[float] = []
        latest = 0.0
        for event in self.events:
            t = getattr(event, "t", None)
            latest = max(latest, float(t)) if isinstance(t, (int, float)) else latest
            self.times.append(latest)
        self.speed = min(max(speed, MIN_SPEED), MAX_SPEED)
        self.paused = start_paused
        self.start_t = min(self.times[0], 0.0) if self.times else 0.0
        self.end_t = self.times[-1] if self.times else 0.0
        self._rebuild(self.start_t)
        self._tick_at: float | None = None
        self._changed = False  # events applied since the last snapshot went out

    @classmethod
    def from_file(cls, path, **kwargs) -> ReplaySource:
        """Read a recording (kvtui.record.RecordingError when it cannot be read)."""
        from kvtui.record import read_recording

        header, events, summary, _ = read_recording(path)
        return cls(header, events, summary, **kwargs)

    @property
    def at_end(self) -> bool:
        return self.index >= len(self.events)

    def mode(self) -> str:
        if self.at_end:
            return "END"
        speed = f"x{self.speed:g}"
        return f"PAUSED {speed}" if self.paused else f"REPLAY {speed}"

    def _rebuild(self, t: float) -> None:
        self.state = DashboardState()
        self.state.apply(self.header)
        self.index = 0
        self.playhead = self.start_t
        self._advance_to(t)

    def _advance_to(self, t: float) -> bool:
        """Apply every event up to run-clock time `t`; returns whether any was applied."""
        start = self.index
        while self.index < len(self.events) and self.times[self.index] <= t:
            self.state.apply(self.events[self.index])
            self.index += 1
        self.playhead = max(self.playhead, min(t, self.end_t))
        return self.index != start

    # -- timer ------------------------------------------------------------------------------------
    def attach(self, app: App) -> bool:
        if not super().attach(app):
            return False
        app.set_interval(TICK_S, self._tick, name="replay")
        self.publish(build_snapshot(self.state), force=True)
        return True

    def _tick(self) -> None:
        now = time.monotonic()
        dt = 0.0 if self._tick_at is None else now - self._tick_at
        self._tick_at = now
        if self.paused or self.at_end:
            return
        self._changed |= self._advance_to(self.playhead + dt * self.speed)
        if self._changed and (self.at_end or self.publish_due()):
            self._changed = not self.publish(build_snapshot(self.state), force=self.at_end)

    # -- controls ---------------------------------------------------------------------------------
    def toggle_pause(self) -> None:
        self.paused = not self.paused
        self._tick_at = None
        self.publish(build_snapshot(self.state), force=True)

    def step(self) -> None:
        """Apply events up to and including the next step event."""
        while self.index < len(self.events):
            event = self.events[self.index]
            self._advance_to(self.times[self.index])
            if isinstance(event, StepEvent):
                break
        self.publish(build_snapshot(self.state), force=True)

    def seek(self, delta_s: float) -> None:
        """Move the playhead by `delta_s` seconds of run clock (back: rebuild from the start)."""
        target = min(max(self.playhead + delta_s, self.start_t), self.end_t)
        if target < self.playhead:
            self._rebuild(target)
        else:
            self._advance_to(target)
        self.publish(build_snapshot(self.state), force=True)

    def seek_to(self, t: float) -> None:
        """Jump to run-clock time `t` (seconds)."""
        self.seek(t - self.playhead)

    def scale_rate(self, factor: float) -> None:
        """Playback speed x factor."""
        self.speed = min(max(self.speed * factor, MIN_SPEED), MAX_SPEED)
        self.publish(build_snapshot(self.state), force=True)
