"""Padded and packed layouts: the model inputs, position ids, 4D masks and KV read/write maps.

Both layouts read keys through one gather map: row r's key column k is pool[key_slot[r, k], :,
key_pos[r, k]]; the new tokens' K/V are first written to pool[write_slot[i], :, write_pos[i]].
The attention mask decides which gathered keys each query may see. With paged KV (chunks carry
block tables) the same maps hold block addresses: a position p of a request is (table[p //
block_size], p % block_size) in the pool's [blocks, heads, block_size, head_dim] tensors, and cache
padding points at the null block 0.

padded: one row per request, right- or left-padded to the longest chunk. Row b's keys are its own
    slot's positions 0 .. K-1 (K = the longest end); columns end_b .. K-1 are cache padding; query token t (at position
    start_b + t) may see keys 0 .. start_b + t. The mask hides input padding (pad query rows see
    nothing) and cache padding (key columns >= end_b).
packed: one row holding every request's tokens back to back; keys are each request's positions
    0 .. end_b-1 concatenated. The mask is block-diagonal and causal within each block.

Faults (kvtui/faults.py) change these tables where named: shared_cache maps every request to
slot 0; shared_position_offset takes position ids from a batch-wide counter; causal_offset builds the
causal part as key index <= query index; unmasked_cache_padding leaves cache padding visible;
no_request_mask drops the block-diagonal part of the packed mask; fp16_cache also writes pad rows.

Mask values: 0.0 where allowed, torch.finfo(dtype).min where not (finite, so a fully masked pad
row gives uniform weights, not NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtui.engine.block_manager import NULL_BLOCK
from kvtui.engine.scheduler import ScheduledChunk, StepPlan
from kvtui.faults import FaultName

PAD_OWNER = -1


@dataclass(frozen=True)
class Segment:
    """One chunk's place in a batch.

    Attributes:
        row: its row of input_ids.
        q_start, num_tokens: its query columns q_start .. q_start + num_tokens - 1 (tokens).
        slot: the KV slot its keys are read from and written to; None with paged KV.
        start_pos, end_pos: positions of its fed tokens (cache_len before and after the step).
        key_start: the key column of its position 0 in the row (0 padded; its offset packed).
        blocks: paged KV: the blocks holding its positions 0 .. end_pos - 1, in order; None with slots.
        state_slot: a hybrid model's recurrent-state slot (ScheduledChunk.state_slot); None without one.
    """

    row: int
    q_start: int
    num_tokens: int
    slot: int | None
    start_pos: int
    end_pos: int
    key_start: int
    blocks: tuple[int, ...] | None = None
    state_slot: int | None = None


@dataclass(frozen=True)
class BatchStats:
    """How much one step computed, pads included, for the step report and the virtual clock.

    Attributes:
        rows: rows of the model input (requests in the padded layout, 1 packed, 0 idle).
        query_positions: query positions computed, pads included (tokens).
        padded_positions: query positions that were padding (tokens).
        key_cells: keys attention reads: each chunk's own positions 0 .. end-1, summed over chunks (the
            cost model's keys; cache padding is not read, so it costs nothing here).
        key_positions: real query tokens x key columns of their row (mask cells of real queries).
        key_padded_positions: of those, cells whose key is not the query's own request's.
    """

    rows: int = 0
    query_positions: int = 0
    padded_positions: int = 0
    key_cells: int = 0
    key_positions: int = 0
    key_padded_positions: int = 0

    @staticmethod
    def total(parts: "list[BatchStats]") -> "BatchStats":
        """The sum of several batches' figures (racy_threads runs one batch per request)."""
        return BatchStats(*(sum(getattr(p, f) for p in parts) for f in BatchStats.__dataclass_fields__))


