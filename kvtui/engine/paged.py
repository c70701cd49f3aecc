"""The engine's paged KV cache: admission by free blocks, the block tables of each step's chunks,
preemption by recompute, prefix-cache commits, and what a step reports about blocks.

The bookkeeping itself (blocks, reference counts, free queue, hash chain) is the torch-free
BlockManager (block_manager.py); this module ties it to the engine's requests, scheduler and pool.

Preemption by recompute, as vLLM V1: when a running request needs a block and none is free, the
newest running request gives all its blocks back and goes to the front of the waiting queue; when
it is admitted again it feeds its prompt and the tokens it had generated as one prefill (its
cached blocks may still be hit), and the last chunk samples its next token with its own generator,
so its output is unchanged.
"""

from __future__ import annotations

import torch

from kvtui.engine.block_manager import Admission, BlockManager, salt_digest
from kvtui.engine.kv_pool import PagedKVPool
from kvtui.engine.report import PrefixHitEntry, ReusedBlockEntry
from kvtui.engine.request import RequestState
from kvtui.engine.scheduler import Scheduler, StepPlan

OTHER = -99  # an expected-writer cell no query compares with


class PagedCache:
    """Paged KV for one engine.

    Args:
        pool: the PagedKVPool (tensors and writer tags).
        scheduler: the engine's scheduler (admit_paged, plan_paged, preempt).
        caching, watermark: prefix caching on; admission watermark (see BlockManager).
        serial_of: request id -> the serial its writes are tagged with.
    """

    def __init__(self, pool: PagedKVPool, scheduler: Scheduler, *, caching: bool, watermark: float,
                 serial_of) -> None:
        self.pool = pool
        self.scheduler = scheduler
        self.manager = BlockManager(pool.num_blocks, pool.block_size, caching=caching, watermark=watermark)
        self.serial_of = serial_of
        self.borrowed: dict[str, list[int]] = {}  # request -> writer serial allowed at each reused position
        self.num_preemptions = 0
        self._hits: list[PrefixHitEntry] = []
        self._preempted: list[str] = []
        self._counted = (0, 0, 0)  # queries, hits, cross-tenant hits at the last report
        self.cross_tenant_hits = 0

    def set_faults(self, faults: frozenset) -> None:
        """The faults the block bookkeeping acts on from the next step (the paged ones; others are ignored)."""
        self.manager.faults = faults

    def rejection(self, request: RequestState) -> str:
        """Why a request can never run in this pool ("" when it can)."""
        tokens = request.prompt_len + request.sampling.max_new_tokens
        if self.manager.fits(tokens):
            return ""
        return (f"prompt + max_new_tokens = {tokens} tokens need {self.manager.blocks_for(tokens)} KV blocks; the "
                f"pool has {self.manager.num_usable} ({self.manager.watermark_blocks} kept free by the watermark)")

    # -- admission ----------------------------------------------------------------------------------
    def admit(self, start_s: float, max_running: int) -> list[RequestState]:
        """Admit waiting requests (FIFO) while blocks for their whole prefill are free (watermark kept)."""
        admitted = self.scheduler.admit_paged(self._try_admit, max_running)
        for request in admitted:
            if request.scheduled_s is None:
                request.scheduled_s = start_s
        return admitted

    def _try_admit(self, request: RequestState) -> bool:
        admission = self.manager.admit(request.request_id, request.prefill_ids, salt=request.cache_salt,
                                       tenant=request.tenant, count_query=request.num_preemptions == 0)
        if admission is None:
            return False
        request.cache_len = request.prefill_done = admission.hit_tokens
        request.prefix_hit_tokens = admission.hit_tokens
        self.borrowed[request.request_id] = self._borrowed(request, admission)
        if admission.reused:
            self._note_hit(request, admission)
        return True

    def _borrowed(self, request: RequestState, admission: Admission) -> list[int]:
        """Writer serials the request may find at its reused positions: the writer tags of a reused
        block whose contents are what it would compute (verified), its own serial otherwise."""
        own, out = self.serial_of(request.request_id), []
        for r in admission.reused:
            tags = self.pool.writer[r.block_id, : r.tokens].tolist() if r.verified else [own] * r.tokens
            out += tags
        return out

    def _note_hit(self, request: RequestState, admission: Admission) -> None:
        blocks = tuple(ReusedBlockEntry(index=r.index, block=r.block_id, tokens=r.tokens, writer=r.origin.writer,
                                        writer_tenant=r.origin.tenant, writer_salt=r.origin.salt,
                                        writer_key=r.origin.true_key.hex()[:16], reader_key=r.reader_key.hex()[:16])
                       for r in admission.reused)
        self.cross_tenant_hits += sum(r.tokens for r in admission.reused if r.origin.tenant != request.tenant)
        self._hits.append(PrefixHitEntry(request_id=request.request_id, tenant=request.tenant,
                                         salt=salt_digest(request.cache_salt), hit_tokens=admission.hit_tokens,
                                         query_tokens=request.prefill_len, blocks=blocks))

    # -- planning -----------------------------------------------------------------------------------
    def plan(self) -> StepPlan:
        """The step's chunks with their block tables; preempts when blocks run out."""
        return self.scheduler.plan_paged(self._ensure, self._preempt)

    def _ensure(self, request: RequestState, num_tokens: int):
        return self.manager.ensure(request.request_id, num_tokens)

    def _preempt(self, request: RequestState) -> None:
        """Preemption by recompute: blocks back, front of the waiting queue, prefill = prompt + generated."""
        self.manager.free(request.request_id)
        self.borrowed.pop(request.request_id, None)
        self.scheduler.preempt(request)
        request.cache_len = request.prefill_done = 0
        request.recompute_tokens = len(request.generated_ids)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted.append(request.request_id)

    # -- after the forward ----------------------------------------------------------------------------
    def commit(self, request: RequestState) -> None:
        """Cache the request's blocks that its written tokens now fill (prefix caching)."""
        self.manager.commit(request.request_id, request.all_ids, request.cache_len, prompt_len=request.prompt_len)

    def finish(self, request: RequestState) -> None:
        """A finished request's blocks go back (cached ones stay cached until evicted)."""
        self.manager.free(request.request_id)
        self.borrowed.pop(request.request_id, None)

    def expected_writers(self, batch, chunks, own: list[int]) -> torch.Tensor:
        """[R, K] the writer serial each of a request's own key columns may hold (for slot_taint and
        attention_flow): the recorded writer at positions reused from the prefix cache, its own
        serial elsewhere."""
        expected = torch.full(batch.key_owner.shape, OTHER, dtype=torch.long)
        for index, seg in enumerate(batch.segments):
            expected[seg.row, seg.key_start : seg.key_start + seg.end_pos] = own[index]
            borrowed = self.borrowed.get(chunks[index].request.request_id, [])[: seg.end_pos]
            if borrowed:
                expected[seg.row, seg.key_start : seg.key_start + len(borrowed)] = torch.tensor(borrowed)
        return expected

    def report_fields(self) -> dict:
        """The StepEvent fields of paged KV for the step just run (counters since the last report)."""
        m = self.manager
        queries, hits, cross = self._counted
        self._counted = (m.queries, m.hits, self.cross_tenant_hits)
        fields = dict(
            kv="paged", num_blocks=m.num_usable, blocks_used=m.num_usable - m.num_free, kv_cache_usage_perc=m.usage,
            num_preemptions=len(self._preempted), preempted=tuple(self._preempted),
            prefix_cache_queries=m.queries - queries, prefix_cache_hits=m.hits - hits,
            prefix_cache_cross_tenant_hits=self.cross_tenant_hits - cross, prefix_hits=tuple(self._hits),
            block_state=m.state(),
            block_tables=tuple((r.request_id, m.table(r.request_id)) for r in self.scheduler.running
                               if r.request_id in m.tables))
        self._hits, self._preempted = [], []
        return fields
