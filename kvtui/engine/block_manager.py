"""Paged KV bookkeeping, torch-free: blocks with reference counts, the free-block queue (least recently
used first), per-request block tables and the prefix-cache hash chain.

Names and rules follow vLLM V1 (vllm/v1/core/block_pool.py, kv_cache_manager.py, kv_cache_utils.py;
nano-vllm's block_manager.py is the same design in small):

- The KV cache is cut into blocks of `block_size` tokens. A request's tokens live in the blocks its
  block table lists, in order: token position p is at (table[p // block_size], p % block_size).
  Block 0 is the null block: never handed out (a padded batch's cache-padding columns point at it).
- A block is in use while its reference count is above 0. Free blocks wait in a queue: allocation
  takes the head (the least recently used), freeing appends at the tail, a request's blocks in
  reverse order so that the last blocks of its chain are evicted first.
- Prefix caching: a full block's key is sha256 over the canonical JSON of [parent key, its token ids,
  extra keys]. The first block's parent is NONE_KEY and its extra keys hold the request's cache_salt
  (as in vLLM only the first block carries the salt; every later key inherits it through the chain).
  A block whose reference count drops to 0 stays cached, in the free queue, until it is allocated
  again (evicted); a lookup that hits it takes it out of the queue (its count goes back up).
- Only full blocks are cached, and a hit never covers the last prompt token: that token must be
  computed to sample the next one (vLLM's max_cache_hit_length = prompt length - 1).
- Each cached block remembers where its contents came from (BlockOrigin): the writer, its tenant, a
  digest of its salt, and the content key of the contents (its tokens chained to its whole prefix,
  without salt, whatever faults the lookup key had), so a reuse can be checked against what the
  reader would have computed there: same content key and same salt.

Faults (kvtui/faults.py) act here when named in `BlockManager.faults`: `unsalted_prefix` leaves the
salt out of the lookup key, `prefix_key_no_parent` the parent key (the partition, cache_salt and adapter,
then rides in every block's key, so the fault mixes contexts within one partition only); `block_refcount` frees a request's
blocks outright (count to 0) even while another request still holds them; `shared_partial_block`
also caches a prompt's partially filled last block and hands it to the next identical prompt without
copy-on-write; `state_index_units` (hybrids) looks a hit's recurrent-state checkpoint up at a block index
computed in the wrong units (state_at).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from kvtui.engine.fault_acts import FaultActs
from kvtui.faults import FaultName

NULL_BLOCK = 0
NONE_KEY = hashlib.sha256(b"kvtui:prefix-cache:none").digest()  # parent of every first block


def block_key(parent: bytes | None, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> bytes:
    """The prefix-cache key of a block: sha256 of the compact JSON `[parent hex, token ids, extra keys]`
    (parent None: NONE_KEY). A position that holds no token (a supplied embedding row, an image
    position) is keyed by a string naming its contents (RequestState.cache_keys). Stable across
    processes and machines."""
    payload = [(parent or NONE_KEY).hex(), [t if isinstance(t, str) else int(t) for t in token_ids],
               [str(k) for k in extra_keys]]
    return hashlib.sha256(json.dumps(payload, separators=(",", ":")).encode()).digest()


def partition_keys(salt: str | tuple | None) -> tuple[str, ...]:
    """The first block's extra keys for a partition: () for none, (salt,) for a tenant's cache_salt, or the
    items of a tuple (a salt and a LoRA adapter, engine/lora.py prefix_salt), None items as "": a salt
    alone is one key, so no salt string can spell a salt and an adapter."""
    if salt is None:
        return ()
    return tuple("" if s is None else s for s in salt) if isinstance(salt, tuple) else (salt,)


def salt_digest(salt: str | tuple | None) -> str | None:
    """A short public digest of a cache_salt (12 hex digits; None without a salt), for reports."""
    return None if salt is None else hashlib.sha256(f"kvtui:cache_salt:{salt}".encode()).hexdigest()[:12]


def chain_keys(token_ids: Sequence[int], block_size: int, salt: str | None, *, parent: bool = True,
               salted: bool = True) -> list[bytes]:
    """Keys of every full block of `token_ids`, chained: block i's parent is block i-1's key, and the
    first block's extra keys hold the salt. parent=False leaves the parent out (every block keyed by its
    tokens and the salt alone), salted=False the salt."""
    keys: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        extra = partition_keys(salt) if salted and (i == 0 or not parent) else ()
        keys.append(block_key(keys[-1] if keys and parent else None, token_ids[i * block_size:(i + 1) * block_size],
                              extra))
    return keys


def partial_key(token_ids: Sequence[int], block_size: int, salt: str | None, full_keys: list[bytes], *,
                parent: bool = True, salted: bool = True) -> bytes:
    """Key of the partial block after the full ones (token_ids' tail shorter than a block)."""
    n = len(full_keys)
    extra = partition_keys(salt) if salted and (n == 0 or not parent) else ()
    return block_key(full_keys[-1] if full_keys and parent else None, token_ids[n * block_size:], extra)


@dataclass(frozen=True)
class BlockOrigin:
    """Where a cached block's contents came from.

    Attributes:
        writer: the request that computed them; tenant: its tenant; salt: digest of its cache_salt.
        true_key: the content key: the block's tokens chained to its whole prefix (parent keys), no
            salt, no fault; equal true keys mean equal K/V.
        tokens: tokens the block holds (block_size for a full block).
    """

    writer: str
    tenant: str | None
    salt: str | None
    true_key: bytes
    tokens: int


@dataclass
class Block:
    """One KV block: reference count, lookup key while cached, origin of the cached contents."""

    block_id: int
    ref_cnt: int = 0
    key: bytes | None = None
    origin: BlockOrigin | None = None
    tier_key: bytes | None = None  # the offload tier's key of its contents (a full block, tier on)
    state: object | None = None  # hybrids: the recurrent-state checkpoint after this block's last position
    # hybrids: what the block's state memory holds, the last checkpoint written there; unlike `state` it
    # survives the block's eviction, as a pool's bytes do (read only where a fault reads it)
    memory: object | None = None


@dataclass(frozen=True)
class Reuse:
    """One block a prefix-cache hit hands to a request.

    Attributes:
        index: its place in the reader's block table; block_id: the block.
        tokens: tokens of it the reader takes (block_size, fewer for a partial block).
        origin: what the block holds; reader_key: the content key of what the reader would compute
            there; reader_salt: the digest of the reader's salt.
    """

    index: int
    block_id: int
    tokens: int
    origin: BlockOrigin
    reader_key: bytes
    reader_salt: str | None = None
    tier: bool = False  # restored from the offload tier (kvtui/engine/offload.py)

    @property
    def verified(self) -> bool:
        """The reused contents are exactly what the reader would compute (same tokens, same prefix) and
        were computed under the reader's own salt."""
        return self.origin.true_key == self.reader_key and self.origin.salt == self.reader_salt


@dataclass(frozen=True)
class Admission:
    """What admitting a request took: hit_tokens from the prefix cache (reused blocks), the rest new."""

    hit_tokens: int
    reused: tuple[Reuse, ...] = ()


class BlockPool:
    """The blocks, their reference counts, the free queue (LRU order) and the cache map key -> block.

    Args:
        num_blocks: blocks including the null block 0 (so num_blocks - 1 are usable).

    Raises:
        ValueError: fewer than 2 blocks.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"{num_blocks = } must be >= 2 (block 0 is the null block)")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cached: dict[bytes, int] = {}
        self.evictions = 0
        self.evicted: list[tuple[int, bytes, BlockOrigin, object]] = []  # (block, tier key, origin, state) for the tier

    @property
    def num_free(self) -> int:
        """Blocks a new allocation can take (ref count 0, cached or not)."""
        return len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the head of the free queue (count 1 each); a cached one loses its key
        (evicted). Raises RuntimeError when fewer than `n` are free (callers check num_free)."""
        if n > len(self.free_queue):
            raise RuntimeError(f"{n} KV blocks asked for, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            self._evict(self.blocks[block_id])
            self.blocks[block_id].ref_cnt = 1
            out.append(block_id)
        return out

    def _evict(self, block: Block) -> None:
        if block.key is not None:
            if self.cached.get(block.key) == block.block_id:
                del self.cached[block.key]
            self.evictions += 1
            if block.tier_key is not None:
                self.evicted.append((block.block_id, block.tier_key, block.origin, block.state))
        block.key, block.origin, block.tier_key, block.state = None, None, None, None

    def touch(self, block_ids: Sequence[int]) -> None:
        """A hit takes cached blocks: count + 1; a free one leaves the free queue."""
        for b in block_ids:
            self.free_queue.pop(b, None)
            self.blocks[b].ref_cnt += 1

    def free(self, block_ids: Sequence[int], *, outright: bool = False) -> None:
        """Give blocks back, last first: count - 1, into the free queue's tail at 0. outright=True (the
        block_refcount fault) sets the count to 0 whoever else still holds the block."""
        for b in reversed(block_ids):
            block = self.blocks[b]
            block.ref_cnt = 0 if outright else max(block.ref_cnt - 1, 0)
            if block.ref_cnt == 0:
                self.free_queue[b] = None
                self.free_queue.move_to_end(b)

    def cache(self, block_id: int, key: bytes, origin: BlockOrigin, tier_key: bytes | None = None) -> None:
        """Register a written block under `key` (a key already cached keeps its first block); `tier_key`:
        the offload tier's key of its contents, under which an eviction stores it."""
        block = self.blocks[block_id]
        if block.key is not None and self.cached.get(block.key) == block_id:
            del self.cached[block.key]
        block.key, block.origin, block.tier_key = None, None, None
        if key not in self.cached:
            self.cached[key] = block_id
            block.key, block.origin, block.tier_key = key, origin, tier_key


@dataclass
class _Table:
    """One request's blocks and what of them is cached."""

    blocks: list[int]
    salt: str | None
    tenant: str | None
    cached: int = 0  # leading blocks already in the cache map (reused or committed)
    partial_done: bool = False
    cow: set[int] = field(default_factory=set)  # indices of blocks shared by a fork: copied before a write


class BlockManager:
    """Per-request block tables over a BlockPool, with prefix caching and admission by free blocks.

    Args:
        num_blocks: blocks including the null block; block_size: tokens per block (1..64).
        caching: prefix caching on.
        watermark: fraction of the usable blocks admission keeps free (vLLM V0's watermark, 0.01):
            a request is admitted only if at least floor(watermark x usable) blocks stay free after.

    Attributes:
        faults: the fault names acting here (set by the engine each step).
        queries, hits: prefix-cache lookups, in tokens (vLLM's prefix_cache_queries / _hits).
        needs_state: a hit must end at a block holding a recurrent-state checkpoint (Block.state; hybrid
            models, set at build time): a lookup is cut back to the longest such block.
    """

    def __init__(self, num_blocks: int, block_size: int, *, caching: bool = False, watermark: float = 0.0) -> None:
        if not 1 <= block_size <= 64:
            raise ValueError(f"{block_size = } must be in 1..64")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.caching = caching
        self.watermark_blocks = int(watermark * (num_blocks - 1))
        self.faults: frozenset[str] = frozenset()
        self.tables: dict[str, _Table] = {}
        self.queries = self.hits = 0
        self.copies = 0  # copy-on-write block copies made
        self._copies: list[tuple[int, int]] = []  # (source, destination) block copies the pool must make
        self.tier = None  # the offload tier (offload.HostTier: get, put, hits) when engine.kv_offload_blocks > 0
        self.tier_hit_tokens = self.tier_query_tokens = 0  # tokens restored from / asked of the tier
        self._loads: list[tuple[int, object]] = []  # (block, tier entry) restores the pool must make
        self.needs_state = False
        self.acts = FaultActs()  # where the faults act (PagedCache hands the engine's notebook in)

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        """Blocks requests can hold: all but the null block."""
        return len(self.pool.blocks) - 1

    @property
    def num_free(self) -> int:
        """Blocks with reference count 0 (cached or not): what allocation can take."""
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Share of usable blocks in use (vLLM's kv_cache_usage_perc: cached free blocks count as free)."""
        return 1.0 - self.pool.num_free / self.num_usable

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def fits(self, num_tokens: int) -> bool:
        """Whether a request of `num_tokens` tokens can ever run: its blocks within the usable ones
        less the watermark."""
        return self.blocks_for(num_tokens) <= self.num_usable - self.watermark_blocks

    def table(self, request_id: str) -> tuple[int, ...]:
        """The request's block table (block ids in position order). Raises KeyError for an unknown request."""
        return tuple(self.tables[request_id].blocks)

    # -- keys ---------------------------------------------------------------------------------------
    def _lookup_keys(self, token_ids: Sequence[int], salt: str | None) -> list[bytes]:
        """The keys lookups and registrations use (the faults that change keys act here)."""
        return chain_keys(token_ids, self.block_size, salt, parent=FaultName.PREFIX_KEY_NO_PARENT not in self.faults,
                          salted=FaultName.UNSALTED_PREFIX not in self.faults)

    def lookup(self, token_ids: Sequence, salt: str | None, truth_ids: Sequence | None = None) -> list[Reuse]:
        """The longest cached prefix of `token_ids` (no side effects): consecutive full blocks whose
        keys are cached, within len(token_ids) - 1 tokens. `token_ids`: one key item per position (a token
        id, or a string naming what fills a position that is no token: RequestState.cache_keys) as the
        lookup keys them; `truth_ids`: the same positions' true items (default: token_ids)."""
        cap, bs = len(token_ids) - 1, self.block_size
        truth_ids = token_ids if truth_ids is None else truth_ids
        keys, truth = self._lookup_keys(token_ids, salt), chain_keys(truth_ids, bs, None)
        out: list[Reuse] = []
        for i, key in enumerate(keys):
            block_id = self.pool.cached.get(key)
            if (i + 1) * bs > cap or block_id is None:
                break
            out.append(Reuse(i, block_id, bs, self.pool.blocks[block_id].origin, truth[i], salt_digest(salt)))
        if FaultName.SHARED_PARTIAL_BLOCK in self.faults and len(out) == len(keys) and len(token_ids) % bs:
            out += self._partial_hit(token_ids, salt, keys, truth, cap, truth_ids)
        return out

    def _partial_hit(self, token_ids, salt, keys, truth, cap, truth_ids) -> list[Reuse]:
        """shared_partial_block: the cached partial last block of an identical prompt, taken as is."""
        key = partial_key(token_ids, self.block_size, salt, keys, parent=FaultName.PREFIX_KEY_NO_PARENT not in self.faults,
                          salted=FaultName.UNSALTED_PREFIX not in self.faults)
        block_id = self.pool.cached.get(key)
        tokens = cap - len(keys) * self.block_size
        if block_id is None or tokens < 1:
            return []
        return [Reuse(len(keys), block_id, tokens, self.pool.blocks[block_id].origin,
                      partial_key(truth_ids, self.block_size, None, truth), salt_digest(salt))]

    # -- requests -----------------------------------------------------------------------------------
    def admit(self, request_id: str, token_ids: Sequence, *, salt: str | None = None,
              tenant: str | None = None, count_query: bool = True, truth_ids: Sequence | None = None,
              tier_keys: Sequence[bytes] | None = None) -> Admission | None:
        """Give a request the blocks for all of `token_ids` (key items, see lookup; `truth_ids` their true
        items): its cached prefix (prefix caching on), then the blocks after it that the offload tier holds
        under `tier_keys` (restored into new blocks: take_tier_ops), and new blocks for the rest. None when
        that would leave fewer than the watermark's blocks free."""
        truth_ids = token_ids if truth_ids is None else truth_ids
        reused = self.lookup(token_ids, salt, truth_ids) if self.caching else []
        found = self._tier_lookup(reused, len(token_ids), truth_ids, tier_keys)
        if self.needs_state:
            reused, found = self._to_checkpoint(reused, found)
        need = self.blocks_for(len(token_ids)) - len(reused)
        revived = sum(1 for r in reused if self.pool.blocks[r.block_id].ref_cnt == 0)
        if self.pool.num_free - revived - need < self.watermark_blocks:
            return None
        self.pool.touch([r.block_id for r in reused])
        new = self.pool.allocate(need)
        restored = self._restore(found, new, token_ids, salt, tier_keys)
        blocks = [r.block_id for r in reused] + new
        full = sum(1 for r in reused if r.tokens == self.block_size) + len(restored)
        self.tables[request_id] = _Table(blocks, salt, tenant, cached=full)
        hit = sum(r.tokens for r in reused)
        if self.caching and count_query:
            self.queries += len(token_ids)
            self.hits += hit
        if self.tier is not None and count_query:
            self.tier_query_tokens += len(token_ids) - hit
            self.tier_hit_tokens += len(restored) * self.block_size
        return Admission(hit + len(restored) * self.block_size, tuple(reused) + tuple(restored))

    def _to_checkpoint(self, reused: list[Reuse], found: list) -> tuple[list[Reuse], list]:
        """The hit (pool blocks, then tier entries) cut back to its longest prefix whose last block holds a
        recurrent-state checkpoint: a hybrid's state after the hit must come with its K/V."""
        kept = [self.pool.blocks[r.block_id].state is not None for r in reused] + [entry.keeps_state for _, entry, _ in found]
        keep = max((i + 1 for i, state in enumerate(kept) if state), default=0)
        return reused[:keep], found[: max(keep - len(reused), 0)]

    def publish_state(self, request_id: str, index: int, state: object) -> None:
        """Keep `state` (a recurrent-state checkpoint after position (index + 1) x block_size - 1) with block
        `index` of the request's table: it lives, moves to the offload tier and is evicted with that block."""
        table = self.tables.get(request_id)
        if table is not None and index < len(table.blocks):
            block = self.pool.blocks[table.blocks[index]]
            block.state = block.memory = state

    def state_memory(self, request_id: str, index: int) -> object | None:
        """What the state memory of block `index` of the request's table holds (None: nothing, or no such block)."""
        table = self.tables.get(request_id)
        if table is None or not 0 <= index < len(table.blocks):
            return None
        return self.pool.blocks[table.blocks[index]].memory

    def state_at(self, request_id: str, num_tokens: int) -> object | None:
        """The checkpoint kept with the request's block that ends at position num_tokens - 1 (None: none, or
        num_tokens not a block boundary). Under state_index_units the block index is computed in the wrong
        units, (num_tokens - 1) // (block_size // 4) (vLLM's seed divided by a smaller group's block size), and
        the block there gives what its state memory holds (None past the table's end)."""
        if FaultName.STATE_INDEX_UNITS in self.faults:
            return self.state_memory(request_id, (num_tokens - 1) // max(self.block_size // 4, 1))
        table = self.tables.get(request_id)
        index = num_tokens // self.block_size - 1
        if table is None or num_tokens % self.block_size or not 0 <= index < len(table.blocks):
            return None
        return self.pool.blocks[table.blocks[index]].state

    def _tier_lookup(self, reused: list[Reuse], length: int, truth_ids: Sequence,
                     tier_keys: Sequence[bytes] | None) -> list[tuple[int, object, bytes]]:
        """(table index, tier entry, reader's content key) of the consecutive blocks after the pool's
        hit that the offload tier holds, within length - 1 tokens (the last prompt token is computed)."""
        bs = self.block_size
        if self.tier is None or not tier_keys or any(r.tokens != bs for r in reused):
            return []
        truth, found = chain_keys(truth_ids, bs, None), []
        for i in range(len(reused), len(tier_keys)):
            entry = self.tier.get(tier_keys[i]) if (i + 1) * bs <= length - 1 else None
            if entry is None:
                break
            found.append((i, entry, truth[i]))
        return found

    def _restore(self, found: list, new: list[int], token_ids: Sequence, salt: str | None,
                 tier_keys: Sequence[bytes] | None) -> list[Reuse]:
        """The first len(found) new blocks take the tier's entries: cached again under the pool's key,
        queued for the pool to copy in (take_tier_ops)."""
        if not found:
            return []
        keys, out = self._lookup_keys(token_ids, salt), []
        for (i, entry, truth), block_id in zip(found, new):
            self.pool.cache(block_id, keys[i], entry.origin, tier_keys[i])
            self._loads.append((block_id, entry))
            out.append(Reuse(i, block_id, self.block_size, entry.origin, truth, salt_digest(salt), tier=True))
        self.tier.hits += len(out)
        return out

    def mark_foreign(self, block_id: int, writer: str, digest: str) -> None:
        """A cached block turned out to hold other contents than its origin says (a restore from the tier
        wrote other bytes): its origin becomes `writer` and a content key no reader has (from the bytes'
        `digest`), so every later reuse of it shows as unverified, and the tier stores it as such."""
        block = self.pool.blocks[block_id]
        if block.origin is not None:
            foreign = hashlib.sha256(f"kvtui:foreign-contents:{digest}".encode()).digest()
            block.origin = replace(block.origin, writer=writer, true_key=foreign)

    def take_tier_ops(self) -> tuple[list[tuple[int, bytes, BlockOrigin, object]], list[tuple[int, object]]]:
        """What the pool's tensors must do for the offload tier since the last call, in this order: the
        evicted full blocks to store (block, tier key, origin, state checkpoint or None), then the restores
        (block, tier entry)."""
        stores, self.pool.evicted = self.pool.evicted, []
        loads, self._loads = self._loads, []
        return stores, loads

    def ensure(self, request_id: str, num_tokens: int, *, write_from: int | None = None) -> tuple[int, ...] | None:
        """The request's block table, grown to hold `num_tokens` tokens; None when not enough blocks
        are free (the caller preempts someone and tries again). `write_from`: the first position this
        step writes; a block there that a fork still shares is first replaced by a copy (copy-on-write:
        take_copies() lists the copies the KV tensors must make), unless the cow_missing fault is on."""
        table = self.tables[request_id]
        need = max(self.blocks_for(num_tokens) - len(table.blocks), 0)
        shared = self._shared_at(table, write_from)
        if FaultName.COW_MISSING in self.faults:  # it acts where the sound path would copy a shared block
            unshared = self._shared_at(table, write_from, faults=frozenset())
            if unshared is not None:
                self.acts.note(FaultName.COW_MISSING, (request_id,), "block", (table.blocks[unshared],))
        if need + (shared is not None) > self.pool.num_free:
            return None
        if shared is not None:
            self._copy_on_write(table, shared)
        if need > 0:
            table.blocks += self.pool.allocate(need)
        return tuple(table.blocks)

    def _shared_at(self, table: _Table, position: int | None, faults: frozenset | None = None) -> int | None:
        """The table index of the block holding `position` when a fork still shares it (else None), under
        `faults` (default: the manager's)."""
        if position is None or FaultName.COW_MISSING in (self.faults if faults is None else faults):
            return None
        index = position // self.block_size
        if index not in table.cow or index >= len(table.blocks):
            return None
        if self.pool.blocks[table.blocks[index]].ref_cnt <= 1:  # the siblings copied theirs: it is ours alone
            table.cow.discard(index)
            return None
        return index

    def _copy_on_write(self, table: _Table, index: int) -> None:
        old, (new,) = table.blocks[index], self.pool.allocate(1)
        table.blocks[index] = new
        self.pool.free([old])  # the siblings still hold it
        table.cow.discard(index)
        self._copies.append((old, new))
        self.copies += 1

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies ensure() decided since the last call."""
        copies, self._copies = self._copies, []
        return copies

    def fork(self, parent_id: str, child_id: str) -> None:
        """Parallel sampling: `child_id` gets `parent_id`'s block table, every block shared (reference
        count + 1); the partial last block, the only one either will write into, is marked for
        copy-on-write in both tables."""
        parent = self.tables[parent_id]
        self.pool.touch(parent.blocks)
        child = _Table(list(parent.blocks), parent.salt, parent.tenant, cached=parent.cached, partial_done=True)
        self.tables[child_id] = child
        if parent.blocks:
            last = len(parent.blocks) - 1
            parent.cow.add(last)
            child.cow.add(last)

    def free(self, request_id: str) -> None:
        """A finished or preempted request gives its blocks back (no-op for one without blocks)."""
        table = self.tables.pop(request_id, None)
        if table is not None:
            if FaultName.BLOCK_REFCOUNT in self.faults:  # it acts on the blocks others still hold
                held = [b for b in table.blocks if self.pool.blocks[b].ref_cnt > 1]
                if held:
                    self.acts.note(FaultName.BLOCK_REFCOUNT, (request_id,), "block", held)
            self.pool.free(table.blocks, outright=FaultName.BLOCK_REFCOUNT in self.faults)

    def commit(self, request_id: str, token_ids: Sequence, num_tokens: int, *, prompt_len: int,
               truth_ids: Sequence | None = None, tier_keys: Sequence[bytes] | None = None) -> None:
        """After a step: cache the request's blocks now full, `token_ids` being the key items of its
        positions so far (`truth_ids` their true items; default the same) and `num_tokens` of them
        written (prefix caching on; shared_partial_block also caches the partial last block of the
        prompt once it is written). `tier_keys`: the offload tier's keys of the full blocks (tier on)."""
        truth_ids = token_ids if truth_ids is None else truth_ids
        table = self.tables.get(request_id)
        if table is None or not self.caching:
            return
        full = min(num_tokens // self.block_size, len(table.blocks))
        if full > table.cached:
            keys = self._lookup_keys(token_ids[: full * self.block_size], table.salt)
            truth = chain_keys(truth_ids[: full * self.block_size], self.block_size, None)
            for i in range(table.cached, full):
                origin = BlockOrigin(request_id, table.tenant, salt_digest(table.salt), truth[i], self.block_size)
                self.pool.cache(table.blocks[i], keys[i], origin, tier_keys[i] if tier_keys else None)
            table.cached = full
        if FaultName.SHARED_PARTIAL_BLOCK in self.faults and num_tokens == prompt_len and not table.partial_done:
            self._cache_partial(request_id, table, token_ids[:prompt_len], truth_ids[:prompt_len])

    def _cache_partial(self, request_id: str, table: _Table, prompt: Sequence, true_prompt: Sequence) -> None:
        table.partial_done = True
        full = len(prompt) // self.block_size
        if len(prompt) % self.block_size == 0 or full >= len(table.blocks):
            return
        keys = self._lookup_keys(prompt, table.salt)
        key = partial_key(prompt, self.block_size, table.salt, keys, parent=FaultName.PREFIX_KEY_NO_PARENT not in self.faults,
                          salted=FaultName.UNSALTED_PREFIX not in self.faults)
        truth = partial_key(true_prompt, self.block_size, None, chain_keys(true_prompt, self.block_size, None))
        origin = BlockOrigin(request_id, table.tenant, salt_digest(table.salt), truth, len(prompt) % self.block_size)
        self.pool.cache(table.blocks[full], key, origin)

    def state(self) -> str:
        """One character per block: `_` the null block, `.` free, `c` free but cached (evictable),
        `1`-`9` in use by that many requests, `+` by 10 or more."""
        chars = []
        for block in self.pool.blocks:
            if block.block_id == NULL_BLOCK:
                chars.append("_")
            elif block.ref_cnt == 0:
                chars.append("c" if block.key is not None else ".")
            else:
                chars.append(str(block.ref_cnt) if block.ref_cnt < 10 else "+")
        return "".join(chars)
