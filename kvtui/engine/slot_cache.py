"""The engine's slot KV cache (`engine.kv: slots`): one KV slot of max_len tokens per running request.

Implements the KVCache verbs (kv_cache.py) over KVPool (kv_pool.py): a waiting request is admitted
while a slot is free (the lowest free slot, FIFO), its slot holds every position it can reach, so
`ensure` always has room and nothing is ever preempted, and a finished request frees its slot at
once. The stale_slot fault acts at admission (engine/faults.py); its stale starts are reported in
the step's `stale_starts`.
"""

from __future__ import annotations

import torch

from kvtui.config import EngineConfig
from kvtui.engine.faults import StaleStart, stale_slot_admission
from kvtui.engine.kv_cache import KVPlace
from kvtui.engine.kv_pool import KVPool
from kvtui.engine.observe import expected_writers
from kvtui.engine.request import RequestState
from kvtui.faults import FaultName


class SlotCache:
    """Slot KV for one engine (see kv_cache.KVCache for the verbs).

    Args:
        pool: the KVPool (tensors, owners, free list, writer tags).
        serial_of: request id -> the serial its writes are tagged with.
    """

    block_size = None

    def __init__(self, pool: KVPool, *, serial_of) -> None:
        self.pool = pool
        self.serial_of = serial_of
        self.borrowed: dict[str, list[int]] = {}  # forked sequence -> writer serial allowed at its prompt positions
        self.fresh = False  # slot_reuse: reallocate: each admission gets newly zeroed tensors
        self.stale = False  # the stale_slot fault is on
        self._stale_starts: list[StaleStart] = []

    def configure(self, config: EngineConfig, faults: frozenset[str]) -> None:
        self.fresh = config.slot_reuse == "reallocate"
        self.stale = FaultName.STALE_SLOT in faults

    def rejection(self, request: RequestState) -> str:
        return ""  # a slot holds max_len tokens, which the engine checks itself

    def free_seats(self) -> int:
        return self.pool.num_free

    def admit(self, request: RequestState, num_running: int) -> int | None:
        """Give the request the lowest free slot: 0 positions cached (or, under stale_slot, the length the
        slot's previous owner left, taken as cached); None when no slot is free."""
        if not self.pool.num_free:
            return None
        request.slot = self.pool.allocate(request.request_id, fresh=self.fresh)
        start = stale_slot_admission(request, self.pool) if self.stale else None
        if start is None:
            return 0
        self._stale_starts.append(start)
        return start.kept

    def ensure(self, request: RequestState, num_tokens: int) -> KVPlace:
        assert request.slot is not None, f"{request.request_id = } runs without a slot"
        return KVPlace(request.slot, None)

    def preempt(self, request: RequestState) -> None:
        self.finish(request)
        request.slot = None

    def fork(self, lead: RequestState, child: RequestState, num_running: int) -> KVPlace | None:
        """Parallel sampling: `child` takes the lowest free slot and a copy of `lead`'s positions
        0 .. lead.cache_len - 1 (K/V and writer tags); None when no slot is free."""
        if not self.pool.num_free:
            return None
        child.slot = self.pool.allocate(child.request_id, fresh=self.fresh)
        self.pool.copy_prefix(lead.slot, child.slot, lead.cache_len)
        self.borrowed[child.request_id] = [self.serial_of(lead.request_id)] * lead.cache_len
        return KVPlace(child.slot, None)

    def commit(self, request: RequestState) -> None:
        pass  # a slot keeps no index of its contents

    def checkpoint(self, request: RequestState, num_tokens: int) -> None:
        return None  # no prefix cache, so no state checkpoints

    def keep_checkpoint(self, request: RequestState, checkpoint) -> None:
        pass

    def finish(self, request: RequestState) -> None:
        """Free the request's slot at once; its cache_len is kept as the slot's last length."""
        self.borrowed.pop(request.request_id, None)
        if request.slot is not None and self.pool.owner[request.slot] == request.request_id:
            self.pool.free(request.slot, request.cache_len)

    def expected_writers(self, batch, chunks, own: list[int]) -> torch.Tensor | None:
        """None (every own key position was written by the request itself) unless a forked sequence
        is in the batch: its prompt positions were written by its lead (then [R, K], see
        observe.expected_writers)."""
        if not any(c.request.request_id in self.borrowed for c in chunks):
            return None
        return expected_writers(batch, own, [self.borrowed.get(c.request.request_id, []) for c in chunks])

    def report_fields(self, running: list[RequestState]) -> dict:
        """Slots owned after the step (of num_slots), cached tokens (of slots x max_len), stale starts."""
        pool = self.pool
        kv_tokens = sum(r.cache_len for r in running)
        stale, self._stale_starts = self._stale_starts, []
        return dict(slots_used=pool.num_used, num_slots=pool.num_slots, kv_tokens=kv_tokens, kv_capacity_tokens=pool.capacity_tokens,
                    kv_usage=kv_tokens / pool.capacity_tokens,
                    stale_starts=tuple((s.request_id, s.slot, s.previous, s.kept) for s in stale))
