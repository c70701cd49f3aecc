"""Modal screens: the fault picker (`f`) and the help screen (`?`)."""

from __future__ import annotations

from rich.segment import Segment
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.strip import Strip
from textual.widgets import Button, Checkbox, Footer, SelectionList, Static
from textual.widgets.option_list import OptionDoesNotExist
from textual.widgets.selection_list import Selection

from kvtui.faults import FAULTS


class CheckList(SelectionList[str]):
    """A SelectionList whose check boxes read `[x]` and `[ ]`: Textual's differ by colour alone, which
    NO_COLOR (or a monochrome screenshot) removes."""

    BOX = Checkbox.BUTTON_LEFT + Checkbox.BUTTON_INNER + Checkbox.BUTTON_RIGHT  # the box SelectionList draws

    def render_line(self, y: int) -> Strip:
        strip = super().render_line(y)
        try:
            option = self.get_option_at_index(self.scroll_offset.y + y)
        except OptionDoesNotExist:
            return strip
        segments = list(strip)
        if len(segments) < 3 or "".join(seg.text for seg in segments[:3]) != self.BOX:
            return strip
        mark = "[x]" if option.value in self.selected else "[ ]"
        return Strip([Segment(mark, segments[1].style), *segments[3:]], strip.cell_length)


class FaultPicker(ModalScreen[set[str] | None]):
    """A list of every fault with its one-line description; returns the chosen set (None: cancel)."""

    BINDINGS = [Binding("escape,q", "cancel", "cancel"), Binding("enter", "apply", "apply", priority=True)]

    def __init__(self, active: set[str], names: tuple[str, ...]) -> None:
        super().__init__()
        self.active = set(active)
        self.names = names

    def compose(self) -> ComposeResult:
        with Vertical(id="picker"):
            yield Static("[b]Faults[/b]  space toggles · enter applies · esc cancels", id="picker-title")
            yield CheckList(
                *(Selection(f"{name:<24} {FAULTS[name].breaks if name in FAULTS else ''}", name, name in self.active)
                  for name in self.names),
                id="fault-list",
            )
            yield Static(id="picker-choice")
            yield Button("apply", id="apply", variant="primary")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(CheckList).focus()
        self._show_choice()

    def on_selection_list_selected_changed(self, event: SelectionList.SelectedChanged) -> None:
        self._show_choice()

    def _show_choice(self) -> None:
        """The chosen set in words, under the list."""
        chosen = [n for n in self.names if n in self.query_one(CheckList).selected]
        self.query_one("#picker-choice", Static).update(
            f"on after apply: {', '.join(chosen)}" if chosen else "on after apply: none (isolation ON)")

    def action_cancel(self) -> None:
        self.dismiss(None)

    def action_apply(self) -> None:
        self.dismiss(set(self.query_one(CheckList).selected))

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.action_apply()


HELP = """\
[b]kvtui dashboard[/b]

[b]Panels[/b]
  header          scenario · model · clock · step · elapsed (paced clock: "0.6x real time" when behind);
                  isolation ON, or OFF with the active faults; CLOSING counts the last reference checks
  slots           one cell per KV slot: owner, cache fill, cached tokens; ↻ = reused in the last steps
  requests        id, status (LEAK←source when another request's passphrase shows up), slot, cache,
                  prompt/generated tokens, TTFT, text tail (leaked passphrase highlighted)
  throughput…     prefill/decode tokens/s with history, padding ratio (query, key), KV usage,
                  running/waiting, TTFT and TPOT p50/p95
  contamination   detector counts, attention on other requests' keys, latest reports (victim ← source)
  events          timeline markers, fault switches, rejections, errors

[b]Keys[/b] (also in the command palette, ctrl+p)
  i        isolation on/off (switches the scenario's fault set: {faults})
  f        pick faults from a list
  space    pause / resume          n   one step while paused
  + / -    arrival rate x1.25 / ÷1.25  (replay: playback speed)
  ← / →    replay: seek 5 s back / forward
  b        burst of requests       r   restart the scenario
  s        save an SVG screenshot under runs/
  ?        this help               q   quit (live: closes the recording with its summary)
"""


class HelpScreen(ModalScreen[None]):
    """What the panels show and what the keys do."""

    BINDINGS = [Binding("escape,question_mark,q", "close", "close")]

    def __init__(self, isolation_faults: tuple[str, ...]) -> None:
        super().__init__()
        self.isolation_faults = isolation_faults

    def compose(self) -> ComposeResult:
        yield Static(HELP.format(faults=", ".join(self.isolation_faults)), id="help")

    def action_close(self) -> None:
        self.dismiss(None)
