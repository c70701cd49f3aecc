"""The engine's one KV interface: what the scheduler and the engine ask of a KV cache, whatever its kind.

Two caches implement it: SlotCache (slot_cache.py, `engine.kv: slots`: one preallocated region of
max_len tokens per running request) and PagedCache (paged.py, `engine.kv: paged`: blocks through
block tables, preemption, prefix caching). The engine builds one (`_make_kv` in engine.py, the only
place that reads `config.kv`), the Scheduler owns it, and calls go one way: Scheduler -> cache for
admission, planning, preemption and parallel sampling's forks; Engine -> Scheduler.finish -> cache
when a request ends; Engine -> cache for commit, the isolation check and the step report. A cache
never writes a request's progress (cache_len, prefill_done): `admit` returns the tokens it already
holds and Scheduler.set_progress, the one writer, records them. A cache never calls back into the
scheduler or the engine. A cross-attention (encoder) cache plugs in here as a third implementation.

The verbs, in the order of a request's life (units: tokens unless stated):

| verb | who calls | does |
|---|---|---|
| configure(config, faults) | Engine (start, reconfigure, set_faults) | takes the knobs and faults it acts on |
| rejection(request) | Engine.submit | why the request can never run here ("" when it can) |
| free_seats() | Engine.submit | waiting requests the next admission takes for sure (queue limit) |
| admit(request, num_running) | Scheduler.admit | give the request its KV now (the prefix-cache hit count, 0 for none), or None: it waits |
| ensure(request, num_tokens) | Scheduler.plan | room for positions 0 .. num_tokens - 1: a KVPlace, or None |
| preempt(request) | Scheduler.plan | take the request's KV back (preemption by recompute) |
| fork(lead, child, num_running) | Scheduler.fork, after the forward | parallel sampling: the child gets the lead's prompt KV (a copy, or shared blocks with copy-on-write), or None: no room |
| keep_checkpoint(request, checkpoint) | Scheduler.update_from_output | keep a hybrid's recurrent-state checkpoint with the block it ends (paged; slots: ignored) |
| checkpoint(request, num_tokens) | Scheduler.admit | the checkpoint kept with the block ending at num_tokens (a hit's last block), or None |
| commit(request) | Engine, after the forward | note the tokens written (prefix caching) |
| finish(request) | Scheduler.finish | free the request's KV |
| expected_writers(batch, chunks, own) | Engine, isolation check | [R, K] writer serials allowed, or None |
| report_fields(running) | Engine, step report | the StepEvent's KV fields |

Admission is FIFO: the scheduler stops at the first request `admit` refuses. `ensure` returning None
means no room this step; the scheduler then preempts the newest running request and asks again
(vLLM V1's scheduler). A cache whose `ensure` never returns None is never asked to preempt. None of
the verbs raise for a request's own state; a broken invariant (an admitted request without KV)
raises AssertionError or RuntimeError, a bug.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    import torch

    from kvtui.config import EngineConfig
    from kvtui.engine.kv_pool import KVPool, PagedKVPool
    from kvtui.engine.request import RequestState


class KVPlace(NamedTuple):
    """Where one request's positions 0 .. end - 1 live this step: its slot (slot cache; None with paged
    KV) or its block table (block ids in position order, covering end; None with slots)."""

    slot: int | None
    blocks: tuple[int, ...] | None


class KVCache(Protocol):
    """The verbs every KV cache offers (see the module docstring for who calls each).

    Attributes:
        pool: the K/V tensors and their writer tags (KVPool or PagedKVPool); `pool.max_len` is the
            tokens one request may hold.
        block_size: tokens per block, or None for a cache without blocks (batching.build_batch reads it).
    """

    pool: KVPool | PagedKVPool
    block_size: int | None

    def configure(self, config: EngineConfig, faults: frozenset[str]) -> None:
        """Take the knobs (max_batch_size, slot_reuse) and faults this cache acts on from the next step."""

    def rejection(self, request: RequestState) -> str:
        """Why `request` (prompt + max_new_tokens) can never run in this cache; "" when it can."""

    def free_seats(self) -> int:
        """Waiting requests the next admission takes for sure (not counted against max_waiting)."""

    def admit(self, request: RequestState, num_running: int) -> int | None:
        """Give the head of the waiting queue its KV now: the positions it already holds (a prefix-cache
        hit; 0 for none), which Scheduler.admit makes its progress; or None: it waits. Never writes the
        request's progress. `num_running`: requests running now."""

    def ensure(self, request: RequestState, num_tokens: int) -> KVPlace | None:
        """Room for the running request's positions 0 .. num_tokens - 1; None when none is free."""

    def preempt(self, request: RequestState) -> None:
        """Take the request's KV back; the scheduler sends it to the front of the waiting queue."""

    def fork(self, lead: RequestState, child: RequestState, num_running: int) -> KVPlace | None:
        """Parallel sampling: give `child` the KV of `lead`'s positions 0 .. lead.cache_len - 1, which
        the step just finished writing; its KVPlace, or None when there is no room (it then queues and
        prefills itself). Slots: a copy into the child's own slot; paged KV: the lead's blocks shared by
        reference count, the partial last one copied on the first write into it (copy-on-write)."""

    def keep_checkpoint(self, request: RequestState, checkpoint) -> None:
        """Keep a hybrid's recurrent-state checkpoint (state_pool.StateCheckpoint, after checkpoint.num_tokens
        positions, a block boundary) with the request's block that ends there; a cache without a prefix
        cache ignores it."""

    def checkpoint(self, request: RequestState, num_tokens: int):
        """The checkpoint kept with the request's block ending at position num_tokens - 1, or None."""

    def commit(self, request: RequestState) -> None:
        """After the forward: the request's cache_len tokens are written."""

    def finish(self, request: RequestState) -> None:
        """The request is done (finished, aborted or rejected): free its KV, if it holds any."""

    def expected_writers(self, batch, chunks: tuple, own: list[int]) -> torch.Tensor | None:
        """[R, K] writer serial each request's own key columns may hold, or None: its own serial only.
        `batch`: the step's batching.BatchTensors; `chunks`: its scheduler.ScheduledChunk in segment order;
        `own`: each chunk's request serial. (Not imported here: batching and the scheduler import this.)"""

    def report_fields(self, running: list[RequestState]) -> dict:
        """StepEvent fields for the step just run: kv_tokens, kv_capacity_tokens, kv_usage, and the cache's
        own (slots_used, num_slots and stale_starts for slots; blocks and prefix-cache counters since the
        last report for paged KV). num_running and max_batch_size are the engine's."""