@dataclass
class BatchTensors:
    """Tensors for one forward pass (R rows, Q query columns, K key columns, N real tokens).

    Attributes:
        input_ids: [R, Q] int64; pads hold pad_token_id.
        position_ids: [R, Q] int64; pads hold 0.
        allowed: [R, Q, K] bool, True where a query may attend to a key.
        write_row, write_col: [N] int64, where each real token sits in input_ids.
        write_slot, write_pos: [N] int64, where its K/V go in the pool.
        key_slot, key_pos: [R, K] int64, where each key column is read from.
        key_owner: [R, K] int64, chunk index owning each key column, PAD_OWNER for padding.
        query_owner: [R, Q] int64, chunk index of each query position, PAD_OWNER for padding.
        sample_row, sample_col: [S] int64, the last token of each chunk that samples (chunk order).
        sample_chunk: list of chunk indices, aligned with sample_row.
        padded_positions: query positions that are padding (tokens).
        key_padded_positions: sum over real query positions of key columns not owned by the
            query's own request (cache padding, other requests' blocks).
        segments: one Segment per chunk (chunk order): where its queries and its own keys are.
        pad_write_*: [P] int64, pad cells whose K/V are cached too (fp16_cache fault only), else None.
        splice_row, splice_col: [M] int64, query cells whose input embedding is a supplied row (prompt
            embeddings, image features: ScheduledChunk.spliced), and splice_values [M, hidden] those rows;
            None when the batch splices nothing.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    allowed: torch.Tensor
    write_row: torch.Tensor
    write_col: torch.Tensor
    write_slot: torch.Tensor
    write_pos: torch.Tensor
    key_slot: torch.Tensor
    key_pos: torch.Tensor
    key_owner: torch.Tensor
    query_owner: torch.Tensor
    sample_row: torch.Tensor
    sample_col: torch.Tensor
    sample_chunk: list[int]
    padded_positions: int
    key_padded_positions: int
    segments: tuple[Segment, ...] = ()
    pad_write_row: torch.Tensor | None = None
    pad_write_col: torch.Tensor | None = None
    pad_write_slot: torch.Tensor | None = None
    pad_write_pos: torch.Tensor | None = None
    splice_row: torch.Tensor | None = None
    splice_col: torch.Tensor | None = None
    splice_values: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def query_positions(self) -> int:
        return self.input_ids.numel()

    @property
    def stats(self) -> BatchStats:
        """This batch's figures (see BatchStats)."""
        rows, k_len = self.key_slot.shape
        real = self.query_positions - self.padded_positions
        return BatchStats(rows=self.rows, query_positions=self.query_positions,
                          padded_positions=self.padded_positions,
                          key_cells=sum(s.end_pos for s in self.segments) if self.segments else rows * k_len,
                          key_positions=real * k_len, key_padded_positions=self.key_padded_positions)

    def additive_mask(self, dtype: torch.dtype, masked_value: float | None = None) -> torch.Tensor:
        """[R, 1, Q, K] additive mask in `dtype`: 0 allowed, finfo(dtype).min (or masked_value) not."""
        fill = torch.finfo(dtype).min if masked_value is None else masked_value
        mask = torch.zeros(self.allowed.shape, dtype=dtype)
        mask.masked_fill_(~self.allowed, fill)
        return mask.unsqueeze(1)


