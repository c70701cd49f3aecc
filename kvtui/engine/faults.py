"""The two faults that change the engine's control flow, each beside its own code: stale_slot at
admission and racy_threads at the forward. The other faults are table changes in batching.py and
attention.py, and (paged KV) bookkeeping changes in block_manager.py. Names, descriptions and
detectors are in the catalogue, kvtui/faults.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtui.engine.batching import BatchStats, build_batch
from kvtui.engine.kv_pool import KVPool
from kvtui.engine.request import RequestState
from kvtui.engine.scheduler import StepPlan
from kvtui.faults import FaultName

# Faults that change the attention mask itself: while one is on, attention takes the mask path over
# the gathered keys (attention.py); otherwise each chunk reads only its own keys.
MASK_FAULTS = frozenset({FaultName.NO_REQUEST_MASK, FaultName.UNMASKED_CACHE_PADDING, FaultName.CAUSAL_OFFSET,
                         FaultName.FP16_CACHE})


@dataclass(frozen=True)
class StaleStart:
    """A request that took a slot stale (stale_slot): `kept` tokens of `previous` owner's KV were
    taken for the start of its prompt."""

    request_id: str
    slot: int
    previous: str | None
    kept: int


def stale_slot_admission(request: RequestState, pool: KVPool) -> StaleStart | None:
    """stale_slot: the reused slot's old length and contents stay, and the engine takes them for the
    new prompt's cached prefix (a stale prefix-cache hit): the request starts with `kept` positions
    cached, and only the part of the prompt past the old length, or at least its last token, is fed
    (Scheduler.admit sets that progress).

    Returns:
        what was kept, or None when the slot was empty or the stale prefix would not fit max_len.
    """
    kept = pool.last_len[request.slot]
    if not kept:
        return None
    fed = max(request.prompt_len - kept, 1)
    if kept + fed + request.sampling.max_new_tokens > pool.max_len:
        return None
    return StaleStart(request.request_id, request.slot, pool.previous_owner[request.slot], kept)


@dataclass(frozen=True)
class RacyOutcome:
    """What the racy_threads forward produced: logits per chunk index that survived, errors per
    chunk index, and the summed figures of the per-request batches."""

    logits: dict[int, torch.Tensor]
    errors: tuple[tuple[int, str], ...]
    stats: BatchStats


def racy_forward(runner, plan: StepPlan, *, layout: str, pad_token_id: int, faults: frozenset, max_len: int,
                 tag_writes, block_size: int | None = None) -> RacyOutcome:
    """racy_threads: a batch of one per request, each run by its own thread through the runner's single
    cache-state variable (see ModelRunner.forward_racy). `tag_writes(batch, chunks)` tags the pool
    positions each batch writes, for the detectors."""
    batches = [build_batch(StepPlan((chunk,)), layout=layout, pad_token_id=pad_token_id, faults=faults,
                           max_len=max_len, block_size=block_size) for chunk in plan.chunks]
    for chunk, batch in zip(plan.chunks, batches):
        tag_writes(batch, (chunk,))
    from kvtui.engine.lora import LoraBatch

    loras = [LoraBatch.of(batch, (chunk,), runner.device) for chunk, batch in zip(plan.chunks, batches)]
    results = runner.forward_racy(batches, fp16=FaultName.FP16_CACHE in faults, own_range=not faults & MASK_FAULTS,
                                  loras=loras)
    logits = {i: out[0] for i, (out, err) in enumerate(results) if out is not None and len(out) and not err}
    errors = tuple((i, err) for i, (out, err) in enumerate(results) if err)
    return RacyOutcome(logits, errors, BatchStats.total([b.stats for b in batches]))
