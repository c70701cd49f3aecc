"""The KV offload tier: a bounded host-memory store under the paged prefix cache (`engine.kv_offload_blocks`).

What LMCache's CPU backend, vLLM's OffloadingConnector and SGLang's hierarchical cache do, in small:

- When the block pool evicts a cached full block (a new allocation takes it from the free queue), its K/V
  of every layer, its writer tags and its origin are first copied into the tier, keyed by the tier's own
  key. The tier holds at most `capacity` blocks and drops the least recently used entry beyond that.
- When a request's prefix lookup stops at a block the pool no longer holds, the following blocks are
  looked up in the tier, in chain order; each one found is copied back into a newly allocated block,
  registered in the pool's prefix cache again, and counted as cached (the request's prefill starts after it).
- The tier stores a block token-major, `[layers, 2 (K, V), block_size, kv_heads, head_dim]`, as the
  connectors' host buffers do; the pool is head-major `[kv_heads, block_size, head_dim]` per layer, so a
  store and a restore convert.
- The tier's key is the block's full prefix-cache key: its tokens chained to the whole prefix, and in the
  first block the partition the engine's own key carries (the tenant's cache_salt; image and supplied
  embedding positions keyed by their contents, not their placeholder ids).
- A hybrid model's block carries the recurrent-state checkpoint after its last position (Block.state); the
  tier stores it beside the block's K/V and a restore hands it back with them (`store`, `restore`), so a
  hit from the tier restores the request's state too.
- Each entry keeps a sha256 digest of the bytes it was stored from; a restore compares the pool block's
  bytes with it afterwards, so a restore that delivers other bytes is reported (StepEvent.prefix_hits:
  `tier`, `intact`, `found_writer`), for prefix_provenance to name.

Faults (kvtui/faults.py), as reported against shipped tiers:
- `tier_key_drops_partition`: the tier's key is the token ids alone: no salt, and image or embedding
  positions keyed by their placeholder ids, so another tenant's or another picture's blocks come back.
- `tier_layout_mismatch`: a restore reads the token-major entry as if it were head-major (no transpose),
  well-formed tensors holding the wrong numbers.
- `tier_partial_load`: a restore of k blocks copies k - 1; the request still counts all k as cached and
  does not recompute the gap, so it reads whatever the last block's previous owner left there.
- `tier_drops_recurrent_state` (hybrids, sglang #39830): an entry keeps the block's K/V but not its state
  checkpoint, only how many positions it covered; the checkpoint goes to the tier's one state buffer
  (`HostTier.state_buffer`), which every store overwrites, and a restore hands back what that buffer holds:
  the state of the last block stored, another prefix's.

Only the PagedCache (paged.py) calls this module; the BlockManager's bookkeeping stays torch-free and
sees HostTier through `get` and `put`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtui.engine.block_manager import BlockOrigin, chain_keys
from kvtui.faults import FaultName


@dataclass
class TierEntry:
    """One block held by the tier.

    Attributes:
        origin: where its contents came from (the pool's BlockOrigin when it was stored).
        data: [layers, 2, block_size, kv_heads, head_dim] K and V, the tier's token-major layout.
        tags: the pool's writer tags of the block's positions (request serials), [block_size].
        digest: sha256 hex of the pool-layout bytes it was stored from (KVBlockBytes).
        state: a hybrid's recurrent-state checkpoint kept with the block (state_pool.StateCheckpoint), or None.
        state_tokens: the positions of the checkpoint the block had when it was stored without it
            (tier_drops_recurrent_state), else None.
    """

    origin: BlockOrigin
    data: torch.Tensor
    tags: list[int]
    digest: str
    state: object | None = None
    state_tokens: int | None = None

    @property
    def keeps_state(self) -> bool:
        """Whether the tier says it holds the block's state checkpoint (a hit may end at it)."""
        return self.state is not None or self.state_tokens is not None


class HostTier:
    """A bounded LRU map tier key -> TierEntry, with counters (blocks).

    Args:
        capacity: the most blocks it holds (>= 1).

    Attributes:
        stores, hits, evictions: blocks stored, restored, dropped for room, over the tier's life.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"{capacity = } must be >= 1")
        self.capacity = capacity
        self.entries: OrderedDict[bytes, TierEntry] = OrderedDict()
        self.stores = self.hits = self.evictions = 0
        self.state_buffer = None  # tier_drops_recurrent_state: the one state checkpoint every store overwrites

    def get(self, key: bytes) -> TierEntry | None:
        """The entry under `key` (now the most recently used), or None."""
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def put(self, key: bytes, entry: TierEntry) -> None:
        """Store `entry` under `key` (replacing one there), dropping least recently used entries past capacity."""
        self.entries[key] = entry
        self.entries.move_to_end(key)
        self.stores += 1
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
            self.evictions += 1

    def __len__(self) -> int:
        return len(self.entries)


def check_host_memory(blocks: int, bytes_per_block: int) -> int:
    """`blocks` when a full tier of them fits in the host's available memory (the tier fills as the pool
    evicts, so a run would otherwise be killed partway). Raises ValueError naming the fix."""
    from kvtui.engine.kv_pool import free_device_bytes
    from kvtui.memory import gib

    need, free = blocks * bytes_per_block, free_device_bytes(torch.device("cpu"))
    if free is not None and need > free:
        raise ValueError(f"a KV offload tier of {blocks} blocks needs {gib(need)} of host memory, more than the "
                         f"{gib(free)} available; lower engine.kv_offload_blocks (--kv-offload-blocks)")
    return blocks


def tier_keys(true_items: Sequence, token_ids: Sequence[int], block_size: int, salt: str | None,
              faults: frozenset[str]) -> list[bytes]:
    """The tier's key of each full block of a request's positions.

    Args:
        true_items: one prefix-cache key item per position, with no fault (RequestState.cache_keys).
        token_ids: the positions' token ids (placeholder ids at image and embedding positions).
        salt: the partition the pool's own key carries in its first block (the request's cache_salt).
        faults: under tier_key_drops_partition the key is the token ids alone.
    """
    if FaultName.TIER_KEY_DROPS_PARTITION in faults:
        return chain_keys(token_ids, block_size, None)
    return chain_keys(true_items, block_size, salt)


def block_bytes_digest(pool, block: int) -> str:
    """sha256 hex over block `block`'s K and V in every layer of a PagedKVPool, in pool layout."""
    h = hashlib.sha256()
    for keys, values in zip(pool.keys, pool.values):
        h.update(keys[block].contiguous().cpu().view(torch.uint8).numpy().tobytes())
        h.update(values[block].contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def store(pool, block: int, origin: BlockOrigin, state=None, *, tier: HostTier | None = None,
          faults: frozenset[str] = frozenset()) -> TierEntry:
    """Copy pool block `block` (K, V of every layer, writer tags) out into a new TierEntry, token-major, with
    the block's recurrent-state checkpoint `state` (hybrids; None otherwise) beside them. Under
    tier_drops_recurrent_state the checkpoint goes to `tier`'s one state buffer instead, and the entry keeps
    only its positions."""
    data = torch.stack([torch.stack((k[block], v[block])) for k, v in zip(pool.keys, pool.values)])  # [L, 2, H, B, D]
    entry = TierEntry(origin, data.transpose(2, 3).contiguous().cpu(), pool.writer[block].tolist(),
                      block_bytes_digest(pool, block), state)
    if state is not None and tier is not None and FaultName.TIER_DROPS_RECURRENT_STATE in faults:
        tier.state_buffer = state
        entry.state, entry.state_tokens = None, state.num_tokens
    return entry


def restore(pool, entry: TierEntry, block: int, faults: frozenset[str], tier: HostTier | None = None):
    """Copy `entry` into pool block `block` (K, V of every layer and the writer tags); returns the recurrent-state
    checkpoint stored with it (None for a model without one), for the block to keep. Under
    tier_layout_mismatch the token-major data is read as head-major: reshaped, not transposed. An entry
    stored without its checkpoint (tier_drops_recurrent_state) gives what `tier`'s state buffer holds, kept
    under the entry's positions."""
    layers, _, size, heads, dim = entry.data.shape
    if FaultName.TIER_LAYOUT_MISMATCH in faults:
        data = entry.data.reshape(layers, 2, heads, size, dim)
    else:
        data = entry.data.transpose(2, 3)
    pool.restore_block(block, data, entry.tags)
    if entry.state is None and entry.state_tokens is not None and tier is not None and tier.state_buffer is not None:
        return tier.state_buffer.relabeled(entry.state_tokens, entry.origin.writer)
    return entry.state
