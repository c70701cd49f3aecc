"""Textual widgets: each holds the latest Snapshot in a reactive and draws it with a pure function
from kvtui.tui.panels at its current size."""

from __future__ import annotations

from rich.console import RenderableType
from textual.reactive import reactive
from textual.widget import Widget

from kvtui.tui import lane_panel, map_panel, panels
from kvtui.tui.snapshot import Snapshot


class Shows:
    """Mixin: `show(snapshot)` sets the `snapshot` reactive (which redraws) only when `key(snapshot)`
    changed, so a panel whose content is the same is not drawn again."""

    _shown_key: object = object()

    def key(self, snapshot: Snapshot) -> object:
        """What the panel shows depends on; default: the event count."""
        return snapshot.seq

    def show(self, snapshot: Snapshot) -> None:
        key = self.key(snapshot)
        if key != self._shown_key:
            self._shown_key = key
            self.snapshot = snapshot


class Panel(Shows, Widget):
    """A bordered panel redrawn whenever `snapshot` is set (identity compare: every snapshot is new)."""

    snapshot: reactive[Snapshot | None] = reactive(None, layout=False)
    TITLE = ""
    EMPTY = "waiting for the first events…"

    def on_mount(self) -> None:
        self.border_title = self.TITLE

    def render(self) -> RenderableType:
        if self.snapshot is None:
            return self.EMPTY
        size = self.content_size
        return self.draw(self.snapshot, size.width, size.height)

    def draw(self, snapshot: Snapshot, width: int, height: int) -> RenderableType:
        raise NotImplementedError


class HeaderBar(Shows, Widget):
    """The top line: scenario, model, clock, step, elapsed, source mode, isolation state."""

    snapshot: reactive[Snapshot | None] = reactive(None, layout=False)
    mode: reactive[str] = reactive("LIVE", layout=False)

    def render(self) -> RenderableType:
        return panels.header(self.snapshot, self.mode, self.content_size.width)


class SlotMap(Panel):
    """The slot map, or with paged KV the block map."""

    TITLE = "slots"

    def draw(self, snapshot, width, height):
        if snapshot.kv == "paged":
            self.border_title = "KV blocks"
            return panels.block_map(snapshot, width, height)
        return panels.slot_map(snapshot, width, height)


class RequestTable(Panel):
    TITLE = "requests"

    def draw(self, snapshot, width, height):
        return panels.request_table(snapshot, width, height)


class BlockMapPanel(Panel):
    """The block map (key `m`, in place of the request table): whose KV is where (kvtui/tui/map_panel.py)."""

    TITLE = "block map"

    def draw(self, snapshot, width, height):
        return map_panel.kv_map(snapshot, width, height)


class TimelinePanel(Panel):
    """Per-request timelines (key `t`, in place of the request table; kvtui/tui/lane_panel.py)."""

    TITLE = "timelines (steps →)"

    def draw(self, snapshot, width, height):
        return lane_panel.timelines(snapshot, width, height)


class StatsPanel(Panel):
    TITLE = "throughput · padding · KV · latency"

    def draw(self, snapshot, width, height):
        return panels.stats(snapshot, width, height)


class ContaminationPanel(Panel):
    TITLE = "contamination"

    def key(self, snapshot):
        return panels.contamination_inputs(snapshot)

    def draw(self, snapshot, width, height):
        return panels.contamination(snapshot, width, height)


class EventLog(Panel):
    TITLE = "events"

    def key(self, snapshot):
        return (snapshot.log[-1].seq, snapshot.log[-1].text) if snapshot.log else None

    def draw(self, snapshot, width, height):
        return panels.event_log(snapshot, width, height)


PANELS = (HeaderBar, SlotMap, RequestTable, BlockMapPanel, TimelinePanel, StatsPanel, ContaminationPanel, EventLog)
