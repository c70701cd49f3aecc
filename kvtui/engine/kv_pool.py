"""The KV slot pool: preallocated per-layer K and V tensors, one slot per running request.

Layout per layer: keys[layer] and values[layer] are `[num_slots, num_kv_heads, max_len, head_dim]`
in the model dtype. A slot is a request's private region; the free list hands out the lowest free
slot first (deterministic), a finished request returns its slot at once, and the next admitted
request reuses it starting at position 0 (its cache_len resets; the old contents are masked out).

Every write into the K/V tensors goes through a method of the pool (`write`, `allocate`, `copy_prefix`,
`clear_tails`; paged: `write`, `copy_block`, `restore_block`); tests/architecture/test_pool_writes.py scans kvtui/ and
fails on a write anywhere else. Reads happen in attention.py (and in the detectors' observe.py and
the offload tier's offload.py).

Stale bytes never reach a request: a slot's positions past its owner's length hold whatever an earlier
owner (or anything else) left there, NaN and inf included, and the masked attention paths that read
past a row's length (one SDPA call over a span of slots) would turn a masked NaN into a NaN output
(0 x NaN). So before such a read the pool zeroes the positions it will read past each row's length,
unless it already zeroed them for the slot's current owner and nothing was written there since
(`clear_tails`): each position is zeroed at most once per owner in the common case, a cost in
proportion to what is read. Nothing is assumed about memory the pool did not zero itself.

PagedKVPool is the paged alternative (`engine.kv: paged`): blocks of block_size tokens reached
through per-request block tables, whose bookkeeping lives in block_manager.py.
"""

from __future__ import annotations

import heapq

import torch

from kvtui.memory import available_memory_bytes, gib, pool_bytes


def free_device_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation on `device` can take: MemAvailable for the CPU, the CUDA driver's free
    figure for a GPU, None where unknown (no check is made then)."""
    if device.type == "cpu":
        return available_memory_bytes()
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info(device)[0])
    return None


def slot_bytes(num_layers: int, num_kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one slot takes: K and V, every layer: 2 * layers * kv_heads * max_len * head_dim * itemsize."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * max_len * head_dim * itemsize


TAIL_SLACK = 64  # positions zeroed past what a read needs, so a decode step's growing reads zero rarely


class _PoolTensors:
    """The K and V tensors of a pool (`keys`, `values`: one per layer) and the write every forward makes."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def write(self, layer: int, where: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor) -> None:
        """Store one layer's new K and V rows: keys/values [N, Hkv, D] (cast to the pool dtype) at
        [where[i], :, positions[i]] ([N] int64 each: slots and positions, or blocks and offsets)."""
        self.keys[layer][where, :, positions] = keys.to(self.dtype)
        self.values[layer][where, :, positions] = values.to(self.dtype)


