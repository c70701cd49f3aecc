"""The engine's paged KV cache (`engine.kv: paged`): admission by free blocks, the block tables of
each step's chunks, preemption by recompute, prefix-cache commits, and what a step reports about blocks.

Implements the KVCache verbs (kv_cache.py); the Scheduler calls it, it never calls the scheduler.
The bookkeeping itself (blocks, reference counts, free queue, hash chain) is the torch-free
BlockManager (block_manager.py); this module ties it to the engine's requests and pool.

Preemption by recompute, as vLLM V1: when a running request needs a block and none is free, the
newest running request gives all its blocks back and goes to the front of the waiting queue; when
it is admitted again it feeds its prompt and the tokens it had generated as one prefill (its
cached blocks may still be hit), and the last chunk samples its next token with its own generator,
so its output is unchanged.

A hybrid's recurrent-state checkpoints (state_side.py) are kept with the blocks they end (keep_checkpoint)
and read back on a hit (checkpoint). Under `state_published_before_write` a checkpoint is published when its
chunk is scheduled (ensure: the block's entry is what the block's state memory holds then) and the forward's
real one is written at the request's next step (as vLLM's align mode copies a boundary's state into its
block at the start of the next step); a request that ends first (finish, preempt) never writes it.
"""

from __future__ import annotations

import torch

from kvtui.config import EngineConfig
from kvtui.engine import offload
from kvtui.engine.block_manager import Admission, BlockManager, salt_digest
from kvtui.engine.fault_acts import KEY_FAULTS, FaultActs
from kvtui.engine.kv_cache import KVPlace
from kvtui.engine.kv_pool import PagedKVPool
from kvtui.engine.lora import prefix_salt, true_items
from kvtui.engine.observe import expected_writers
from kvtui.engine.report import PrefixHitEntry, ReusedBlockEntry
from kvtui.engine.request import RequestState
from kvtui.faults import FaultName


