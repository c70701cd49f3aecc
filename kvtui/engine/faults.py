"""The named isolation faults (docs/faults.md). Each is a switch the real code path consults:
the batch really is built, masked, positioned or cached wrongly; nothing is simulated.

| fault | where it acts |
|---|---|
| shared_cache | batching: every request reads and writes slot 0, one global cache region |
| racy_threads | runner: one Python thread per request, all sharing one cache-state variable |
| no_request_mask | batching, packed: plain causal mask over the concatenation, no block-diagonal part |
| unmasked_cache_padding | batching, padded: cache padding columns left visible |
| shared_position_offset | batching: position ids from a batch-wide counter (the longest cache) |
| stale_slot | engine admission: a reused slot keeps its previous owner's length and contents, taken |
|  | for the new prompt's cached prefix: the new request continues the old conversation |
| causal_offset | batching: causal mask built square (key <= query index), ignoring the cache offset |
| fp16_cache | attention and cache: float16 with a -1e9 mask constant (-inf in float16), padded rows |
|  | cached whole (pads included), so a fully masked pad row's NaN lands in the cache |
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fault:
    """One fault: its name, what it breaks (one line), the layouts it acts in, and the detectors
    expected to catch it with the kind they report."""

    name: str
    breaks: str
    layouts: tuple[str, ...]
    caught_by: tuple[str, ...]
    kind: str


FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("shared_cache", "all requests read and write one cache region (a global past_key_values)",
          ("padded", "packed"), ("slot_taint", "attention_flow", "reference", "canary"), "cross_request"),
    Fault("racy_threads", "one thread per request over a shared cache variable: state races, shape errors",
          ("padded", "packed"), ("reference", "slot_taint"), "corruption"),
    Fault("no_request_mask", "packed batch without the block-diagonal mask: queries see other requests' keys",
          ("packed",), ("attention_flow", "slot_taint", "reference"), "cross_request"),
    Fault("unmasked_cache_padding", "mask hides input pads but not the padding inside cached K/V",
          ("padded",), ("slot_taint", "reference"), "corruption"),
    Fault("shared_position_offset", "position ids from a batch-wide counter: shorter rows get wrong RoPE offsets",
          ("padded", "packed"), ("reference",), "corruption"),
    Fault("stale_slot", "a reused slot keeps its old length and contents: the new request continues the old one",
          ("padded", "packed"), ("slot_taint", "attention_flow", "canary", "reference"), "cross_request"),
    Fault("causal_offset", "causal mask built square, ignoring the cache offset: decode sees only the first keys",
          ("padded", "packed"), ("reference",), "corruption"),
    Fault("fp16_cache", "float16 cache and attention with a -1e9 mask (= -inf): pad rows turn NaN and poison",
          ("padded",), ("reference",), "corruption"),
)}

FAULT_NAMES = tuple(FAULTS)

# `--isolation off` and the dashboard's `i` key: the faults a talk shows first (the passphrase leaks).
DEFAULT_ISOLATION_OFF = ("stale_slot",)

FP16_MASK_CONSTANT = -1e9  # a common hand-written mask constant; float16 rounds it to -inf


def check_fault_names(names) -> frozenset[str]:
    """Validate fault names; raises ValueError naming the unknown one and the known list."""
    names = frozenset(names)
    unknown = sorted(names - set(FAULTS))
    if unknown:
        raise ValueError(f"unknown fault {unknown[0]!r}; known: {', '.join(FAULT_NAMES)} (see `kvtui faults`)")
    return names
