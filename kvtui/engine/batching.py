"""Padded and packed layouts: the model inputs, position ids, 4D masks and KV read/write maps.

Both layouts read keys through one gather map: row r's key column k is pool[key_slot[r, k], :,
key_pos[r, k]]; the new tokens' K/V are first written to pool[write_slot[i], :, write_pos[i]].
The attention mask decides which gathered keys each query may see.

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

from kvtui.engine.scheduler import StepPlan

PAD_OWNER = -1


@dataclass(frozen=True)
class BatchStats:
    """How much one step computed, pads included, for the step report and the virtual clock.

    Attributes:
        rows: rows of the model input (requests in the padded layout, 1 packed, 0 idle).
        query_positions: query positions computed, pads included (tokens).
        padded_positions: query positions that were padding (tokens).
        key_cells: rows x key columns: key positions read per query column (the cost model's keys).
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
        pad_write_*: [P] int64, pad cells whose K/V are cached too (fp16_cache fault only), else None.
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
    pad_write_row: torch.Tensor | None = None
    pad_write_col: torch.Tensor | None = None
    pad_write_slot: torch.Tensor | None = None
    pad_write_pos: torch.Tensor | None = None

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
                          padded_positions=self.padded_positions, key_cells=rows * k_len,
                          key_positions=real * k_len, key_padded_positions=self.key_padded_positions)

    def additive_mask(self, dtype: torch.dtype, masked_value: float | None = None) -> torch.Tensor:
        """[R, 1, Q, K] additive mask in `dtype`: 0 allowed, finfo(dtype).min (or masked_value) not."""
        fill = torch.finfo(dtype).min if masked_value is None else masked_value
        mask = torch.zeros(self.allowed.shape, dtype=dtype)
        mask.masked_fill_(~self.allowed, fill)
        return mask.unsqueeze(1)


