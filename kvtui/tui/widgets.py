"""Textual widgets: each holds the latest Snapshot in a reactive and draws it with a pure function
from kvtui.tui.panels at its current size."""

from __future__ import annotations

from rich.console import RenderableType
from textual.reactive import reactive
from textual.widget import Widget

from kvtui.tui import panels
from kvtui.tui.snapshot import Snapshot


class Panel(Widget):
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


class HeaderBar(Widget):
    """The top line: scenario, model, clock, step, elapsed, source mode, isolation state."""

    snapshot: reactive[Snapshot | None] = reactive(None, layout=False)
    mode: reactive[str] = reactive("LIVE", layout=False)

    def render(self) -> RenderableType:
        return panels.header(self.snapshot, self.mode, self.content_size.width)


class SlotMap(Panel):
    TITLE = "slots"

    def draw(self, snapshot, width, height):
        return panels.slot_map(snapshot, width, height)


class RequestTable(Panel):
    TITLE = "requests"

    def draw(self, snapshot, width, height):
        return panels.request_table(snapshot, width, height)


class StatsPanel(Panel):
    TITLE = "throughput · padding · KV · latency"

    def draw(self, snapshot, width, height):
        return panels.stats(snapshot, width, height)


class ContaminationPanel(Panel):
    TITLE = "contamination"

    def draw(self, snapshot, width, height):
        return panels.contamination(snapshot, width, height)


class EventLog(Panel):
    TITLE = "events"

    def draw(self, snapshot, width, height):
        return panels.event_log(snapshot, width, height)


PANELS = (HeaderBar, SlotMap, RequestTable, StatsPanel, ContaminationPanel, EventLog)
