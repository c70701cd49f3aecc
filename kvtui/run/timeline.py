"""A local run's timeline: the scenario's `timeline` events (kvtui/scenario/timeline.py), applied when the
engine clock reaches their time, at the start of a step.

An event may set engine knobs (Engine.reconfigure), switch a fault, reload a LoRA adapter, change the
arrival rate (through kvtui/run/controls.py, as the dashboard's keys do) and put a marker in the
recording. Events the run ends before are named at its close.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtui.events import Marker, TimelineApplied
from kvtui.run.controls import Controls
from kvtui.run.engine_setup import reload_adapter


class Timeline:
    """The timeline events not yet applied, in time order.

    Args:
        items: the scenario's timeline (TimelineEvent, sorted by at_s).
        controls: the run's Controls (fault switches, arrival rate).
        adapters: the run's AdapterRegistry (for `lora.reload`).
        emit: where the events go (the Session's emit).
        base_rate_per_s: the scenario's arrivals.rate_per_s (None for processes without one: a rate change
            is then ignored).
        fault_switches: False ignores the fault switches (a run "with the fault removed").
    """

    def __init__(self, items, controls: Controls, adapters, emit: Callable[[object], None], *,
                 base_rate_per_s: float | None, fault_switches: bool = True) -> None:
        self.items = list(items)
        self.controls, self.adapters, self.emit = controls, adapters, emit
        self.base_rate_per_s, self.fault_switches = base_rate_per_s, fault_switches

    def apply_due(self) -> None:
        """Apply every event whose time has come on the engine clock (engine knobs, faults, adapter
        reloads, arrival rate, markers), each announced by a `timeline` event first."""
        engine = self.controls.engine
        now = engine.now()
        while self.items and self.items[0].at_s <= now:
            item = self.items.pop(0)
            self.emit(TimelineApplied(t=now, at_s=item.at_s, set=dict(item.set), marker=item.marker))
            if item.engine_overrides():
                engine.reconfigure(**item.engine_overrides())
            if item.fault_switch and self.fault_switches:
                self.controls.set_fault(*item.fault_switch, source="timeline")
            if item.lora_reload:
                reload_adapter(self.adapters, item.lora_reload)
            rate = item.arrival_changes().get("rate_per_s")
            if rate and self.base_rate_per_s:
                self.controls.scale_arrival_rate(rate / self.base_rate_per_s)
            if item.marker:
                self.emit(Marker(t=now, text=item.marker))

    def unapplied(self, stopped: bool) -> list:
        """At the run's close: the events it ended before (for the CLI's warning), and a marker naming
        them unless the run was stopped."""
        if self.items and not stopped:
            at = ", ".join(f"{e.at_s:g} s" for e in self.items[:5])
            self.emit(Marker(t=self.controls.engine.now(), text=f"timeline events after the run's end were not "
                                                                 f"applied (at {at})"))
        return list(self.items)
