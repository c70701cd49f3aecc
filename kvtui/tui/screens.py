"""Modal screens: the fault picker (`f`) and the help screen (`?`)."""

from __future__ import annotations

from rich.markup import escape
from rich.segment import Segment
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
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
    """A list of faults with their one-line descriptions; returns the chosen set (None: cancel). A fault in
    `misfits` cannot act in the run (its layout, KV mode or prefix cache): it is marked ✗ with the reason
    and refused when ticked, so the picker never confirms a fault that would never fire.

    Args:
        active: the faults on now; names: the faults to list, in order; misfits: name -> why it cannot act.
    """

    BINDINGS = [Binding("escape,q", "cancel", "cancel"), Binding("enter", "apply", "apply", priority=True)]

    def __init__(self, active: set[str], names: tuple[str, ...], misfits: dict[str, str] | None = None) -> None:
        super().__init__()
        self.active = set(active)
        self.names = names
        self.misfits = dict(misfits or {})
        self.refused = ""  # why the last fault ticked was refused, shown under the list until the next change

    def compose(self) -> ComposeResult:
        with Vertical(id="picker"):
            yield Static("[b]Faults[/b]  space toggles · enter applies · esc cancels"
                         + ("  ·  ✗ cannot act in this run" if self.misfits else ""), id="picker-title")
            yield CheckList(*(Selection(self._label(name), name, name in self.active) for name in self.names),
                            id="fault-list")
            yield Static(id="picker-choice")
            yield Button("apply", id="apply", variant="primary")
        yield Footer()

    def _label(self, name: str) -> Text:
        why = self.misfits.get(name)
        if why is None:
            return Text(f"{name:<24} {FAULTS[name].breaks if name in FAULTS else ''}")
        return Text(f"{name:<24} ✗ {why.removeprefix(f'fault {name} ')}", style="dim")

    def on_mount(self) -> None:
        self.query_one(CheckList).focus()
        self._show_choice()

    def on_selection_list_selected_changed(self, event: SelectionList.SelectedChanged) -> None:
        checks = self.query_one(CheckList)
        misfit = next((name for name in checks.selected if name in self.misfits), None)
        if misfit is not None:
            self.refused = f"{misfit} is not applied: {self.misfits[misfit]}, so it would never fire"
            checks.deselect(misfit)  # (changes the selection again: this runs once more, with none left)
            return
        self._show_choice()
        self.refused = ""

    def _show_choice(self) -> None:
        """The chosen set in words, under the list (or why the last fault ticked was refused)."""
        chosen = [n for n in self.names if n in self.query_one(CheckList).selected]
        text = f"on after apply: {', '.join(chosen)}" if chosen else "on after apply: none (isolation ON)"
        self.query_one("#picker-choice", Static).update(f"[b]{escape(self.refused)}[/b]\n{text}" if self.refused
                                                        else text)

    def action_cancel(self) -> None:
        self.dismiss(None)

    def action_apply(self) -> None:
        self.dismiss({name for name in self.query_one(CheckList).selected if name not in self.misfits})

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.action_apply()


HELP = """\
[b]kvtui dashboard[/b]   ↑ ↓ PgUp PgDn scroll · esc or ? closes
[b]Panels[/b]
  header         scenario · model · clock · step · elapsed (paced clock: "0.6x real
                 time" when behind); LIVE, PAUSED (space), LOADING while the model
                 loads, CLOSING while the last reference checks run, DONE at the
                 end; isolation ON, or OFF with the active faults; LEAKS n: findings
                 of data crossing between requests or tenants
  slots          one cell per KV slot: owner, cache fill, cached tokens; ↻ = reused
  requests       id, status, slot, cache, prompt/generated tokens, TTFT, text tail;
                 status LEAK←source: another request's passphrase in its answer;
                 TAINT: a detector found another request's data in it (victim ←
                 source in contamination); TENANT: another tenant's; CORRUPT: its
                 own state damaged, no other request to name
  throughput…    prefill/decode tokens/s with history, padding ratio (query, key),
                 KV usage, running/waiting, TTFT and TPOT p50/p95
  contamination  detector counts, attention on other requests' keys, latest reports
                 (victim ← source)
  events         timeline markers, fault switches, rejections, errors
  block map (m)  in place of the requests: one cell per KV block (or slot), coloured
                 by tenant: ! a fault acted there, * a detector fired, a digit =
                 shared by that many, ░ cached free, · free; then one line per
                 owner: tenant, adapter, age, last reuse, fault / detector there
  timelines (t)  in place of the requests: one line per request: queue, prefill
                 chunks, decode steps, preemptions, faults, findings

[b]Keys[/b] (also in the command palette, ctrl+p)
  i        isolation on/off (switches the scenario's fault set{faults})
  f        pick faults from a list (✗: cannot act in this run's layout or KV mode)
  space    pause / resume            n    one step while paused
  + / -    arrival rate x1.25 / ÷1.25 (replay: playback speed)
  ← / →    replay: seek 5 s back / forward
  b        a burst of requests       r    restart the scenario (keeps the faults
                                          picked with f or i)
  s        SVG screenshot in runs/   m    block map: whose KV is where
  t        per-request timelines (steps; replay: scrub with ← / → and n)
  ?        this help                 q    quit (live: the recording gets its summary)
While the model loads, and once the run is CLOSING or DONE, a key that would change
the run says why it cannot act instead; r restarts a run that has ended, q quits.
"""


def help_text(isolation_faults: tuple[str, ...]) -> str:
    """The help screen's text for a run whose `i` key switches `isolation_faults` (empty: the run's header has
    not arrived yet, so the set is not known; the model is still loading)."""
    faults = f": {', '.join(isolation_faults)}" if isolation_faults else ", shown once loaded"
    return HELP.format(faults=faults)


class HelpScreen(ModalScreen[None]):
    """What the panels show and what the keys do, in a box that scrolls where the terminal is short. Its
    text follows the run's header: the app calls `show_faults` with each snapshot's fault set, so a help
    opened while the model loads names the run's set once the header arrives."""

    # `q` quits from here too, as the text lists it: closing the help first made a user press it twice
    BINDINGS = [Binding("escape,question_mark", "close", "close"), Binding("q", "app.quit", "quit")]

    def __init__(self, isolation_faults: tuple[str, ...]) -> None:
        super().__init__()
        self.isolation_faults = isolation_faults

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Static(help_text(self.isolation_faults), id="help-text")

    def show_faults(self, isolation_faults: tuple[str, ...]) -> None:
        """Redraw the text for the set `i` switches now (a no-op when it is unchanged)."""
        if isolation_faults == self.isolation_faults:
            return
        self.isolation_faults = isolation_faults
        if self.is_mounted:
            self.query_one("#help-text", Static).update(help_text(isolation_faults))

    def on_mount(self) -> None:
        self.query_one("#help", VerticalScroll).focus()  # the arrow keys and PgUp/PgDn scroll it

    def action_close(self) -> None:
        self.dismiss(None)
