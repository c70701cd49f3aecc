"""The live controls of a local run: switch a fault, scale the arrival rate, a burst of arrivals.

The dashboard's keys (kvtui/tui/live.py, in the engine thread between two steps) and the scenario's
timeline (kvtui/run/timeline.py) call them; each change is an event (`fault`, `marker`) in the
recording, so a replay shows it where it happened.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from kvtui.events import FaultSwitch, Marker
from kvtui.faults import check_fault_names


class Controls:
    """Changes to a running Session from outside the plan.

    Args:
        engine: the run's kvtui.engine.Engine (its faults and clock).
        pending: the run's planned requests not yet submitted, in arrival order: the Session's own list,
            changed in place.
        emit: where the events go (the Session's emit).

    Attributes:
        fault_history: (engine time in seconds, fault name, on) for the faults on at the start (time 0)
            and every switch since, in order (kvtui.run.outcome.RunOutcome's fault_history).
    """

    def __init__(self, engine, pending: list, emit: Callable[[object], None]) -> None:
        self.engine, self.pending, self.emit = engine, pending, emit
        self.fault_history: list[tuple[float, str, bool]] = [(0.0, n, True) for n in sorted(engine.faults)]

    def set_fault(self, name: str, on: bool, source: str = "key") -> None:
        """Switch one isolation fault on or off from the next step; emits a `fault` event (nothing when it
        already is so).

        Args:
            source: who switched it, recorded in the event: "key" (the dashboard) or "timeline".

        Raises:
            ValueError: unknown fault name.
        """
        check_fault_names([name])
        engine = self.engine
        if (name in engine.faults) == on:
            return
        engine.set_faults(engine.faults | {name} if on else engine.faults - {name})
        self.fault_history.append((engine.now(), name, on))
        self.emit(FaultSwitch(t=engine.now(), name=name, on=on, source=source, active=tuple(sorted(engine.faults))))

    def scale_arrival_rate(self, factor: float) -> None:
        """Multiply the arrival rate of requests not yet arrived by `factor`: their remaining wait from
        now is divided by it. Emits a marker.

        Raises:
            ValueError: `factor` <= 0.
        """
        if factor <= 0:
            raise ValueError(f"{factor = } must be > 0")
        now = self.engine.now()
        self.pending[:] = [replace(p, arrival_s=now + (p.arrival_s - now) / factor) if p.arrival_s > now else p
                           for p in self.pending]
        self.emit(Marker(t=now, text=f"arrival rate x{factor:g}"))

    def burst(self, count: int) -> int:
        """Make the next `count` pending requests arrive now; returns how many moved (a marker says so
        when any did)."""
        now = self.engine.now()
        moved = min(count, len(self.pending))
        self.pending[:moved] = [replace(p, arrival_s=min(p.arrival_s, now)) for p in self.pending[:moved]]
        if moved:
            self.emit(Marker(t=now, text=f"burst of {moved} requests"))
        return moved
