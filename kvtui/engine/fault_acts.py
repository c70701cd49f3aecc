"""Where the isolation faults acted: the engine's record of every step in which a fault's code path took
another decision than the sound one on real data (torch-free).

A fault that is on does not always act: mm_hash_missing needs a cached block holding an image position
that another picture's request looks up; stale_slot needs a slot another request left. A run in which a
fault acted 0 times tested nothing, and says so (kvtui.faults.inert_line) instead of reading as a
detector miss.

Two sources, merged per step into one kvtui.events.FaultActed per fault (Engine._report):
- `FaultActs`, the notebook the code paths write into where they act (the block manager, the paged
  cache, the offload tier, the encoder sides): `note(fault, requests, where, ids)`;
- `plan_acts` and `step_acts`, pure functions of the step's plan (the mask and position faults, which
  act in batching for every chunk the plan gives them) and of the step's report (the faults the engine
  already reports by request: stale starts, stale bitmask rows, moved sampling state, state starts).
"""

from __future__ import annotations

from kvtui.events import FaultActed
from kvtui.faults import FaultName

Note = tuple[str, tuple[str, ...], str, tuple[int, ...]]  # (fault, request ids, where, ids)

# the faults that act through a prefix-cache key: they act when a hit hands a block the sound key would not
KEY_FAULTS = frozenset({FaultName.UNSALTED_PREFIX, FaultName.PREFIX_KEY_NO_PARENT, FaultName.CROSS_KV_PREFIX_CACHED,
                        FaultName.EMBEDS_UNKEYED, FaultName.EMBEDS_MASK_UNKEYED, FaultName.MM_HASH_MISSING,
                        FaultName.LORA_UNKEYED_PREFIX, FaultName.LORA_RELOAD_STALE})
# a hybrid's checkpoint faults: they act when a request starts from a checkpoint that is not its own prefix's
CHECKPOINT_FAULTS = frozenset({FaultName.STATE_PUBLISHED_BEFORE_WRITE, FaultName.TIER_DROPS_RECURRENT_STATE,
                               FaultName.STATE_INDEX_UNITS})


class FaultActs:
    """The notebook the engine's code paths write where a fault acts; the engine takes it once per step."""

    def __init__(self) -> None:
        self._notes: list[Note] = []

    def note(self, fault: str, requests=(), where: str = "", ids=()) -> None:
        """Fault `fault` acted on `requests` (request ids), touching `ids` (block ids, slots, rows, state
        slots: `where` names which)."""
        self._notes.append((f"{fault}", tuple(requests), where, tuple(int(i) for i in ids)))

    def take(self) -> list[Note]:
        """The notes since the last take (and forget them)."""
        notes, self._notes = self._notes, []
        return notes


def plan_acts(chunks, layout: str, faults: frozenset) -> list[Note]:
    """Where the batching faults act on a step's chunks (ScheduledChunk: request, slot, start_pos, end_pos,
    num_tokens): shared_cache on rows not in slot 0, racy_threads and no_request_mask on a step of more
    than one request (packed for the latter), unmasked_cache_padding on rows shorter than the longest
    (padded), shared_position_offset on rows whose cache is shorter than the longest, causal_offset on
    rows with tokens already cached, fp16_cache on padded rows of a padded step."""
    if not faults or not chunks:
        return []
    ids = [c.request.request_id for c in chunks]
    rows = range(len(chunks))
    notes: list[Note] = []

    def add(fault, picked):
        picked = list(picked)
        if fault in faults and picked:
            notes.append((f"{fault}", tuple(ids[i] for i in picked), "row", tuple(picked)))

    many = len(chunks) > 1
    longest, latest = max(c.end_pos for c in chunks), max(c.start_pos for c in chunks)
    widest = max(c.num_tokens for c in chunks)
    add(FaultName.SHARED_CACHE, rows if any(c.slot not in (None, 0) for c in chunks) else ())
    add(FaultName.RACY_THREADS, rows if many else ())
    add(FaultName.NO_REQUEST_MASK, rows if many and layout == "packed" else ())
    if layout == "padded":
        add(FaultName.UNMASKED_CACHE_PADDING, (i for i in rows if chunks[i].end_pos < longest))
        add(FaultName.FP16_CACHE, (i for i in rows if chunks[i].num_tokens < widest))
    add(FaultName.SHARED_POSITION_OFFSET, (i for i in rows if chunks[i].start_pos < latest))
    add(FaultName.CAUSAL_OFFSET, (i for i in rows if chunks[i].start_pos > 0))
    return notes


