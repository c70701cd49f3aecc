"""Fault names as the dashboard shows them, and the set the `i` (isolation) key switches."""

from __future__ import annotations

from kvtui.engine.faults import DEFAULT_ISOLATION_OFF, FAULTS

# One line per fault for the fault picker (`f`) and the help screen (docs/faults.md).
FAULT_DESCRIPTIONS: dict[str, str] = {name: fault.breaks for name, fault in FAULTS.items()}

# What `i` switches on when the scenario names no faults of its own.
DEFAULT_ISOLATION_FAULTS: tuple[str, ...] = DEFAULT_ISOLATION_OFF


def isolation_fault_set(header: dict | None) -> tuple[str, ...]:
    """The faults `i` switches on: those the scenario starts with (engine.faults) or names in its
    timeline (`set: {fault: NAME}`), in that order; DEFAULT_ISOLATION_FAULTS when it names none.

    Args:
        header: the recording/session header event (or None).
    """
    names: list[str] = []
    header = header or {}
    for name in (header.get("engine") or {}).get("faults") or []:
        if name not in names:
            names.append(name)
    for entry in (header.get("scenario") or {}).get("timeline") or []:
        name = (entry.get("set") or {}).get("fault") if isinstance(entry, dict) else None
        if isinstance(name, str) and name not in names:
            names.append(name)
    return tuple(names) or DEFAULT_ISOLATION_FAULTS