class PagedCache:
    """Paged KV for one engine (see kv_cache.KVCache for the verbs). With paged KV max_batch_size also
    bounds the running requests, as vLLM's max_num_seqs.

    Args:
        pool: the PagedKVPool (tensors and writer tags).
        caching, watermark: prefix caching on; admission watermark (see BlockManager).
        serial_of: request id -> the serial its writes are tagged with; name_of: serial -> request id.
        offload_blocks: blocks the KV offload tier holds (0: no tier; kvtui/engine/offload.py).
        needs_state: a prefix hit must end at a block that keeps a recurrent-state checkpoint (hybrid models,
            BlockManager.needs_state).
    """

    def __init__(self, pool: PagedKVPool, *, caching: bool, watermark: float, serial_of, name_of=None,
                 offload_blocks: int = 0, needs_state: bool = False) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.max_running = 1  # max_batch_size, set by configure
        self.faults: frozenset[str] = frozenset()
        self.manager = BlockManager(pool.num_blocks, pool.block_size, caching=caching, watermark=watermark)
        self.manager.needs_state = needs_state
        self.serial_of = serial_of
        self.borrowed: dict[str, list[int]] = {}  # request -> writer serial allowed at each reused position
        self.num_preemptions = 0
        self._hits: list[PrefixHitEntry] = []
        self._preempted: list[str] = []
        self._counted = (0, 0, 0)  # queries, hits, cross-tenant hits at the last report
        self.cross_tenant_hits = 0
        self.name_of = name_of or (lambda serial: None)
        self.tier = offload.HostTier(offload.check_host_memory(offload_blocks, pool.bytes_per_block)) \
            if offload_blocks else None
        self.manager.tier = self.tier
        self._tier_counted = (0, 0, 0)  # tier stores, queried and hit tokens at the last report
        self._restored: dict[int, tuple[list[int], bool, str | None]] = {}  # block -> (tags it should hold, intact, found writer)
        self._unwritten: dict[str, list] = {}  # state_published_before_write: request -> checkpoints to write next step
        self.acts = FaultActs()  # where the faults act (the engine takes it each step)
        self.manager.acts = self.acts
        self._skipped: set[int] = set()  # tier_partial_load: the blocks whose restore was skipped, last admission

    def configure(self, config: EngineConfig, faults: frozenset[str]) -> None:
        """max_batch_size (running requests) and the faults the block bookkeeping acts on from the next
        step (the paged ones; others are ignored)."""
        self.max_running = config.max_batch_size
        self.faults = faults  # the input-keying faults (embeds_unkeyed, ...) act on RequestState.cache_keys
        self.manager.faults = faults
        if FaultName.CROSS_KV_PREFIX_CACHED in faults:  # encoder-decoders: keys without the audio's hash (the salt)
            self.manager.faults = faults | {FaultName.UNSALTED_PREFIX}

    def rejection(self, request: RequestState) -> str:
        """Why a request can never run in this pool ("" when it can)."""
        tokens = request.prompt_len + request.sampling.max_new_tokens
        if self.manager.fits(tokens):
            return ""
        return (f"prompt + max_new_tokens = {tokens} tokens need {self.manager.blocks_for(tokens)} KV blocks; the "
                f"pool has {self.manager.num_usable} ({self.manager.watermark_blocks} kept free by the watermark)")

    def free_seats(self) -> int:
        return 0  # whether the next admission takes a request depends on its blocks

    # -- admission ----------------------------------------------------------------------------------
    def admit(self, request: RequestState, num_running: int) -> int | None:
        """Give the request the blocks of its whole prefill (its cached prefix reused) while fewer than
        max_batch_size run and the watermark is kept: the prefix-cache hit in tokens (at most its
        prefill length - 1); None leaves it waiting."""
        if num_running >= self.max_running:
            return None
        n = request.prefill_len
        admission = self.manager.admit(request.request_id, request.cache_keys(n, self.faults), salt=self._salt(request),
                                       tenant=request.tenant, count_query=request.num_preemptions == 0,
                                       truth_ids=self._truth(request, n), tier_keys=self._tier_keys(request, n))
        self._apply_tier()
        if admission is None:
            return None
        request.prefix_hit_tokens = admission.hit_tokens
        self.borrowed[request.request_id] = self._borrowed(request, admission)
        if admission.reused:
            self._note_hit(request, admission)
            if self.faults:
                self._note_acts(request.request_id, admission)
        return admission.hit_tokens

    def _note_acts(self, request_id: str, admission: Admission) -> None:
        """Where the prefix-cache and tier faults acted on this admission: a block handed over that the sound
        key would not have given (the key faults; tier_key_drops_partition for a tier restore), a partial block
        shared (shared_partial_block), every restore (tier_layout_mismatch), a restore skipped
        (tier_partial_load). The state faults act where a request starts from a state not its own
        (fault_acts.step_acts)."""
        for r in admission.reused:
            acted = set()
            if r.tokens < self.block_size:
                acted.add(FaultName.SHARED_PARTIAL_BLOCK)
            if not r.verified:
                acted |= {FaultName.TIER_KEY_DROPS_PARTITION} if r.tier else KEY_FAULTS
            if r.tier:
                acted.add(FaultName.TIER_LAYOUT_MISMATCH)
                acted |= {FaultName.TIER_PARTIAL_LOAD} if r.block_id in self._skipped else set()
            for fault in sorted(acted & self.faults):
                self.acts.note(fault, (request_id,), "block", (r.block_id,))

    def _borrowed(self, request: RequestState, admission: Admission) -> list[int]:
        """Writer serials the request may find at its reused positions: the writer tags of a reused
        block whose contents are what it would compute (verified), its own serial otherwise."""
        own, out = self.serial_of(request.request_id), []
        for r in admission.reused:
            if not r.verified:
                out += [own] * r.tokens
            elif r.tier:  # what the restore should have put there, whatever it did
                out += self._restored[r.block_id][0][: r.tokens]
            else:
                out += self.pool.writer[r.block_id, : r.tokens].tolist()
        return out

    # -- the offload tier -----------------------------------------------------------------------------
    def _salt(self, request: RequestState) -> str | None:
        """The first block's extra key: the tenant's cache_salt and the request's LoRA adapter (engine/lora.py)."""
        return prefix_salt(request.cache_salt, request.input.lora, self.faults)

    @staticmethod
    def _truth(request: RequestState, n: int) -> list:
        """Content key items of positions 0 .. n - 1: what fills them, and the LoRA weights they run under."""
        return true_items(request.cache_keys(n), request.input.lora)

    def _tier_keys(self, request: RequestState, n: int) -> list[bytes] | None:
        """The offload tier's keys of the full blocks of the request's first n positions (None: no tier): its
        own key, whatever faults the pool's key has; the partition is the tenant's salt and the adapter."""
        if self.tier is None:
            return None
        tokens = (list(request.prompt_ids) + request.generated_ids)[:n]
        partition = prefix_salt(request.cache_salt, request.input.lora)
        return offload.tier_keys(request.cache_keys(n), tokens, self.block_size, partition, self.faults)

    def _apply_tier(self) -> None:
        """Make the tier's copies the bookkeeping decided: evicted full blocks into the tier, then the
        restores into their new blocks (under tier_partial_load one admission's last restore is skipped),
        each restored block's bytes checked against the digest it was stored with."""
        if self.tier is None:
            return
        stores, loads = self.manager.take_tier_ops()
        self._restored = {}
        for block, key, origin, state in stores:
            self.tier.put(key, offload.store(self.pool, block, origin, state, tier=self.tier, faults=self.faults))
        skipped = loads[-1:] if FaultName.TIER_PARTIAL_LOAD in self.faults else []  # promised, never copied
        self._skipped = {block for block, _ in skipped}
        for block, entry in loads[: len(loads) - len(skipped)]:
            kept = self.manager.pool.blocks[block]
            kept.state = offload.restore(self.pool, entry, block, self.faults, self.tier)
            if kept.state is not None:
                kept.memory = kept.state
        for block, entry in loads:
            self._restored[block] = tags, intact, found = self._check(block, entry)
            if not intact:
                self.manager.mark_foreign(block, found, offload.block_bytes_digest(self.pool, block))

    def _check(self, block: int, entry) -> tuple[list[int], bool, str | None]:
        """(tags the block should hold, whether its bytes are what the tier stored, the writer of the
        bytes it holds when they are not: the request whose tag is there, else the stored origin's writer)."""
        intact = offload.block_bytes_digest(self.pool, block) == entry.digest
        held = self.pool.writer[block].tolist()
        stale = next((s for s, t in zip(held, entry.tags) if s != t and s >= 0), None)
        found = None if intact else (self.name_of(stale) if stale is not None else entry.origin.writer)
        return entry.tags, intact, found

    def _note_hit(self, request: RequestState, admission: Admission) -> None:
        blocks = tuple(ReusedBlockEntry(index=r.index, block=r.block_id, tokens=r.tokens, writer=r.origin.writer,
                                        writer_tenant=r.origin.tenant, writer_salt=r.origin.salt,
                                        writer_key=r.origin.true_key.hex()[:16], reader_key=r.reader_key.hex()[:16],
                                        **self._tier_fields(r))
                       for r in admission.reused)
        self.cross_tenant_hits += sum(r.tokens for r in admission.reused if r.origin.tenant != request.tenant)
        self._hits.append(PrefixHitEntry(request_id=request.request_id, tenant=request.tenant,
                                         salt=salt_digest(self._salt(request)), hit_tokens=admission.hit_tokens,
                                         query_tokens=request.prefill_len, blocks=blocks))

    def _tier_fields(self, reuse) -> dict:
        """ReusedBlockEntry's tier fields of one reused block (none for a block the pool still held)."""
        if not reuse.tier:
            return {}
        _, intact, found = self._restored[reuse.block_id]
        return dict(tier=True, intact=intact, found_writer=found)

    # -- planning -----------------------------------------------------------------------------------
    def ensure(self, request: RequestState, num_tokens: int) -> KVPlace | None:
        """Grow the request's block table to hold num_tokens, first copying a block shared with a forked
        sibling that this step writes into (copy-on-write); None when no block is free."""
        table = self.manager.ensure(request.request_id, num_tokens, write_from=request.cache_len)
        self._apply_tier()  # blocks this growth evicted go to the tier before anything is written there
        for src, dst in self.manager.take_copies():
            self.pool.copy_block(src, dst)
        if table is not None:
            for checkpoint in self._unwritten.pop(request.request_id, []):  # its last step's, written late
                self.manager.publish_state(request.request_id, checkpoint.num_tokens // self.block_size - 1,
                                           checkpoint)
            if FaultName.STATE_PUBLISHED_BEFORE_WRITE in self.faults and self.manager.needs_state:
                self._publish_before_write(request, num_tokens)
        return None if table is None else KVPlace(None, table)

    def _publish_before_write(self, request: RequestState, num_tokens: int) -> None:
        """state_published_before_write, when a chunk is scheduled: every block boundary the chunk reaches gets
        its checkpoint entry now, holding what that block's state memory holds (another request's state; a
        block whose memory holds nothing yet gets none)."""
        for n in range((request.cache_len // self.block_size + 1) * self.block_size, num_tokens + 1, self.block_size):
            memory = self.manager.state_memory(request.request_id, n // self.block_size - 1)
            if memory is not None:
                self.manager.publish_state(request.request_id, n // self.block_size - 1,
                                           memory.relabeled(n, request.request_id))

    def fork(self, lead: RequestState, child: RequestState, num_running: int) -> KVPlace | None:
        """Parallel sampling: `child` shares every block of `lead` (reference count + 1); the partial last
        block is copied when either first writes into it (copy-on-write, in `ensure`). None while
        max_batch_size requests run."""
        if num_running >= self.max_running:
            return None
        self.manager.fork(lead.request_id, child.request_id)
        taken = self.borrowed.get(lead.request_id, [])[: lead.cache_len]
        self.borrowed[child.request_id] = taken + [self.serial_of(lead.request_id)] * (lead.cache_len - len(taken))
        return KVPlace(None, self.manager.table(child.request_id))

    def preempt(self, request: RequestState) -> None:
        """Preemption by recompute: all the request's blocks go back (cached ones stay cached)."""
        self.manager.free(request.request_id)
        self.borrowed.pop(request.request_id, None)
        self._unwritten.pop(request.request_id, None)  # state_published_before_write: never written
        self.num_preemptions += 1
        self._preempted.append(request.request_id)

    # -- recurrent-state checkpoints (hybrid models) ---------------------------------------------------
    def checkpoint(self, request: RequestState, num_tokens: int):
        """The recurrent-state checkpoint kept with the request's block ending at position num_tokens - 1
        (its prefix-cache hit's last block), or None."""
        return self.manager.state_at(request.request_id, num_tokens)

    def keep_checkpoint(self, request: RequestState, checkpoint) -> None:
        """Keep `checkpoint` (state_pool.StateCheckpoint after its num_tokens positions, a block boundary) with
        the request's block ending there, to be cached, offloaded and evicted with it. Under
        state_published_before_write it is written at the request's next step (ensure) instead."""
        if FaultName.STATE_PUBLISHED_BEFORE_WRITE in self.faults:
            self._unwritten.setdefault(request.request_id, []).append(checkpoint)
            return
        self.manager.publish_state(request.request_id, checkpoint.num_tokens // self.block_size - 1, checkpoint)

    # -- after the forward ----------------------------------------------------------------------------
    def commit(self, request: RequestState) -> None:
        """Cache the request's blocks that its written tokens now fill (prefix caching)."""
        n = len(request.all_ids)
        self.manager.commit(request.request_id, request.cache_keys(n, self.faults), request.cache_len,
                            prompt_len=request.prompt_len, truth_ids=self._truth(request, n),
                            tier_keys=self._tier_keys(request, n))

    def finish(self, request: RequestState) -> None:
        """A finished request's blocks go back (cached ones stay cached until evicted)."""
        self.manager.free(request.request_id)
        self.borrowed.pop(request.request_id, None)
        self._unwritten.pop(request.request_id, None)  # state_published_before_write: never written

    def expected_writers(self, batch, chunks, own: list[int]) -> torch.Tensor:
        """[R, K] the writer serial each of a request's own key columns may hold (for slot_taint and
        attention_flow): the recorded writer at positions reused from the prefix cache or forked from
        its lead (parallel sampling), its own serial elsewhere."""
        return expected_writers(batch, own, [self.borrowed.get(c.request.request_id, []) for c in chunks])

    def report_fields(self, running: list[RequestState]) -> dict:
        """The StepEvent fields of paged KV for the step just run (counters since the last report):
        cached tokens (of the pool's capacity) and blocks; kv_usage is vLLM's kv_cache_usage_perc (by
        blocks, cached free blocks counted free)."""
        fields = self._block_fields(running)
        return dict(kv_tokens=sum(r.cache_len for r in running), kv_capacity_tokens=self.pool.capacity_tokens,
                    kv_usage=fields["kv_cache_usage_perc"], **fields, **self._tier_report())

    def _tier_report(self) -> dict:
        """The offload tier's StepEvent fields: blocks stored, tokens asked of it and restored from it since
        the last report, blocks and bytes held, its capacity in blocks (nothing without a tier)."""
        if self.tier is None:
            return {}
        stores, queries, hits = self._tier_counted
        m = self.manager
        self._tier_counted = (self.tier.stores, m.tier_query_tokens, m.tier_hit_tokens)
        return dict(kv_offload_stores=self.tier.stores - stores, kv_offload_queries=m.tier_query_tokens - queries,
                    kv_offload_hits=m.tier_hit_tokens - hits,
                    kv_offload_blocks=len(self.tier), kv_offload_capacity=self.tier.capacity,
                    kv_offload_bytes=len(self.tier) * self.pool.bytes_per_block)

    def _block_fields(self, running: list[RequestState]) -> dict:
        m = self.manager
        queries, hits, cross = self._counted
        self._counted = (m.queries, m.hits, self.cross_tenant_hits)
        fields = dict(
            kv="paged", num_blocks=m.num_usable, blocks_used=m.num_usable - m.num_free, kv_cache_usage_perc=m.usage,
            num_preemptions=len(self._preempted), preempted=tuple(self._preempted),
            prefix_cache_queries=m.queries - queries, prefix_cache_hits=m.hits - hits,
            prefix_cache_cross_tenant_hits=self.cross_tenant_hits - cross, prefix_hits=tuple(self._hits),
            block_state=m.state(),
            block_tables=tuple((r.request_id, m.table(r.request_id)) for r in running
                               if r.request_id in m.tables))
        self._hits, self._preempted = [], []
        return fields
