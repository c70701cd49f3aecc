"""Fault names as the dashboard shows them, and the set the `i` (isolation) key switches."""

from __future__ import annotations

# One line per fault for the fault picker (`f`) and the help screen (DESIGN.md section 4).
FAULT_DESCRIPTIONS: dict[str, str] = {
    "shared_cache": "all requests read/write one cache region",
    "racy_threads": "one thread per request over a shared cache variable",
    "no_request_mask": "packed layout without the block-diagonal mask",
    "unmasked_cache_padding": "pads inside cached K/V not masked",
    "shared_position_offset": "position ids from a batch-wide counter",
    "stale_slot": "a reused slot keeps the previous owner's length and contents",
    "causal_offset": "square causal mask ignoring the cache offset",
    "fp16_cache": "float16 KV cache with a -1e9 mask constant",
}

# What `i` switches on when the scenario names no faults of its own.
DEFAULT_ISOLATION_FAULTS: tuple[str, ...] = ("stale_slot",)


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