class KVPool(_PoolTensors):
    """Preallocated KV cache slots with an owner table and a free list.

    Args:
        num_layers, num_kv_heads, head_dim: from the model config.
        num_slots: slots to allocate; ignored when kv_budget_bytes is given.
        max_len: tokens per slot.
        dtype, device: of the K/V tensors (the model dtype).
        kv_budget_bytes: size the pool by bytes: num_slots = budget // slot_bytes(...).

    Raises:
        ValueError: the budget does not hold even one slot, or the pool does not fit in the device's
            available memory (checked before allocating; an allocation that still fails is turned
            into the same one-line error).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_slots: int,
        max_len: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        kv_budget_bytes: int | None = None,
    ) -> None:
        per_slot = slot_bytes(num_layers, num_kv_heads, max_len, head_dim, dtype)
        if kv_budget_bytes is not None:
            num_slots = kv_budget_bytes // per_slot
            if num_slots < 1:
                raise ValueError(
                    f"kv_budget_bytes={kv_budget_bytes} holds no slot: one slot of max_len={max_len} "
                    f"needs {per_slot} bytes; raise the budget or lower max_len"
                )
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_slots = num_slots
        self.max_len = max_len
        self.dtype = dtype
        self.device = torch.device(device)
        self.bytes_per_slot = per_slot
        self._allocate(kv_budget_bytes)
        # cache_len each slot's last owner left behind (what the stale_slot fault wrongly keeps)
        self.last_len = [0] * num_slots
        self.owner: list[str | None] = [None] * num_slots
        # previous owner of each slot, kept after free, so a reuse can be reported (and faults can misuse it)
        self.previous_owner: list[str | None] = [None] * num_slots
        self.times_used = [0] * num_slots
        self._free = list(range(num_slots))
        heapq.heapify(self._free)

    def _allocate(self, kv_budget_bytes: int | None) -> None:
        need = pool_bytes(self.num_slots, self.max_len, self.bytes_per_slot)
        size = f"KV pool of {self.num_slots} slots x {self.max_len} tokens"
        fix = ("lower engine.kv_budget_bytes" if kv_budget_bytes is not None
               else "lower engine.slots or engine.max_len")
        free = free_device_bytes(self.device)
        if free is not None and need > free:
            raise ValueError(f"{size} needs {gib(need)}, more than the {gib(free)} of {self.device.type} "
                             f"memory available; {fix}")
        shape = (self.num_slots, self.num_kv_heads, self.max_len, self.head_dim)
        try:
            self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
            self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
            # who last wrote each position: a request serial, -1 never written (see observe.py); CPU bookkeeping
            self.writer = torch.full((self.num_slots, self.max_len), -1, dtype=torch.long)
            # per slot, [lo, hi): positions the pool zeroed for the slot's current owner (clear_tails)
            self._zeroed = [(0, 0)] * self.num_slots
            # per slot, 1 + the highest position written since its owner took it or since clear_tails last zeroed
            # from that owner's length (write keeps it); a write past the owner's length makes this larger
            self._top = torch.zeros(self.num_slots, dtype=torch.long, device=self.device)
            self._last_write: tuple | None = None  # the index tensors write() last accounted for
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            self.keys = self.values = []
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            raise ValueError(f"{size} ({gib(need)}) could not be allocated ({reason}); {fix}") from None

    @property
    def nbytes(self) -> int:
        """Bytes held by all K and V tensors."""
        return self.bytes_per_slot * self.num_slots

    @property
    def capacity_tokens(self) -> int:
        return self.num_slots * self.max_len

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self, request_id: str, *, fresh: bool = False) -> int:
        """Give the lowest free slot to `request_id` and return its index.

        fresh=True replaces the slot's tensors with newly allocated zeros (the "allocate a new cache per
        request" mode, to compare against reuse).

        Raises:
            RuntimeError: no slot is free (the scheduler checks num_free first).
        """
        if not self._free:
            raise RuntimeError("no free KV slot")
        slot = heapq.heappop(self._free)
        self.owner[slot] = request_id
        self.times_used[slot] += 1
        self._zeroed[slot] = (0, 0)  # nothing in a newly taken slot is known: clear_tails zeroes what is read
        self._top[slot] = 0
        if fresh:
            shape = (self.num_kv_heads, self.max_len, self.head_dim)
            for layer in range(self.num_layers):
                self.keys[layer][slot] = torch.zeros(shape, dtype=self.dtype, device=self.device)
                self.values[layer][slot] = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.writer[slot] = -1
            self.last_len[slot] = 0
            self._zeroed[slot] = (0, self.max_len)
        return slot

    def write(self, layer: int, where: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor) -> None:
        """Store one layer's new K and V rows: keys/values [N, Hkv, D] at [where[i], :, positions[i]] (slots
        and positions, [N] int64 each), and note per slot the highest position written, so clear_tails
        knows when a write landed past an owner's length (the fp16_cache fault's pads, a shared_cache or
        racy_threads step's writes into another request's slot). The note is taken once per pair of index
        tensors: every layer of a step writes through the same pair."""
        if self._last_write is None or self._last_write[0] is not where or self._last_write[1] is not positions:
            self._last_write = (where, positions)  # held, so a new pair never reuses these objects' ids
            if len(positions):
                self._top.scatter_reduce_(0, where.to(self._top.device), positions.to(self._top.device) + 1, "amax")
        super().write(layer, where, positions, keys, values)

    def clear_tails(self, rows, k_len: int) -> None:
        """Make positions end .. k_len - 1 of each (slot, end) in `rows` hold zeros in every layer's K and V
        before a read that covers them masked (end: the slot's owner's length after this step's writes).

        A masked key adds exactly nothing only when its K and V are finite (softmax gives it probability 0,
        and 0 x NaN is NaN), and a slot holds there whatever an earlier owner, or anything else, left. The
        pool zeroes such a range once per owner and extends it as the reads grow (TAIL_SLACK positions
        ahead, at most max_len), and zeroes again from `end` when anything was written at or past `end`
        since. Zeroed positions are tagged never written (-1). Positions below `end` are the owner's own
        and are never touched."""
        top = None
        for slot, end in rows:
            if end >= k_len:
                continue
            lo, hi = self._zeroed[slot]
            if top is None:
                top = self._top.tolist()
            if lo <= end <= hi and top[slot] <= end:  # [end, hi) still zero
                if k_len <= hi:
                    continue
                start = hi
            else:
                lo, start = end, end
            stop = min(self.max_len, k_len + TAIL_SLACK)
            for keys, values in zip(self.keys, self.values):
                keys[slot, :, start:stop] = 0
                values[slot, :, start:stop] = 0
            self.writer[slot, start:stop] = -1
            self._zeroed[slot] = (lo, stop)
            self._top[slot] = top[slot] = min(top[slot], end)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Copy positions 0 .. length - 1 of slot `src` (K, V of every layer, and their writer tags)
        into slot `dst` (parallel sampling: a forked sequence's own copy of the prompt's KV)."""
        for keys, values in zip(self.keys, self.values):
            keys[dst, :, :length] = keys[src, :, :length]
            values[dst, :, :length] = values[src, :, :length]
        self.writer[dst, :length] = self.writer[src, :length]

    def free(self, slot: int, cache_len: int = 0) -> None:
        """Return `slot` to the free list. Its contents stay; the next owner starts at cache_len 0.
        `cache_len` (tokens) is what the owner left, kept in last_len.

        Raises:
            ValueError: the slot is already free.
        """
        if self.owner[slot] is None:
            raise ValueError(f"slot {slot} is already free")
        self.last_len[slot] = cache_len
        self.previous_owner[slot] = self.owner[slot]
        self.owner[slot] = None
        heapq.heappush(self._free, slot)


def block_bytes(num_layers: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes: K and V, every layer: 2 * layers * kv_heads * block_size * head_dim * itemsize."""
    return slot_bytes(num_layers, num_kv_heads, block_size, head_dim, dtype)


class PagedKVPool(_PoolTensors):
    """Preallocated KV blocks, addressed through per-request block tables (kvtui.engine.block_manager).

    Layout per layer: keys[layer] and values[layer] are `[num_blocks, num_kv_heads, block_size,
    head_dim]` in the model dtype; token position p of a request is at (table[p // block_size],
    p % block_size). Block 0 is the null block (never handed out). `writer` [num_blocks, block_size]
    tags each block position with the serial of the request that last wrote it (-1 never written),
    as KVPool does per slot position, for the slot_taint and attention_flow detectors.

    Args:
        num_layers, num_kv_heads, head_dim: from the model config.
        num_blocks: blocks including the null block; ignored when kv_budget_bytes is given
            (then num_blocks = budget // block_bytes(...)).
        block_size: tokens per block; max_len: tokens one request may hold.
        dtype, device: of the K/V tensors.

    Raises:
        ValueError: the pool does not hold one request of max_len tokens, or does not fit in the
            device's available memory (one line each).
    """

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 max_len: int, dtype: torch.dtype, device: str | torch.device = "cpu",
                 kv_budget_bytes: int | None = None) -> None:
        self.bytes_per_block = block_bytes(num_layers, num_kv_heads, block_size, head_dim, dtype)
        if kv_budget_bytes is not None:
            num_blocks = kv_budget_bytes // self.bytes_per_block
        need = -(-max_len // block_size) + 1
        if num_blocks < need:
            fix = "raise engine.kv_budget_bytes" if kv_budget_bytes is not None else "raise engine.num_blocks"
            raise ValueError(f"a paged KV pool of {num_blocks} blocks of {block_size} tokens cannot hold one request "
                             f"of max_len={max_len} (needs {need} blocks with the null block); {fix} or lower max_len")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_blocks, self.block_size, self.max_len = num_blocks, block_size, max_len
        self.dtype, self.device = dtype, torch.device(device)
        self._allocate(kv_budget_bytes)

    def _allocate(self, kv_budget_bytes: int | None) -> None:
        need = pool_bytes(self.num_blocks, self.block_size, self.bytes_per_block)
        size = f"paged KV pool of {self.num_blocks} blocks x {self.block_size} tokens"
        fix = "lower engine.kv_budget_bytes" if kv_budget_bytes is not None else "lower engine.num_blocks"
        free = free_device_bytes(self.device)
        if free is not None and need > free:
            raise ValueError(f"{size} needs {gib(need)}, more than the {gib(free)} of {self.device.type} "
                             f"memory available; {fix}")
        shape = (self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim)
        try:
            self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
            self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
            self.writer = torch.full((self.num_blocks, self.block_size), -1, dtype=torch.long)
        except (RuntimeError, MemoryError) as e:
            self.keys = self.values = []
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            raise ValueError(f"{size} ({gib(need)}) could not be allocated ({reason}); {fix}") from None

    @property
    def nbytes(self) -> int:
        """Bytes held by all K and V tensors."""
        return self.bytes_per_block * self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        """Tokens the usable blocks hold (the null block excluded)."""
        return (self.num_blocks - 1) * self.block_size

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block `src` (K, V of every layer, and its writer tags) into block `dst`: copy-on-write of
        a block forked sequences share."""
        for keys, values in zip(self.keys, self.values):
            keys[dst] = keys[src]
            values[dst] = values[src]
        self.writer[dst] = self.writer[src]

    def restore_block(self, block: int, data: torch.Tensor, tags: list[int]) -> None:
        """Write `data` [layers, 2, Hkv, block_size, D] (K then V of every layer, head-major) into block
        `block`, and its writer tags (the KV offload tier's restore, engine/offload.py)."""
        for layer, (keys, values) in enumerate(zip(self.keys, self.values)):
            keys[block] = data[layer, 0].to(keys.device, keys.dtype)
            values[block] = data[layer, 1].to(values.device, values.dtype)
        self.writer[block] = torch.tensor(tags, dtype=self.writer.dtype)