def step_acts(report, faults: frozenset) -> list[Note]:
    """Where the faults the step's report already shows by request acted (`report`: the StepEvent being
    built): stale_slot (its stale starts), stale_bitmask (its stale rows), the sampling-state faults (a
    token sampled, penalized or drawn with another request's state), state_slot_not_reset (a state slot
    started from another's state) and the checkpoint faults (a checkpoint start that is not the request's
    own prefix)."""
    if not faults:
        return []
    notes: list[Note] = []
    for request_id, slot, _previous, _kept in report.stale_starts:
        notes.append((f"{FaultName.STALE_SLOT}", (request_id,), "slot", (slot,)))
    for request_id, _previous, row in report.stale_masks:
        notes.append((f"{FaultName.STALE_BITMASK}", (request_id,), "row", (row,)))
    for entry in report.running:
        notes += _sampling_notes(entry, faults)
    for start in report.state_starts:
        if start.via == "slot" and start.writer is not None and start.writer != start.request_id:
            notes.append((f"{FaultName.STATE_SLOT_NOT_RESET}", (start.request_id,), "state_slot", (start.slot,)))
        elif start.via == "checkpoint" and not start.matches:
            notes += [(f"{f}", (start.request_id,), "state_slot", (start.slot,)) for f in sorted(faults & CHECKPOINT_FAULTS)]
    return [n for n in notes if n[0] in faults]


def _sampling_notes(entry, faults: frozenset) -> list[Note]:
    """row_state_misalign, shared_rng, penalty_shared_history where a sampled token used another request's
    sampling state, generator or token history (RunningEntry's provenance fields)."""
    rid, notes = entry.request_id, []
    if entry.sampled_with is not None and entry.sampled_with != rid:
        notes.append(FaultName.ROW_STATE_MISALIGN)
    if entry.drawn_with and any(r != rid for r in entry.drawn_with):
        notes.append(FaultName.SHARED_RNG if FaultName.SHARED_RNG in faults else FaultName.ROW_STATE_MISALIGN)
    if entry.penalized_with and any(r != rid for r in entry.penalized_with):
        notes.append(FaultName.PENALTY_SHARED_HISTORY if FaultName.PENALTY_SHARED_HISTORY in faults
                     else FaultName.ROW_STATE_MISALIGN)
    return [(f"{f}", (rid,), "", ()) for f in dict.fromkeys(notes)]


def merge(notes: list[Note], t: float, step: int) -> tuple[FaultActed, ...]:
    """One FaultActed per (fault, where) of the step's notes, their requests and ids joined in first-seen
    order, faults in the order they first acted."""
    joined: dict[tuple[str, str], tuple[dict, dict]] = {}
    for fault, requests, where, ids in notes:
        reqs, nums = joined.setdefault((fault, where if ids else ""), ({}, {}))
        reqs.update(dict.fromkeys(requests))
        nums.update(dict.fromkeys(ids))
    seen: dict[str, FaultActed] = {}
    for (fault, where), (reqs, nums) in joined.items():
        if fault in seen:  # one event per fault: a second kind of place joins its requests only
            old = seen[fault]
            seen[fault] = old.model_copy(update=dict(
                request_ids=tuple(dict.fromkeys(old.request_ids + tuple(reqs)))))
            continue
        seen[fault] = FaultActed(t=t, step=step, fault=fault, request_ids=tuple(reqs), where=where if nums else "",
                                 ids=tuple(nums))
    return tuple(seen.values())
