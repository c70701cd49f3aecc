"""KvtuiApp: the dashboard. It lays out the panels, maps keys to source controls, and on every
SnapshotReady message hands the snapshot to the panels (each redraws itself). It never runs the
engine: a LiveSource steps the session in a thread worker, a ReplaySource plays a recording."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer

from kvtui.faults import FAULT_NAMES, acts_on, fault_misfit
from kvtui.model_kinds import ModelKind
from kvtui.tui.screens import FaultPicker, HelpScreen
from kvtui.tui.snapshot import Snapshot
from kvtui.tui.sources import MIN_HZ, PUBLISH_HZ, UI_CPU_SHARE, SnapshotReady, Source
from kvtui.tui.widgets import (
    PANELS,
    BlockMapPanel,
    ContaminationPanel,
    EventLog,
    HeaderBar,
    RequestTable,
    SlotMap,
    StatsPanel,
    TimelinePanel,
)

RATE_FACTOR = 1.25  # + / - multiply / divide the arrival rate (replay: the playback speed) by this
BURST_SIZE = 4  # requests moved to "now" by b
SEEK_S = 5.0  # replay seek step (seconds of run clock)

RATE_GROUP = Binding.Group("rate", compact=True)  # the footer shows "+- rate"
SEEK_GROUP = Binding.Group("seek 5s", compact=True)
FOOTER_PALETTE_MIN_WIDTH = 120  # narrower, the footer leaves out "^p palette" so `? help` and `q quit` fit

# action -> what the source must support (Source.supports); others always apply
NEEDS = {"isolation": "isolation", "faults": "faults", "rate_up": "rate", "rate_down": "rate", "burst": "burst",
         "restart": "restart", "step": "step", "seek_back": "seek", "seek_forward": "seek"}


class KvtuiApp(App[dict | None]):
    """The dashboard on a LiveSource or a ReplaySource. `app.run()` returns the live summary (or None).

    Args:
        source: where events come from.
        screenshot_dir: where `s` saves SVG screenshots (default runs/, which git ignores).
    """

    CSS_PATH = Path(__file__).with_name("kvtui.tcss")  # absolute: subclasses elsewhere find it too
    TITLE = "kvtui"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (130, "-wide")]
    BINDINGS = [
        Binding("i", "isolation", "isolation", tooltip="switch the configured fault set on/off"),
        Binding("f", "faults", "faults", tooltip="pick faults from a list"),
        Binding("space", "pause", "pause", tooltip="pause / resume"),
        Binding("n", "step", "step", tooltip="one engine step while paused"),
        Binding("plus,equals_sign", "rate_up", "rate+", key_display="+", tooltip="arrival rate x1.25 (replay: speed)",
                group=RATE_GROUP),
        Binding("minus", "rate_down", "rate-", key_display="-", tooltip="arrival rate ÷1.25 (replay: speed)",
                group=RATE_GROUP),
        Binding("left", "seek_back", "-5s", tooltip="replay: seek back", group=SEEK_GROUP),
        Binding("right", "seek_forward", "+5s", tooltip="replay: seek forward", group=SEEK_GROUP),
        Binding("b", "burst", "burst", tooltip=f"{BURST_SIZE} requests arrive now"),
        Binding("r", "restart", "restart", tooltip="restart the scenario with a fresh session"),
        Binding("s", "screenshot", "svg", tooltip="save an SVG screenshot under runs/"),
        Binding("m", "block_map", "map", tooltip="the block map in place of the requests: whose KV is where",
                show=False),
        Binding("t", "timelines", "timelines", tooltip="per-request timelines in place of the requests",
                show=False),
        Binding("question_mark", "help", "help", key_display="?"),
        Binding("q", "quit", "quit", tooltip="quit (live: writes the summary to the recording)"),
    ]

    def __init__(self, source: Source, *, screenshot_dir: str | Path = "runs") -> None:
        super().__init__()
        self.source = source
        self.screenshot_dir = Path(screenshot_dir)
        self.snapshot: Snapshot | None = None
        self.frames = 0  # snapshots shown (tests and measurements)
        self.frame_cost_s: float | None = None  # measured UI-thread CPU per snapshot (seconds)
        self._pace_mark: tuple[float, float, int] | None = None
        self._quitting = False

    def compose(self) -> ComposeResult:
        yield HeaderBar(id="header")
        with Horizontal(id="top"):
            yield SlotMap(id="slots")
            yield StatsPanel(id="stats")
        with Horizontal(id="bottom"):
            yield RequestTable(id="requests")
            yield BlockMapPanel(id="blockmap")
            yield TimelinePanel(id="timelines")
            with Vertical(id="side"):
                yield ContaminationPanel(id="contamination")
                yield EventLog(id="log")
        yield Footer()

    def on_mount(self) -> None:
        self._fit_footer()
        self.query_one(HeaderBar).mode = self.source.mode()  # LOADING at once, before the source's first snapshot
        self.source.attach(self)

    def on_resize(self) -> None:
        self._fit_footer()

    def _fit_footer(self) -> None:
        """On a narrow terminal the footer leaves out the command palette's key (ctrl+p still opens it),
        so that at 100 columns every key, `? help` and `q quit` last, stays on screen."""
        for footer in self.query(Footer):
            footer.show_command_palette = self.size.width >= FOOTER_PALETTE_MIN_WIDTH

    def on_unmount(self) -> None:
        self.source.request_stop()

    def on_snapshot_ready(self, message: SnapshotReady) -> None:
        """Hand the newest snapshot to every panel (older unprocessed ones were replaced); each
        redraws only if what it shows changed. Then adjust the frame rate to the drawing cost."""
        self.snapshot = message.snapshot
        self.frames += 1
        for header in self.query(HeaderBar):  # none while the app closes (a last snapshot may still arrive)
            header.mode = message.mode
        for widget in self.query("HeaderBar, Panel"):
            widget.show(message.snapshot)
        for screen in self.screen_stack:  # text derived from the run's header follows it (LOADING -> the run)
            if isinstance(screen, HelpScreen):
                screen.show_faults(message.snapshot.isolation_faults)
        self._pace()

    def _pace(self) -> None:
        """Once a second: UI-thread CPU per frame -> the source's minimum interval between
        snapshots, so drawing stays within UI_CPU_SHARE of a core (between MIN_HZ and PUBLISH_HZ)."""
        now, cpu = time.monotonic(), time.thread_time()
        if self._pace_mark is None:
            self._pace_mark = (now, cpu, self.frames)
            return
        t0, cpu0, frames0 = self._pace_mark
        if now - t0 >= 1.0 and self.frames > frames0:
            self.frame_cost_s = (cpu - cpu0) / (self.frames - frames0)
            self.source.min_interval_s = min(max(self.frame_cost_s / UI_CPU_SHARE, 1.0 / PUBLISH_HZ), 1.0 / MIN_HZ)
            self._pace_mark = (now, cpu, self.frames)

    # -- keys -------------------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if isinstance(self.screen, ModalScreen) and action not in ("quit",):
            return False  # keys typed in the fault picker / help belong to them
        return self._available(action)

    def _available(self, action: str) -> bool | None:
        """True: applies to this source; False: hidden. A key that applies but cannot act now says why
        when pressed (`_refused`) rather than doing nothing."""
        need = NEEDS.get(action)
        if need is not None and not self.source.supports(need):
            return False
        return True

    def _refused(self, action: str) -> bool:
        """Say why `action` cannot act now (a warning); True when it cannot."""
        why = self.source.refusal(action)
        if why:
            self.notify(why, severity="warning")
        return why is not None

    def _isolation_faults(self) -> tuple[str, ...]:
        """The set `i` switches, from the run's header; empty before it arrives (the model is loading)."""
        return self.snapshot.isolation_faults if self.snapshot else ()

    def _active_faults(self) -> set[str]:
        return set(self.snapshot.active_faults) if self.snapshot else set()

    def action_isolation(self) -> None:
        """Isolation OFF -> turn every fault off; ON -> switch the configured set on."""
        if self._refused("isolation"):
            return
        if self._active_faults():
            self.source.set_faults(set())
            self.notify("isolation ON: all faults off")
        else:
            faults = self._isolation_faults()
            if not faults:  # the run started a moment ago and its header has not been drawn yet
                self.notify("the run's fault set is not known yet; press i again in a moment", severity="warning")
                return
            self.source.set_faults(set(faults))
            self.notify(f"isolation OFF: {', '.join(faults)}", severity="warning")

    def action_faults(self) -> None:
        def chosen(names: set[str] | None) -> None:
            if names is None:
                return
            why = self.source.refusal("faults")  # the run may have ended while the picker was open
            if why:
                self.notify(f"not applied: {why}", severity="warning")
                return
            self.source.set_faults(names)
            self.notify(f"faults on: {', '.join(sorted(names))}" if names else "isolation ON: all faults off",
                        severity="warning" if names else "information")

        if self._refused("faults"):
            return
        self.push_screen(FaultPicker(self._active_faults(), *self._fault_choices()), chosen)

    def _fault_choices(self) -> tuple[tuple[str, ...], dict[str, str]]:
        """The faults the picker lists (those acting on the run's kind of model, the header's) and, for each
        that cannot act in the run's layout, KV mode or prefix cache, why (kvtui.faults.fault_misfit)."""
        snap = self.snapshot
        kind = snap.model_kind if snap else None
        if kind is None:  # a recording made before the header named the kind: a speech model has an encoder cache
            kind = ModelKind.ENCODER_DECODER if snap is not None and snap.encoder is not None else ModelKind.DECODER_ONLY
        names = tuple(name for name in FAULT_NAMES if acts_on(name, kind))
        if snap is None:
            return names, {}
        misfits = {name: why for name in names
                   if (why := fault_misfit(name, snap.layout, snap.kv, snap.prefix_caching))}
        return names, misfits

    def action_pause(self) -> None:
        if self._refused("pause"):
            return
        self.source.toggle_pause()
        self.query_one(HeaderBar).mode = self.source.mode()  # at once, before the worker's next snapshot
        self.refresh_bindings()

    def action_step(self) -> None:
        if self._refused("step"):
            return
        if not self.source.paused:
            self.notify("n takes one step while paused: space pauses first", severity="warning")
            return
        self.source.step()

    def action_rate_up(self) -> None:
        if not self._refused("rate_up"):
            self.source.scale_rate(RATE_FACTOR)

    def action_rate_down(self) -> None:
        if not self._refused("rate_down"):
            self.source.scale_rate(1 / RATE_FACTOR)

    def action_seek_back(self) -> None:
        self.source.seek(-SEEK_S)

    def action_seek_forward(self) -> None:
        self.source.seek(SEEK_S)

    def action_burst(self) -> None:
        if not self._refused("burst"):
            self.source.burst(BURST_SIZE)

    def action_restart(self) -> None:
        if self._refused("restart"):
            return
        self.source.restart()
        picked = getattr(self.source, "picked", None)
        if picked is None:
            self.notify("restarting the scenario")
        else:
            self.notify(f"restarting the scenario with the faults picked by key: {', '.join(sorted(picked)) or 'none'}")

    def action_screenshot(self) -> str:
        """Save an SVG of the screen under screenshot_dir; returns its path."""
        self.screenshot_dir.mkdir(parents=True, exist_ok=True)
        name = (self.snapshot.scenario if self.snapshot else "kvtui") + time.strftime("-%Y%m%d-%H%M%S.svg")
        path = self.save_screenshot(name, path=str(self.screenshot_dir))
        self.notify(f"saved {path}")
        return path

    def action_block_map(self) -> None:
        """The block map in place of the request table (or of the timelines), or the request table back."""
        self._swap(BlockMapPanel)

    def action_timelines(self) -> None:
        """The per-request timelines in place of the request table (or of the block map), or the table back."""
        self._swap(TimelinePanel)

    def _swap(self, panel: type) -> None:
        """Show `panel` in the request table's place, or the table again when `panel` is showing."""
        back = self.query_one(panel).display
        for kind in (RequestTable, BlockMapPanel, TimelinePanel):
            self.query_one(kind).display = kind is (RequestTable if back else panel)

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self._isolation_faults()))

    def action_quit(self) -> None:
        """Stop the source (live: the worker closes the session, writing the summary), then exit.
        The wait runs in an async worker, so the app keeps drawing (CLOSING) meanwhile."""
        if self._quitting:
            return
        self._quitting = True
        self.notify("closing the session…")
        self.run_worker(self._stop_and_exit(), group="quit", exit_on_error=False)

    async def _stop_and_exit(self) -> None:
        try:
            summary = await self.source.stop()
        finally:
            self._quitting = False
        self.exit(summary)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for binding in self.BINDINGS:
            if binding.action in ("quit",) or not self._available(binding.action):
                continue
            yield SystemCommand(f"kvtui: {binding.description}", binding.tooltip or binding.description,
                                getattr(self, f"action_{binding.action}"))


__all__ = ["KvtuiApp", "PANELS", "screen_text"]


def screen_text(app: App) -> str:
    """The current screen as plain text, one line per row (tests, and NO_COLOR-proof checks)."""
    import io

    from rich.console import Console

    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), record=True, color_system=None,
                      legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text(styles=False)
