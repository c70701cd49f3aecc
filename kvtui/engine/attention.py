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

from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from kvtui.engine.batching import PAD_OWNER, BatchTensors
from kvtui.engine.kv_pool import KVPool

ATTENTION_NAME = "kvtui"


@dataclass
class StepState:
    """Per-forward state shared by the cache layers and the attention function (one per step).

    Attributes:
        batch: the step's BatchTensors, moved to the pool device.
        measure_flow: when True the attention function accumulates `foreign_mass`.
        foreign_mass: [R, Q] float32, summed over layers and heads: attention probability that each
            query put on keys owned by another chunk (other requests) — 0 with isolation intact.
        flow_layers: how many (layer x head) terms foreign_mass sums.
    """

    batch: BatchTensors
    measure_flow: bool = False
    foreign_mass: torch.Tensor | None = None
    flow_layers: int = 0
    extra: dict = field(default_factory=dict)


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
        new_k = key_states.transpose(1, 2)[b.write_row, b.write_col]  # [N, Hkv, D]
        new_v = value_states.transpose(1, 2)[b.write_row, b.write_col]
        pool_k[b.write_slot, :, b.write_pos] = new_k.to(pool_k.dtype)
        pool_v[b.write_slot, :, b.write_pos] = new_v.to(pool_v.dtype)
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
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : key.shape[-2]]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    state: StepState | None = kwargs.get("kvtui_state")
    if state is not None and state.measure_flow:
        _accumulate_flow(state, probs)
    out = torch.matmul(probs, value)
    return out.transpose(1, 2).contiguous(), None


def _accumulate_flow(state: StepState, probs: torch.Tensor) -> None:
    """Add the attention mass each query puts on keys of other chunks (summed over heads)."""
    b = state.batch
    q_owner = b.query_owner.to(probs.device)  # [R, Q]
    k_owner = b.key_owner.to(probs.device)  # [R, K]
    foreign = (k_owner[:, None, :] != q_owner[:, :, None]) & (k_owner[:, None, :] != PAD_OWNER)
    foreign &= (q_owner != PAD_OWNER)[:, :, None]
    mass = (probs.float() * foreign[:, None, :, :]).sum(dim=(1, 3))  # [R, Q]
    state.foreign_mass = mass if state.foreign_mass is None else state.foreign_mass + mass
    state.flow_layers += probs.shape[1]


_registered = False


def register_attention() -> str:
    """Register the "kvtui" attention and mask functions with transformers (idempotent); returns the name."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION_NAME, kvtui_attention)
        AttentionMaskInterface.register(ATTENTION_NAME, eager_mask)
        _registered = True
    return ATTENTION_NAME