def _tensor(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


class _Tables:
    """Accumulates one batch's tables chunk by chunk (see BatchTensors for each table)."""

    def __init__(self, rows: int, q_len: int, k_len: int, pad_token_id: int, block_size: int | None = None) -> None:
        self.block_size = block_size
        self.input_ids = torch.full((rows, q_len), pad_token_id, dtype=torch.long)
        self.position_ids = torch.zeros((rows, q_len), dtype=torch.long)
        self.allowed = torch.zeros((rows, q_len, k_len), dtype=torch.bool)
        self.query_owner = torch.full((rows, q_len), PAD_OWNER, dtype=torch.long)
        self.key_slot = torch.zeros((rows, k_len), dtype=torch.long)
        self.key_pos = torch.zeros((rows, k_len), dtype=torch.long)
        self.key_owner = torch.full((rows, k_len), PAD_OWNER, dtype=torch.long)
        self.writes: list[list[int]] = [[], [], [], []]  # row, col, slot, pos
        self.pad_writes: list[list[int]] = [[], [], [], []]
        self.samples: list[list[int]] = [[], [], []]  # row, col, chunk
        self.splices: list[tuple[int, list[int], torch.Tensor]] = []  # row, columns, rows [m, hidden]
        self.segments: list[Segment] = []
        self.key_padded = 0

    def add(self, index: int, chunk: ScheduledChunk, row: int, q0: int, k0: int, counter: int,
            faults: frozenset) -> None:
        """Place chunk `index` at query columns q0.. of `row`, its keys (positions 0..end-1 of its slot)
        at key columns k0.. of the row; `counter` is the batch-wide position counter of
        shared_position_offset."""
        n, end = chunk.num_tokens, chunk.end_pos
        cols = torch.arange(q0, q0 + n)
        positions = torch.arange(chunk.start_pos, end)
        slot = 0 if FaultName.SHARED_CACHE in faults else chunk.slot
        self.input_ids[row, cols] = torch.tensor(chunk.token_ids, dtype=torch.long)
        shifted = FaultName.SHARED_POSITION_OFFSET in faults
        self.position_ids[row, cols] = counter + torch.arange(n) if shifted else positions
        self.query_owner[row, cols] = index
        where, offset, blocks = self._addresses(chunk, slot)
        self.key_slot[row, k0 : k0 + end] = where
        self.key_pos[row, k0 : k0 + end] = offset
        self.key_owner[row, k0 : k0 + end] = index
        # a query at position p sees keys 0..p of its own request (causal_offset: 0..t, its index)
        seen = torch.arange(n) if FaultName.CAUSAL_OFFSET in faults else positions
        self.allowed[row, q0 : q0 + n, k0 : k0 + end] = torch.arange(end)[None, :] <= seen[:, None]
        if blocks is None:
            written = ([slot] * n, positions.tolist())
        else:
            written = (where[chunk.start_pos:].tolist(), offset[chunk.start_pos:].tolist())
        for table, values in zip(self.writes, ([row] * n, cols.tolist(), *written)):
            table += values
        if chunk.spliced is not None:
            offsets, values = chunk.spliced
            self.splices.append((row, [q0 + o for o in offsets], values))
        if chunk.samples:
            for table, value in zip(self.samples, (row, q0 + n - 1, index)):
                table.append(value)
        self.segments.append(Segment(row, q0, n, slot if blocks is None else None, chunk.start_pos, end, k0, blocks,
                                     chunk.state_slot))
        self.key_padded += n * (self.allowed.shape[2] - end)

    def _addresses(self, chunk: ScheduledChunk, slot: int) -> tuple:
        """Where positions 0 .. end_pos - 1 of the chunk's request live: (slot or block [end], position or
        offset [end], the blocks used or None). Slots: its slot and the positions themselves; paged:
        (table[p // block_size], p % block_size)."""
        positions = torch.arange(chunk.end_pos)
        if chunk.blocks is None:
            return slot, positions, None
        bs = self.block_size
        used = chunk.blocks[: -(-chunk.end_pos // bs)]
        return torch.tensor(used, dtype=torch.long)[positions // bs], positions % bs, used

    def add_pad_writes(self, row: int, cols: list[int], slot: int, first_pos: int, max_len: int | None) -> None:
        """fp16_cache: a naive padded cache stores whole rows, so pad cells land after the row's tokens."""
        for j, col in enumerate(cols):
            if max_len is None or first_pos + j < max_len:
                for table, value in zip(self.pad_writes, (row, col, slot, first_pos + j)):
                    table.append(value)

    def build(self, padded_positions: int) -> BatchTensors:
        pads = {}
        if self.pad_writes[0]:
            pads = dict(zip(("pad_write_row", "pad_write_col", "pad_write_slot", "pad_write_pos"),
                            map(_tensor, self.pad_writes)))
        if self.splices:
            pads |= dict(splice_row=_tensor([r for r, cols, _ in self.splices for _ in cols]),
                         splice_col=_tensor([c for _, cols, _ in self.splices for c in cols]),
                         splice_values=torch.cat([v for _, _, v in self.splices]))
        row, col, chunk = self.samples
        return BatchTensors(self.input_ids, self.position_ids, self.allowed, *map(_tensor, self.writes),
                            self.key_slot, self.key_pos, self.key_owner, self.query_owner, _tensor(row), _tensor(col),
                            chunk, padded_positions=padded_positions, key_padded_positions=self.key_padded,
                            segments=tuple(self.segments), **pads)


def _pad_addresses(blocks: tuple[int, ...], end: int, k_len: int, block_size: int):
    """Paged KV: (block [k_len - end], offset) of cache-padding columns end .. k_len - 1: on through the
    request's own block table (what a block's earlier user left there), the null block past its end.
    Masked out unless unmasked_cache_padding is on."""
    positions = torch.arange(end, k_len)
    table = torch.tensor(blocks + (NULL_BLOCK,), dtype=torch.long)
    return table[(positions // block_size).clamp(max=len(blocks))], positions % block_size


def build_padded(plan: StepPlan, *, padding_side: str = "right", pad_token_id: int = 0,
                 faults: frozenset = frozenset(), max_len: int | None = None,
                 block_size: int | None = None) -> BatchTensors:
    """Padded layout for `plan`: one row per chunk. See the module docstring."""
    chunks = plan.chunks
    counter = max(c.start_pos for c in chunks)  # the batch-wide counter of shared_position_offset
    q_len, k_len = max(c.num_tokens for c in chunks), max(c.end_pos for c in chunks)
    tables = _Tables(len(chunks), q_len, k_len, pad_token_id, block_size)
    for b, chunk in enumerate(chunks):
        offset = q_len - chunk.num_tokens if padding_side == "left" else 0
        tables.add(b, chunk, b, offset, 0, counter, faults)
        if FaultName.UNMASKED_CACHE_PADDING in faults:
            tables.allowed[b, offset : offset + chunk.num_tokens, chunk.end_pos :] = True
        if FaultName.FP16_CACHE in faults:
            pad_cols = [c for c in range(q_len) if not offset <= c < offset + chunk.num_tokens]
            tables.add_pad_writes(b, pad_cols, tables.segments[-1].slot, chunk.end_pos, max_len)
        if chunk.blocks is None:
            tables.key_slot[b, chunk.end_pos :] = tables.segments[-1].slot  # the slot's region beyond end_b
            tables.key_pos[b, chunk.end_pos :] = torch.arange(chunk.end_pos, k_len)  # (cache padding)
        else:  # paged: cache padding reads on in the row's own blocks (stale contents), then the null block
            tables.key_slot[b, chunk.end_pos :], tables.key_pos[b, chunk.end_pos :] = _pad_addresses(
                chunk.blocks, chunk.end_pos, k_len, block_size)
    return tables.build(padded_positions=len(chunks) * q_len - sum(c.num_tokens for c in chunks))


def build_packed(plan: StepPlan, *, pad_token_id: int = 0, faults: frozenset = frozenset(),
                 block_size: int | None = None) -> BatchTensors:
    """Packed layout for `plan`: all chunks in one row, block-diagonal causal mask."""
    chunks = plan.chunks
    counter = max(c.start_pos for c in chunks)
    tables = _Tables(1, sum(c.num_tokens for c in chunks), sum(c.end_pos for c in chunks), pad_token_id, block_size)
    q0 = k0 = 0
    for b, chunk in enumerate(chunks):
        tables.add(b, chunk, 0, q0, k0, counter, faults)
        if FaultName.NO_REQUEST_MASK in faults:  # plain causal over the concatenation: every earlier block is visible
            tables.allowed[0, q0 : q0 + chunk.num_tokens, :k0] = True
        q0 += chunk.num_tokens
        k0 += chunk.end_pos
    return tables.build(padded_positions=0)


def build_batch(plan: StepPlan, *, layout: str, padding_side: str = "right", pad_token_id: int = 0,
                faults: frozenset = frozenset(), max_len: int | None = None,
                block_size: int | None = None) -> BatchTensors:
    """Dispatch to build_padded or build_packed. `block_size`: paged KV (chunks carry block tables;
    the read and write maps hold block ids and offsets instead of slots and positions).

    Raises:
        ValueError: unknown layout, or an empty plan.
    """
    if plan.empty:
        raise ValueError("cannot build a batch from an empty plan")
    if layout == "padded":
        return build_padded(plan, padding_side=padding_side, pad_token_id=pad_token_id, faults=faults,
                            max_len=max_len, block_size=block_size)
    if layout == "packed":
        return build_packed(plan, pad_token_id=pad_token_id, faults=faults, block_size=block_size)
    raise ValueError(f"unknown {layout = }; use 'padded' or 'packed'")
