"""Where the dashboard's events come from: a live Session (LiveSource) or a recording (ReplaySource).

The app talks to either through the same small interface (the adapter idea of harlequin): it asks
for pause/step/quit and, where `supports()` says so, live controls or seeking; the source posts
`SnapshotReady` messages to the app. A source never touches a widget.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from textual.message import Message

from kvtui.tui.snapshot import Snapshot

if TYPE_CHECKING:
    from textual.app import App

PUBLISH_HZ = 20.0  # most snapshots per second sent to the UI
MIN_HZ = 4.0  # fewest snapshots per second while anything changes
# Share of one core the UI thread may spend drawing (seconds of UI CPU per second). The app measures
# its cost per frame and lowers the frame rate to stay within it: a frame of the full 160x45 screen
# costs about 20 ms of Python, and every millisecond of it is GIL time the engine thread waits for.
UI_CPU_SHARE = 0.15


class SnapshotReady(Message):
    """A new snapshot for the panels. A newer one replaces an older one still in the app's queue, so
    a busy UI skips frames instead of falling behind.

    Attributes:
        snapshot: the frozen state.
        mode: the source's state in words for the header (LIVE, PAUSED, DONE, REPLAY x2, END...).
    """

    def __init__(self, snapshot: Snapshot, mode: str) -> None:
        super().__init__()
        self.snapshot = snapshot
        self.mode = mode

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, SnapshotReady)


class Source:
    """The interface the app uses. Subclasses: LiveSource, ReplaySource."""

    kind = "none"
    LIVE_ACTIONS: frozenset[str] = frozenset()

    def __init__(self) -> None:
        self.app: App | None = None
        self.paused = False
        self._last_publish = 0.0
        self.min_interval_s = 1.0 / PUBLISH_HZ  # set by the app from its measured drawing cost

    def supports(self, action: str) -> bool:
        """Whether an app action (e.g. "faults", "seek") applies to this source."""
        return action in self.LIVE_ACTIONS

    def attach(self, app: App) -> bool:
        """Start producing snapshots for `app` (called once the app is mounted). Returns False, and
        does nothing, when already attached (a second engine worker would race the first)."""
        if self.app is not None:
            return False
        self.app = app
        return True

    def mode(self) -> str:
        return "PAUSED" if self.paused else self.kind.upper()

    def refusal(self, action: str) -> str | None:
        """Why the app action `action` (e.g. "faults", "burst", "pause") cannot act now, in one line for
        the user; None when it can. The base source refuses nothing."""
        return None

    def publish_due(self) -> bool:
        """Whether min_interval_s has passed since the last snapshot went out."""
        return time.monotonic() - self._last_publish >= self.min_interval_s

    def publish(self, snapshot: Snapshot, *, force: bool = False) -> bool:
        """Post a snapshot to the app unless one went out less than min_interval_s ago (or `force`:
        user actions and state changes that must show at once). Returns whether it was posted."""
        now = time.monotonic()
        if self.app is None or (not force and now - self._last_publish < self.min_interval_s):
            return False
        self._last_publish = now
        self.app.post_message(SnapshotReady(snapshot, self.mode()))
        return True

    # controls; each returns a short message for the user, or None
    def toggle_pause(self) -> None:
        self.paused = not self.paused

    def step(self) -> None:
        """Advance by one engine step (while paused)."""

    def set_faults(self, names: set[str], source: str = "key") -> None:
        raise NotImplementedError

    def scale_rate(self, factor: float) -> None:
        """Live: arrival rate x factor; replay: playback speed x factor."""

    def burst(self, count: int) -> None:
        raise NotImplementedError

    def restart(self) -> None:
        raise NotImplementedError

    def seek(self, delta_s: float) -> None:
        raise NotImplementedError

    def request_stop(self) -> None:
        """Ask the source to stop producing (any thread; returns at once)."""

    async def stop(self) -> dict | None:
        """Stop producing; live: close the session (summary written). Returns the summary."""
        return None
