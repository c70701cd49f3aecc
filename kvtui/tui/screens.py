"""Modal screens: the fault picker (`f`) and the help screen (`?`)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Footer, SelectionList, Static
from textual.widgets.selection_list import Selection

from kvtui.faults import FAULTS


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
            yield SelectionList[str](
                *(Selection(f"{name:<24} {FAULTS[name].breaks if name in FAULTS else ''}", name, name in self.active)
                  for name in self.names),
                id="fault-list",
            )
            yield Static(id="picker-choice")
            yield Button("apply", id="apply", variant="primary")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(SelectionList).focus()
        self._show_choice()

    def on_selection_list_selected_changed(self, event: SelectionList.SelectedChanged) -> None:
        self._show_choice()

    def _show_choice(self) -> None:
        """The chosen set in words (the checkboxes differ only by colour, which NO_COLOR removes)."""
        chosen = [n for n in self.names if n in self.query_one(SelectionList).selected]
        self.query_one("#picker-choice", Static).update(
            f"on after apply: {', '.join(chosen)}" if chosen else "on after apply: none (isolation ON)")

    def action_cancel(self) -> None:
        self.dismiss(None)

    def action_apply(self) -> None:
        self.dismiss(set(self.query_one(SelectionList).selected))

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.action_apply()


HELP = """\
[b]kvtui dashboard[/b]

[b]Panels[/b]
  header          scenario · model · clock · step · elapsed; isolation ON, or OFF with the active faults
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
  s        save an SVG screenshot under recordings/
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
