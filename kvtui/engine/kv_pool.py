"""The KV slot pool: preallocated per-layer K and V tensors, one slot per running request.

Layout per layer: keys[layer] and values[layer] are `[num_slots, num_kv_heads, max_len, head_dim]`
in the model dtype. A slot is a request's private region; the free list hands out the lowest free
slot first (deterministic), a finished request returns its slot at once, and the next admitted
request reuses it starting at position 0 (its cache_len resets; the old contents are masked out).

Only plain Python bookkeeping lives here besides the two tensor lists; reads and writes of the
tensors happen in runner.py.

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


class KVPool:
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
            # per layer: True while every K and V value in the pool is finite (zeros at first; every write
            # goes through PooledCacheLayer.update, which clears the flag for good on a non-finite one)
            self.finite = [True] * self.num_layers
            # who last wrote each position: a request serial, -1 never written (see observe.py); CPU bookkeeping
            self.writer = torch.full((self.num_slots, self.max_len), -1, dtype=torch.long)
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
        if fresh:
            shape = (self.num_kv_heads, self.max_len, self.head_dim)
            for layer in range(self.num_layers):
                self.keys[layer][slot] = torch.zeros(shape, dtype=self.dtype, device=self.device)
                self.values[layer][slot] = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.writer[slot] = -1
            self.last_len[slot] = 0
        return slot

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


class PagedKVPool:
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
            # per layer: True while every K and V value in the pool is finite (zeros at first; every write
            # goes through PooledCacheLayer.update, which clears the flag for good on a non-finite one)
            self.finite = [True] * self.num_layers
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
