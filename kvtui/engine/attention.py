"""Attention over pooled K/V, plugged into transformers through its extension points.

`PooledCacheLayer` (a transformers `CacheLayerMixin`) writes each step's new K/V into the KV pool
and returns the keys/values the batch may read, gathered through the step's key map. The attention
function registered as "kvtui" (`AttentionInterface`) computes softmax(q k^T * scale + mask) v with
kvtui's 4D additive mask, exactly like transformers' eager attention, and can measure how much
attention mass each request puts on keys it does not own.

When the model is called without a kvtui step (e.g. `model.generate`), the mask interface
registered under the same name builds transformers' eager mask, so the model behaves as with
attn_implementation="eager".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from kvtui.engine.batching import BatchTensors
from kvtui.engine.kv_pool import KVPool

ATTENTION_NAME = "kvtui"


@dataclass
class StepState:
    """Per-forward state shared by the cache layers and the attention function (one per step).

    Attributes:
        batch: the step's BatchTensors, moved to the pool device.
        measure_flow: when True the attention function accumulates `attn_sum`.
        attn_sum: [R, Q, K] float32, attention probabilities summed over layers and heads.
        flow_terms: how many (layer x head) terms attn_sum sums (divide by it for a mean in [0, 1]).
        fp16: the fp16_cache fault: attention in float16, K/V cached through float16, pads cached.
    """

    batch: BatchTensors
    measure_flow: bool = False
    attn_sum: torch.Tensor | None = None
    flow_terms: int = 0
    fp16: bool = False


class PooledCacheLayer(CacheLayerMixin):
    """One layer's view of the KV pool for transformers. Holds no tensors of its own.

    update(key_states [R, Hkv, Q, D], value_states [R, Hkv, Q, D]) writes the real tokens' K/V to
    pool[write_slot, :, write_pos] and returns (keys, values) [R, Hkv, K, D] gathered from
    pool[key_slot, :, key_pos].
    """

    is_compileable = False

    def __init__(self, pool: KVPool, layer_idx: int, owner: "PooledCache") -> None:
        super().__init__()
        self.pool = pool
        self.layer_idx = layer_idx
        self.owner = owner
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        state = self.owner.state
        if state is None:
            raise RuntimeError("PooledCache used outside an engine step")
        b = state.batch
        attn_kwargs = kwargs.get("kwargs")
        if isinstance(attn_kwargs, dict):
            attn_kwargs["kvtui_state"] = state
        pool_k, pool_v = self.pool.keys[self.layer_idx], self.pool.values[self.layer_idx]
        k_rows, v_rows = key_states.transpose(1, 2), value_states.transpose(1, 2)  # [R, Q, Hkv, D]
        writes = [(b.write_row, b.write_col, b.write_slot, b.write_pos)]
        if state.fp16 and b.pad_write_row is not None:
            writes.append((b.pad_write_row, b.pad_write_col, b.pad_write_slot, b.pad_write_pos))
        for rows, cols, slots, positions in writes:
            new_k, new_v = k_rows[rows, cols], v_rows[rows, cols]  # [N, Hkv, D]
            if state.fp16:  # stored as float16: overflow -> inf, NaN kept
                new_k, new_v = new_k.half(), new_v.half()
            pool_k[slots, :, positions] = new_k.to(pool_k.dtype)
            pool_v[slots, :, positions] = new_v.to(pool_v.dtype)
        keys = pool_k[b.key_slot, :, b.key_pos].transpose(1, 2)  # [R, Hkv, K, D]
        values = pool_v[b.key_slot, :, b.key_pos].transpose(1, 2)
        return keys.to(key_states.dtype), values.to(value_states.dtype)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        state = self.owner.state
        return (state.batch.key_slot.shape[1] if state else query_length), 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return self.pool.max_len


class PooledCache(Cache):
    """A transformers `Cache` whose layers read and write the kvtui KV pool for the current step."""

    def __init__(self, pool: KVPool) -> None:
        super().__init__(layers=[PooledCacheLayer(pool, i, self) for i in range(pool.num_layers)])
        self.state: StepState | None = None


def kvtui_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """softmax(q k^T * scaling + mask) v, as transformers' eager attention.

    Args:
        query: [R, Hq, Q, D]; key, value: [R, Hkv, K, D] (Hkv divides Hq: grouped-query attention).
        attention_mask: [R, 1, Q, K] additive mask, or None (no masking).
        scaling: score scale, default D ** -0.5.
    Returns:
        (output [R, Q, Hq, D], None).
    """
    state: StepState | None = kwargs.get("kvtui_state")
    if state is not None and state.fp16:  # the fp16_cache fault: the whole attention in float16
        dtype = query.dtype
        query, key, value = query.half(), key.half(), value.half()
        if attention_mask is not None:
            attention_mask = attention_mask.half()
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : key.shape[-2]]
    if state is not None and state.fp16:
        probs = torch.softmax(scores, dim=-1)  # float16 softmax: a row of -inf gives NaN
        out = torch.matmul(probs, value).to(dtype)
        return out.transpose(1, 2).contiguous(), None
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if state is not None and state.measure_flow:
        summed = probs.float().sum(dim=1)  # [R, Q, K] over heads
        state.attn_sum = summed if state.attn_sum is None else state.attn_sum + summed
        state.flow_terms += probs.shape[1]
    out = torch.matmul(probs, value)
    return out.transpose(1, 2).contiguous(), None


_registered = False


def register_attention() -> str:
    """Register the "kvtui" attention and mask functions with transformers (idempotent); returns the name."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION_NAME, kvtui_attention)
        AttentionMaskInterface.register(ATTENTION_NAME, eager_mask)
        _registered = True
    return ATTENTION_NAME