def _tensor(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def build_padded(plan: StepPlan, *, padding_side: str = "right", pad_token_id: int = 0,
                 faults: frozenset = frozenset(), max_len: int | None = None) -> BatchTensors:
    """Padded layout for `plan`: one row per chunk. See the module docstring."""
    chunks = plan.chunks
    counter = max(c.start_pos for c in chunks)  # the batch-wide counter of shared_position_offset
    p_row, p_col, p_slot, p_pos = [], [], [], []
    rows, q_len = len(chunks), max(c.num_tokens for c in chunks)
    k_len = max(c.end_pos for c in chunks)
    input_ids = torch.full((rows, q_len), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((rows, q_len), dtype=torch.long)
    allowed = torch.zeros((rows, q_len, k_len), dtype=torch.bool)
    query_owner = torch.full((rows, q_len), PAD_OWNER, dtype=torch.long)
    key_slot = torch.zeros((rows, k_len), dtype=torch.long)
    key_pos = torch.zeros((rows, k_len), dtype=torch.long)
    key_owner = torch.full((rows, k_len), PAD_OWNER, dtype=torch.long)
    w_row, w_col, w_slot, w_pos, s_row, s_col, s_chunk = [], [], [], [], [], [], []
    key_padded = 0
    for b, chunk in enumerate(chunks):
        n = chunk.num_tokens
        offset = q_len - n if padding_side == "left" else 0
        cols = torch.arange(offset, offset + n)
        positions = torch.arange(chunk.start_pos, chunk.end_pos)
        slot = 0 if "shared_cache" in faults else chunk.slot
        input_ids[b, cols] = torch.tensor(chunk.token_ids, dtype=torch.long)
        position_ids[b, cols] = (counter + torch.arange(n)) if "shared_position_offset" in faults else positions
        query_owner[b, cols] = b
        key_slot[b, :] = slot
        key_pos[b, :] = torch.arange(k_len)  # the slot's region [0, K): beyond end_b it is cache padding
        key_owner[b, : chunk.end_pos] = b
        # query at position p sees keys 0..p of its own slot
        mask_positions = torch.arange(n) if "causal_offset" in faults else positions
        allowed[b, cols, :] = torch.arange(k_len)[None, :] <= mask_positions[:, None]
        if "unmasked_cache_padding" in faults:
            allowed[b, cols, chunk.end_pos :] = True
        key_padded += n * (k_len - chunk.end_pos)
        w_row += [b] * n
        w_col += cols.tolist()
        w_slot += [slot] * n
        w_pos += positions.tolist()
        if "fp16_cache" in faults:  # a naive padded cache stores whole rows: pads land after the row's tokens
            pad_cols = [c for c in range(q_len) if not offset <= c < offset + n]
            for j, c in enumerate(pad_cols):
                if max_len is None or chunk.end_pos + j < max_len:
                    p_row.append(b), p_col.append(c), p_slot.append(slot), p_pos.append(chunk.end_pos + j)
        if chunk.samples:
            s_row.append(b)
            s_col.append(offset + n - 1)
            s_chunk.append(b)
    real = sum(c.num_tokens for c in chunks)
    return BatchTensors(
        input_ids, position_ids, allowed, _tensor(w_row), _tensor(w_col), _tensor(w_slot), _tensor(w_pos),
        key_slot, key_pos, key_owner, query_owner, _tensor(s_row), _tensor(s_col), s_chunk,
        padded_positions=rows * q_len - real, key_padded_positions=key_padded,
        **({"pad_write_row": _tensor(p_row), "pad_write_col": _tensor(p_col), "pad_write_slot": _tensor(p_slot),
            "pad_write_pos": _tensor(p_pos)} if p_row else {}),
    )


def build_packed(plan: StepPlan, *, pad_token_id: int = 0, faults: frozenset = frozenset()) -> BatchTensors:
    """Packed layout for `plan`: all chunks in one row, block-diagonal causal mask."""
    chunks = plan.chunks
    counter = max(c.start_pos for c in chunks)
    q_len = sum(c.num_tokens for c in chunks)
    k_len = sum(c.end_pos for c in chunks)
    input_ids = torch.empty((1, q_len), dtype=torch.long)
    position_ids = torch.empty((1, q_len), dtype=torch.long)
    allowed = torch.zeros((1, q_len, k_len), dtype=torch.bool)
    query_owner = torch.empty((1, q_len), dtype=torch.long)
    key_slot = torch.empty((1, k_len), dtype=torch.long)
    key_pos = torch.empty((1, k_len), dtype=torch.long)
    key_owner = torch.empty((1, k_len), dtype=torch.long)
    w_pos, w_slot, s_col, s_chunk = [], [], [], []
    q0 = k0 = 0
    key_padded = 0
    for b, chunk in enumerate(chunks):
        n, end = chunk.num_tokens, chunk.end_pos
        positions = torch.arange(chunk.start_pos, end)
        slot = 0 if "shared_cache" in faults else chunk.slot
        input_ids[0, q0 : q0 + n] = torch.tensor(chunk.token_ids, dtype=torch.long)
        position_ids[0, q0 : q0 + n] = (counter + torch.arange(n)) if "shared_position_offset" in faults else positions
        query_owner[0, q0 : q0 + n] = b
        key_slot[0, k0 : k0 + end] = slot
        key_pos[0, k0 : k0 + end] = torch.arange(end)
        key_owner[0, k0 : k0 + end] = b
        mask_positions = torch.arange(n) if "causal_offset" in faults else positions
        allowed[0, q0 : q0 + n, k0 : k0 + end] = torch.arange(end)[None, :] <= mask_positions[:, None]
        if "no_request_mask" in faults:  # plain causal over the concatenation: every earlier block is visible
            allowed[0, q0 : q0 + n, :k0] = True
        key_padded += n * (k_len - end)
        w_pos += positions.tolist()
        w_slot += [slot] * n
        if chunk.samples:
            s_col.append(q0 + n - 1)
            s_chunk.append(b)
        q0 += n
        k0 += end
    return BatchTensors(
        input_ids, position_ids, allowed, torch.zeros(q_len, dtype=torch.long), torch.arange(q_len),
        _tensor(w_slot), _tensor(w_pos), key_slot, key_pos, key_owner, query_owner,
        torch.zeros(len(s_col), dtype=torch.long), _tensor(s_col), s_chunk,
        padded_positions=0, key_padded_positions=key_padded,
    )


def build_batch(plan: StepPlan, *, layout: str, padding_side: str = "right", pad_token_id: int = 0,
                faults: frozenset = frozenset(), max_len: int | None = None) -> BatchTensors:
    """Dispatch to build_padded or build_packed.

    Raises:
        ValueError: unknown layout, or an empty plan.
    """
    if plan.empty:
        raise ValueError("cannot build a batch from an empty plan")
    if layout == "padded":
        return build_padded(plan, padding_side=padding_side, pad_token_id=pad_token_id, faults=faults,
                            max_len=max_len)
    if layout == "packed":
        return build_packed(plan, pad_token_id=pad_token_id, faults=faults)
    raise ValueError(f"unknown {layout = }; use 'padded' or 'packed'")
