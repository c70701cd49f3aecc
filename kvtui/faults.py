"""The isolation fault catalogue: one owner for every fact about a fault (torch-free).

Each fault is a named switch that the real code path consults: the batch really is built, masked,
positioned or cached wrongly; nothing is simulated. The engine, the scenario schema, the CLI, the
dashboard and the docs all read this table.

| fault | where it acts |
|---|---|
| shared_cache | batching: every request reads and writes slot 0, one global cache region |
| racy_threads | runner: one Python thread per request, all sharing one cache-state variable |
| no_request_mask | batching, packed: plain causal mask over the concatenation, no block-diagonal part |
| unmasked_cache_padding | batching, padded: cache padding columns left visible |
| shared_position_offset | batching: position ids from a batch-wide counter (the longest cache) |
| stale_slot | admission: a reused slot keeps its previous owner's length and contents, taken for the |
|  | new prompt's cached prefix, so the new request continues the old conversation |
| causal_offset | batching: causal mask built square (key <= query index), ignoring the cache offset |
| fp16_cache | attention and cache: float16 with a -1e9 mask constant (-inf in float16); padded rows |
|  | cached whole, so a fully masked pad row's NaN lands in the cache |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FaultName = Literal["shared_cache", "racy_threads", "no_request_mask", "unmasked_cache_padding",
                    "shared_position_offset", "stale_slot", "causal_offset", "fp16_cache"]
# numeric: a near tie flipped by numerical batch variance; unknown: a target server's output differed from
# its solo run and the server gave no logprobs to tell which (neither counts toward the exit code)
ContaminationKind = Literal["cross_request", "corruption", "numeric", "unknown"]


@dataclass(frozen=True)
class Fault:
    """One isolation fault.

    Attributes:
        name: the switch's name (`--fault NAME`, `engine.faults`, timeline `{fault: NAME}`).
        breaks: what it breaks, one line.
        acts_in: where in the code path it acts, one line.
        user_sees: the symptom a user sees.
        layouts: the layouts it acts in ("padded", "packed").
        caught_by: the detectors expected to catch it ("engine": the step fails under the fault).
        kind: the kind of the findings it causes: cross_request when the damage needs another request
            (alone, with the same fault, the request gives its clean tokens), corruption when it does not.
    """

    name: str
    breaks: str
    acts_in: str
    user_sees: str
    layouts: tuple[str, ...]
    caught_by: tuple[str, ...]
    kind: ContaminationKind


FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("shared_cache", "all requests read and write one cache region (a global past_key_values)",
          "batching: every request's keys and values go to and come from slot 0",
          "answers cross: B's content shows up in A's answer",
          ("padded", "packed"), ("slot_taint", "attention_flow", "reference", "canary"), "cross_request"),
    Fault("racy_threads", "one thread per request over a shared cache variable: state races, shape errors",
          "runner: a Python thread per request, all through one cache-state variable",
          "outputs differ from run to run; shape errors",
          ("padded", "packed"), ("reference",), "cross_request"),
    Fault("no_request_mask", "packed batch without the block-diagonal mask: queries see other requests' keys",
          "batching (packed): a plain causal mask over the concatenated requests",
          "A drifts toward B; passphrases leak",
          ("packed",), ("attention_flow", "slot_taint", "reference"), "cross_request"),
    Fault("unmasked_cache_padding", "mask hides input pads but not the padding inside cached K/V",
          "batching (padded): cache-padding key columns are left visible",
          "repetition and garbage on shorter rows",
          ("padded",), ("slot_taint", "attention_flow", "reference"), "cross_request"),
    Fault("shared_position_offset", "position ids from a batch-wide counter: shorter rows get wrong RoPE offsets",
          "batching: every row's position ids start at the longest cache in the batch",
          "drift on the shorter rows of a batch",
          ("padded", "packed"), ("reference",), "cross_request"),
    Fault("stale_slot", "a reused slot keeps its old length and contents: the new request continues the old one",
          "admission: the slot's old length and contents are taken for the new prompt's cached prefix",
          "a new request continues the previous occupant's conversation",
          ("padded", "packed"), ("slot_taint", "attention_flow", "canary", "reference"), "cross_request"),
    Fault("causal_offset", "causal mask built square, ignoring the cache offset: decode sees only the first keys",
          "batching: the causal part compares key index with query index, not with its position",
          "garbage after the first decode step",
          ("padded", "packed"), ("reference",), "corruption"),
    Fault("fp16_cache", "float16 cache and attention with a -1e9 mask (= -inf): pad rows turn NaN and poison",
          "attention and cache: float16 with the -1e9 constant; pad rows cached whole",
          "NaN logits, garbled text (float32 or bfloat16 avoids it)",
          ("padded",), ("reference",), "cross_request"),
)}

FAULT_NAMES: tuple[str, ...] = tuple(FAULTS)
assert FAULT_NAMES == FaultName.__args__, "FaultName and FAULTS must list the same faults"

# `--isolation off` and the dashboard's `i` key: the faults a talk shows first (the passphrase leaks).
DEFAULT_ISOLATION_OFF: tuple[str, ...] = ("stale_slot",)

FP16_MASK_CONSTANT = -1e9  # the classic hand-written mask constant; float16 rounds it to -inf


def check_fault_names(names) -> frozenset[str]:
    """Validate fault names.

    Returns:
        the names as a frozenset.
    Raises:
        ValueError: naming the first unknown fault and the known list.
    """
    names = frozenset(names)
    unknown = sorted(names - set(FAULTS))
    if unknown:
        raise ValueError(f"unknown fault {unknown[0]!r}; known: {', '.join(FAULT_NAMES)} (see `kvtui faults`)")
    return names


def isolation_fault_set(engine_faults, timeline) -> tuple[str, ...]:
    """The faults the dashboard's `i` key switches on: those a scenario starts with (`engine_faults`) or
    names in its timeline (`timeline`: normalized entries `{"set": {"fault": NAME}}`), in that order;
    DEFAULT_ISOLATION_OFF when it names none."""
    names: list[str] = []
    for name in engine_faults or ():
        if name not in names:
            names.append(name)
    for entry in timeline or ():
        name = (entry.get("set") or {}).get("fault") if isinstance(entry, dict) else None
        if isinstance(name, str) and name not in names:
            names.append(name)
    return tuple(names) or DEFAULT_ISOLATION_OFF
