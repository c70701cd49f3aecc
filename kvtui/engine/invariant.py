"""The batch-invariant mode: every row's logits bitwise independent of what it is batched with.

Why a batched row and the same request run alone differ at all: a kernel's reduction order can depend
on the batch. A GEMM blocks its work by the row count (M), so one token's dot products are summed in
another order in a step of 3 rows than in a step of 1; attention kernels tile the keys by the longest
row of the batch; a padded row's softmax sums over a longer vector. In float32 that moves logits by
about 1e-6 and greedy tokens rarely flip; in bfloat16 and float16 near ties flip often, and a
reference check cannot tell such a flip from a leak without a tolerance.

This mode removes the dependence instead of tolerating it (vLLM's VLLM_BATCH_INVARIANT, SGLang's
deterministic inference and Thinking Machines' batch_invariant_ops do the same on GPUs):

- Row-wise work in fixed tiles (`RowTiles`): the step's token rows (pads included, they are rows like
  any other) are cut into tiles of exactly `size` rows, the last one padded with zero rows, and every
  row-wise operation (RMSNorm, the q/k/v, o, gate/up and down projections, rotary, SiLU, residuals,
  the LM head) runs on one tile at a time, each tile copied to a fresh tensor. So each row goes
  through a matrix multiply of the same shape whatever the batch holds. That is enough only when the
  kernel also gives a row the same bits wherever it sits in its tile and whatever its neighbours
  hold; `choose_tile` checks exactly that on the model's own weights at load, on this CPU, and keeps
  the largest tile size up to 8 that passes (1 always does: one row per call).
- Attention one query at a time over exactly the keys it may see (`invariant_attention`): the query
  at position p reads its own keys 0..p, copied contiguous, with transformers' eager formula (scores
  in the model dtype, softmax in float32). The shapes depend on p alone, so the arithmetic is the
  same in a prefill chunk of 200 tokens, a decode step of 8 rows or a solo run. Under a fault that
  changes the mask, each query reads the keys the step's mask allows, in key order, by the same
  formula: a row the fault does not touch computes exactly what it computes with the fault off.
- Rotary cos/sin from one table per position (`FusedLlama` builds it), not computed per batch.

The cost (docs/performance.md): decode rows padded to a whole tile, and one attention call per query
position and layer. The mode runs on kvtui's fused forward (Llama-family models); other models are
refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

CANDIDATE_TILES = (8, 4, 2, 1)


class RowTiles:
    """Apply a row-wise function to [N, ...] tensors in tiles of exactly `size` rows.

    Args:
        size: rows per tile (>= 1), from choose_tile.
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"tile size must be at least 1, got {size}")
        self.size = size

    def map(self, fn: Callable, *xs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """fn over the tiles of `xs` (each [N, ...], the same N), results concatenated over rows and cut
        back to N. `fn` takes one [size, ...] tile of each input (fresh tensors; the last tile's rows past
        N are zeros) and returns a tensor or a tuple of tensors, each [size, ...]."""
        n, t = xs[0].shape[0], self.size
        tiles = max(1, math.ceil(n / t))
        outs = []
        for i in range(tiles):
            parts = []
            for x in xs:
                part = x.new_zeros((t, *x.shape[1:]))
                rows = min(t, n - i * t)
                if rows > 0:
                    part[:rows] = x[i * t : i * t + rows]
                parts.append(part)
            out = fn(*parts)
            outs.append(out if isinstance(out, tuple) else (out,))
        joined = tuple(torch.cat(column)[:n] for column in zip(*outs))
        return joined if len(joined) > 1 else joined[0]


def tile_is_invariant(fn: Callable[[torch.Tensor], torch.Tensor], size: int, width: int, dtype: torch.dtype,
                      trials: int = 3, seed: int = 0) -> bool:
    """Whether `fn` ([size, width] -> [size, ...]) gives one row the same bits wherever it sits in the tile
    and whatever the other rows hold: a random row put at the first, middle and last place among random
    neighbours (`trials` fillings each, scaled differently), and twice in a row at the same place."""
    generator = torch.Generator().manual_seed(seed)
    row = torch.randn(width, generator=generator).to(dtype)
    first = None
    for place in sorted({0, size // 2, size - 1}):
        for trial in range(trials):
            tile = (torch.randn(size, width, generator=generator) * (1 + 3 * trial)).to(dtype)
            tile[place] = row
            out = fn(tile)[place]
            if first is None:
                first = out
            elif not torch.equal(out, first):
                return False
    return torch.equal(fn(tile)[size - 1], first)


def choose_tile(linears: list[tuple[Callable[[torch.Tensor], torch.Tensor], int]], dtype: torch.dtype,
                candidates: tuple[int, ...] = CANDIDATE_TILES) -> tuple[int, dict]:
    """The tile size the batch-invariant mode uses on this CPU for these weights: the largest candidate
    that every fn passes tile_is_invariant with (1 always does: one row per call).

    The rule is fixed, not a timing race, so every engine over the model in every process picks the
    same size (a batched run and its solo reference must use the same tiles to agree bit for bit).
    The largest candidate is 8, a typical decode batch: a step of fewer rows pays for a whole tile
    (docs/performance.md has the cost per CPU).

    Args:
        linears: (fn, in_features) per distinct matrix multiply of the model ([size, in] -> [size, out]);
            one layer's projections and the LM head.
        dtype: the model dtype.
    Returns:
        (size, figures): figures maps each candidate probed (largest first, until one passes) to
        whether it passed.
    """
    figures: dict = {}
    with torch.inference_mode():
        for size in sorted(candidates, reverse=True):
            figures[size] = size == 1 or all(tile_is_invariant(fn, size, width, dtype) for fn, width in linears)
            if figures[size]:
                return size, figures
    return 1, figures


def _one_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention of one query position: q [Hq, D], k and v [Hkv, n, D] contiguous (grouped-query
    heads share K/V). Scores in the model dtype, softmax in float32 cast back (transformers' eager
    formula). Returns (output [Hq, D], probabilities [Hq, n])."""
    hq, d = q.shape
    hkv, n = k.shape[0], k.shape[1]
    scores = torch.bmm(q.reshape(hkv, hq // hkv, d), k.transpose(1, 2)) * scaling  # [Hkv, G, n]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.bmm(probs, v).reshape(hq, d)
    return out, probs.reshape(hq, n)


def invariant_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                        state, own_keys) -> torch.Tensor:
    """Attention for a batch-invariant step: each real query position alone over the keys it may see.

    Args:
        query: [R, Hq, Q, D].
        key, value: own-range path (state.own_range): the layer's pool [S, Hkv, L, D] (paged: [blocks,
            Hkv, block_size, D]); mask path: the batch's gathered keys [R, Hkv, K, D].
        scaling: score scale.
        state: the step's StepState (its batch's segments, and `allowed` [R, Q, K] on the mask path;
            measure_flow adds the probabilities to attn_sum [R, Q, K]).
        own_keys: attention.own_keys (a segment's keys 0..end-1 from the pool).
    Returns:
        [R, Q, Hq, D]; pad query positions are zeros.
    """
    batch = state.batch
    out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
    if state.measure_flow and state.attn_sum is None:
        state.attn_sum = torch.zeros(batch.allowed.shape, dtype=torch.float32, device=query.device)
    allowed = None if state.own_range else batch.allowed.to(query.device)
    for seg in batch.segments:
        if state.own_range:
            keys, values = own_keys(key, seg), own_keys(value, seg)  # [Hkv, end, D]
        for t in range(seg.num_tokens):
            col = seg.q_start + t
            if state.own_range:
                seen = seg.start_pos + t + 1  # positions 0 .. p
                k, v = keys[:, :seen].contiguous(), values[:, :seen].contiguous()
                columns = torch.arange(seg.key_start, seg.key_start + seen, device=query.device)
            else:
                columns = allowed[seg.row, col].nonzero().flatten()
                k = key[seg.row][:, columns].contiguous()
                v = value[seg.row][:, columns].contiguous()
            o, probs = _one_query(query[seg.row, :, col].contiguous(), k, v, scaling)
            out[seg.row, col] = o
            if state.measure_flow:
                state.attn_sum[seg.row, col, columns] += probs.float().sum(dim=0)
    if state.measure_flow:
        state.flow_terms += query.shape[1]
    return out
