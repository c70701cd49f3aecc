"""Attention over pooled K/V, plugged into transformers through its extension points.

`PooledCacheLayer` (a transformers `CacheLayerMixin`) writes each step's new K/V into the KV pool.
The attention function registered as "kvtui" (`AttentionInterface`) then runs one of two paths (in
the batch-invariant mode, each query position alone on either path: kvtui/engine/invariant.py):

own-range (the default): each chunk's queries attend to exactly its own request's keys, positions
    0 .. end-1 of its slot, read as a view of the pool (no copy); with paged KV, its blocks gathered
    through its block table in order (a copy). Keys of other requests and whatever
    an earlier owner left past the chunk's end never reach the output, NaN or not. The computation
    per chunk is the one a solo run of that request does.
    `torch.nn.functional.scaled_dot_product_attention` (grouped-query heads without repeating K/V)
    does the work, or the exact eager softmax(q k^T * scale) v when the attention_flow detector
    needs the probabilities. Decode chunks over the slot pool run on kvtui's C++ decode kernel where the
    runner chose it (engine/cpu_kernels.py: each row over its own keys 0 .. end-1 only, the flow sums too),
    else share one SDPA call over a span of slots,
    each row masked past its own length; the rows of the span are independent, and the positions a
    row reads past its length are zeros the pool wrote for it (KVPool.clear_tails, asked for by the
    span's plan), so a masked position adds exactly zero whatever an earlier owner left there.
mask (while a fault that changes the mask is on: no_request_mask, unmasked_cache_padding,
    causal_offset, fp16_cache): the batch's keys are gathered through the step's key map and masked
    with the step's [R, 1, Q, K] table. Masked scores are replaced (not added to), and a value row
    contributes only where its probability is non-zero, so masked positions add exactly zero
    whatever they hold. The fp16_cache fault keeps the naive float16 formula on purpose (additive
    -1e9 mask, 0 x NaN = NaN): that is the bug it demonstrates.

When the model is called without a kvtui step (e.g. `model.generate`), the mask interface
registered under the same name builds transformers' eager mask, so the model behaves as with
attn_implementation="eager".
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionCacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from kvtui.engine import cpu_kernels
from kvtui.engine.batching import BatchTensors, Segment
from kvtui.engine.invariant import invariant_attention
from kvtui.engine.kv_pool import KVPool

ATTENTION_NAME = "kvtui"


@dataclass
class StepState:
    """Per-forward state shared by the cache layers and the attention function (one per step).

    Attributes:
        batch: the step's BatchTensors, moved to the pool device.
        own_range: the own-range path (see module docstring); False: the mask path.
        measure_flow: when True the attention function accumulates `attn_sum`.
        attn_sum: [R, Q, K] float32, attention probabilities summed over layers and heads.
        flow_terms: how many (layer x head) terms attn_sum sums (divide by it for a mean in [0, 1]).
        fp16: the fp16_cache fault: attention in float16, K/V cached through float16, pads cached.
        invariant: the batch-invariant mode: each query position alone over the keys it may see
            (kvtui/engine/invariant.py), on either path.
    """

    batch: BatchTensors
    own_range: bool = True
    measure_flow: bool = False
    attn_sum: torch.Tensor | None = None
    flow_terms: int = 0
    fp16: bool = False
    invariant: bool = False
    _decode_rows: tuple | None = None  # (row, slot, end) per row when every row decodes one token (slots)
    _causal: dict | None = None  # segment -> its causal mask, built once per step
    _span: object = None  # the batched-decode plan (see span()), built once per step; False: none
    _flow_plan: object = None  # the measured-decode plan (see flow_plan()), built once per step; False: none
    _mixed: object = None  # the decode chunks of a mixed step (see mixed_plan()), built once per step; False: none
    pool: KVPool | None = None  # the slot pool a span plan reads (its tails zeroed first); None: no span plans
    decode_kernel: bool = False  # decode chunks run kvtui's C++ kernel (engine/cpu_kernels.py) where it takes them
    _kernel_plan: object = None  # (slots [S], ends [S]) of the decode rows for the kernel, built once per step
    flow_acc: torch.Tensor | None = None  # [S, K] the measured-decode path's sums, before settle_flow

    def settle_flow(self) -> None:
        """Move the measured-decode path's sums (one dense [S, K] add per layer) into attn_sum [R, Q, K]
        with one scatter per step; the per-layer order of the additions is kept, so the sums are the
        ones a scatter per layer gives."""
        if self.flow_acc is None:
            return
        _, _, _, valid, flat, _ = self._flow_plan
        if self.attn_sum is None:
            self.attn_sum = torch.zeros(self.batch.allowed.shape, dtype=torch.float32, device=self.flow_acc.device)
        self.attn_sum.index_put_(flat, self.flow_acc[valid], accumulate=True)
        self.flow_acc = None

    def decode_rows(self) -> tuple:
        """((row, slot, end), ...) when the step is decode only: one token per row at query column 0,
        rows in segment order, slot pool, no attention_flow measurement (then one SDPA call per row
        and one concatenation make the layer's output); () otherwise. Computed once per step."""
        if self._decode_rows is None:
            segments = self.batch.segments
            simple = not self.measure_flow and all(
                s.num_tokens == 1 and s.q_start == 0 and s.row == i and s.blocks is None for i, s in enumerate(segments))
            self._decode_rows = tuple((s.row, s.slot, s.end_pos) for s in segments) if simple else ()
        return self._decode_rows

    def span(self, device):
        """The batched-decode plan, or None: when the decode rows' slots lie in a range no more than twice
        their number, one SDPA call over the pool's view of that range, with a boolean mask that ends
        each row at its own length, replaces one call per row. Returns (lo, hi, order, mask [span, 1, 1,
        K]) where `order` maps rows to view rows (None when they coincide); the positions each row reads
        past its own length are zeros by then (_span_plan)."""
        if self._span is None:
            self._span = _span_plan(self.decode_rows(), device, self.pool) or False
        return self._span or None

    def kernel_plan(self, segments) -> tuple:
        """(slots [S], ends [S]) int64 of the decode `segments` (one query token each, slot pool) for
        cpu_kernels.decode_attention, built on the first layer and reused by the others."""
        if self._kernel_plan is None:
            self._kernel_plan = (torch.tensor([s.slot for s in segments], dtype=torch.long),
                                 torch.tensor([s.end_pos for s in segments], dtype=torch.long))
        return self._kernel_plan

    def flow_plan(self, device):
        """The measured-decode plan, or None: when attention_flow measures a decode-only step over the
        slot pool (every chunk one query), one batched exact-eager attention over the rows' slots, keys
        past each row's own length masked, replaces one call per chunk. Returns (slots [S], query rows
        [S], query columns [S], valid [S, K] bool, flat (row, column, key) indices into attn_sum of the
        valid keys, the view plan or None). Computed once per step."""
        if self._flow_plan is None:
            segs = self.batch.segments
            simple = self.measure_flow and segs and all(s.num_tokens == 1 and s.blocks is None for s in segs)
            pool = None if self.decode_kernel else self.pool  # the kernel reads no span: no tails to zero
            self._flow_plan = _flow_plan(segs, device, pool) if simple else False
        return self._flow_plan or None

    def mixed_plan(self, device):
        """The decode chunks of a step that also prefills, in one SDPA call, or None: when at least two
        chunks decode one token each from the slot pool and their slots form a span (_span_plan),
        (those segments as a set, (their query rows, query columns) [S] each, the span plan). Built once
        per step."""
        if self._mixed is None:
            decode = [s for s in self.batch.segments if s.num_tokens == 1 and s.blocks is None]
            span = _span_plan(tuple((i, s.slot, s.end_pos) for i, s in enumerate(decode)), device, self.pool)
            as_index = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
            self._mixed = False if span is None else (
                set(decode), (as_index([s.row for s in decode]), as_index([s.q_start for s in decode])), span)
        return self._mixed or None

    def causal(self, seg: Segment, device) -> torch.Tensor | None:
        """The segment's causal mask (see _causal), built on the first layer and reused by the others."""
        if self._causal is None:
            self._causal = {}
        if seg not in self._causal:
            self._causal[seg] = _causal(seg, device)
        return self._causal[seg]


class PooledCacheLayer(CacheLayerMixin):
    """One layer's view of the KV pool for transformers. Holds no tensors of its own.

    update(key_states [R, Hkv, Q, D], value_states [R, Hkv, Q, D]) writes the real tokens' K/V to
    pool[write_slot, :, write_pos]. It returns, on the own-range path, the layer's whole pool tensors
    [S, Hkv, L, D] (paged: [blocks, Hkv, block_size, D]; the attention function takes each chunk's own
    range), and on the mask path the batch's keys and values [R, Hkv, K, D] gathered from
    pool[key_slot, :, key_pos] (paged: block ids and offsets).
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
        if self.owner.interrupt.is_set():
            raise StepInterrupted(f"the step was interrupted at layer {self.layer_idx}")
        b = state.batch
        attn_kwargs = kwargs.get("kwargs")
        if isinstance(attn_kwargs, dict):
            attn_kwargs["kvtui_state"] = state
        k_rows, v_rows = key_states.transpose(1, 2), value_states.transpose(1, 2)  # [R, Q, Hkv, D]
        writes = [(b.write_row, b.write_col, b.write_slot, b.write_pos)]
        if state.fp16 and b.pad_write_row is not None:
            writes.append((b.pad_write_row, b.pad_write_col, b.pad_write_slot, b.pad_write_pos))
        for rows, cols, slots, positions in writes:
            new_k, new_v = k_rows[rows, cols], v_rows[rows, cols]  # [N, Hkv, D]
            if state.fp16:  # stored as float16: overflow -> inf, NaN kept
                new_k, new_v = new_k.half(), new_v.half()
            self.pool.write(self.layer_idx, slots, positions, new_k, new_v)
        pool_k, pool_v = self.pool.keys[self.layer_idx], self.pool.values[self.layer_idx]
        if state.own_range:
            return pool_k, pool_v
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


class StepInterrupted(Exception):
    """A forward stopped between two layers because `PooledCache.interrupt` was set (Engine.interrupt)."""


class PooledStateLayer(LinearAttentionCacheLayerMixin):
    """One linear-attention layer's view of a hybrid's state pool (engine/state_pool.py), for the request
    piece bound to the cache (PooledCache.bind_state): its conv state [1, conv_dim, kernel] and recurrent
    state [1, heads, k_dim, v_dim] are views of the pool's slot, read and written in place. Holds no tensors
    of its own."""

    is_compileable = False

    def __init__(self, states, layer_idx: int, owner: "PooledCache") -> None:
        super().__init__()
        self.states = states
        self.layer_idx = layer_idx
        self.owner = owner

    def lazy_initialization(self, *args, **kwargs) -> None:
        return None

    def _slot(self) -> int:
        slot = self.owner.state_slot
        if slot is None:
            raise RuntimeError(f"linear-attention layer {self.layer_idx} ran without a state slot bound")
        return slot

    def conv(self) -> torch.Tensor | None:
        """The bound slot's conv state, a view [1, conv_dim, kernel]; None for a request's first piece."""
        if self.owner.state_fresh:
            return None
        slot = self._slot()
        return self.states.conv[self.layer_idx][slot : slot + 1]

    def recurrent(self) -> torch.Tensor | None:
        """The bound slot's recurrent state, a view [1, heads, k_dim, v_dim]; None for a request's first piece."""
        if self.owner.state_fresh:
            return None
        slot = self._slot()
        return self.states.recurrent[self.layer_idx][slot : slot + 1]

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None,
                          **kwargs) -> torch.Tensor:
        """`conv_states` [1, conv_dim, n]: the piece's conv inputs. Returns them after their left context (the
        slot's state, or zeros for a first piece, as transformers pads) and keeps the last `kernel` columns in
        the slot."""
        stored = self.states.conv[self.layer_idx][self._slot()]
        kernel = stored.shape[-1]
        previous = self.conv()
        if previous is None:
            full = conv_states
            if full.shape[-1] < kernel:
                full = F.pad(full, (kernel - full.shape[-1], 0), value=0)
        else:
            full = torch.cat([previous.to(conv_states.dtype), conv_states], dim=-1)
        stored.copy_(full[0, :, -kernel:])
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """Keep the piece's last recurrent state [1, heads, k_dim, v_dim] in the slot; returns the slot's view."""
        slot = self._slot()
        self.states.recurrent[self.layer_idx][slot].copy_(recurrent_states[0])
        return self.states.recurrent[self.layer_idx][slot : slot + 1]


class PooledCache(Cache):
    """A transformers `Cache` whose layers read and write the kvtui KV pool for the current step.
    `interrupt` (any thread may set it) makes the next layer raise StepInterrupted, so a long forward
    ends within one layer's time.

    A hybrid model (`states`, a state_pool.StatePool) has a PooledStateLayer at each linear-attention layer
    and a PooledCacheLayer at each attention layer, over the KV pool's layers in order (the pool holds K/V
    for the attention layers only). Its linear layers run one request piece at a time: `bind_state(slot,
    fresh)` names the piece's state slot, and the linear-attention verbs transformers' layers call
    (get_conv_state, update_conv_state, get_recurrent_state, update_recurrent_state, has_previous_state)
    read and write that slot."""

    def __init__(self, pool: KVPool, states=None) -> None:
        linear = set(states.shape.linear_layers) if states is not None else set()
        layers, kv_index = [], 0
        for i in range(pool.num_layers + len(linear)):
            if i in linear:
                layers.append(PooledStateLayer(states, i, self))
            else:
                layers.append(PooledCacheLayer(pool, kv_index, self))
                kv_index += 1
        super().__init__(layers=layers)
        self.state: StepState | None = None
        self.interrupt = threading.Event()
        self.state_slot: int | None = None
        self.state_fresh = True

    def bind_state(self, slot: int | None, fresh: bool) -> None:
        """The request piece the linear layers run next: its state `slot`; `fresh` when it starts at
        position 0 (no previous state: transformers then pads the conv and starts the delta rule from zero)."""
        self.state_slot, self.state_fresh = slot, fresh

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.layers[layer_idx].conv()

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.layers[layer_idx].recurrent()

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self.state_slot is not None and not self.state_fresh

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0

    def increase_count(self, layer_idx: int, state_idx: int) -> None:
        return None


def kvtui_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention for a kvtui step (see the module docstring for the two paths).

    Args:
        query: [R, Hq, Q, D].
        key, value: own-range path: the layer's pool [S, Hkv, L, D]; mask path: [R, Hkv, K, D]
            (Hkv divides Hq: grouped-query attention).
        attention_mask: [R, 1, Q, K] additive mask (mask path), or None outside a kvtui step.
        scaling: score scale, default D ** -0.5.
    Returns:
        (output [R, Q, Hq, D], None). On the own-range path pad query positions get zeros.
    """
    state: StepState | None = kwargs.get("kvtui_state")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    override = getattr(module, "kvtui_attention_override", None)  # encoder-decoders: engine/encoder.py
    if override is not None:
        out = override(query, key, value, attention_mask, scaling)
        if out is not None:
            return out, None
    if state is None:
        return _masked(query, key, value, attention_mask, scaling, None), None
    if state.fp16:
        return _naive_fp16(query, key, value, attention_mask, scaling), None
    if state.invariant:
        return invariant_attention(query, key, value, scaling, state, own_keys), None
    if state.own_range:
        return _own_range(query, key, value, scaling, state), None
    return _masked(query, key, value, attention_mask, scaling, state), None


def _own_range(query, pool_k, pool_v, scaling: float, state: StepState) -> torch.Tensor:
    """Each segment's queries over its own keys: pool[slot, :, 0:end] (a view); decode chunks over the slot
    pool on kvtui's C++ kernel where the step asks for it (StepState.decode_kernel: engine/cpu_kernels.py),
    else in one SDPA call over a span of slots where their slots are close (StepState.span, mixed_plan)."""
    rows = state.decode_rows()
    kernel = state.decode_kernel and cpu_kernels.supports(query, pool_k)
    if rows:  # the common decode step: no scatter into a zeroed output
        return _decode_rows(query, pool_k, pool_v, scaling, state, kernel)
    measured = state.flow_plan(query.device)
    if measured is not None and kernel:
        return _decode_flow_kernel(query, pool_k, pool_v, scaling, state, measured)
    if measured is not None:
        return _decode_flow(query, pool_k, pool_v, scaling, state, measured)
    out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])  # [R, Q, Hq, D]
    segments = state.batch.segments
    mixed = None if state.measure_flow or kernel else state.mixed_plan(query.device)
    if kernel and not state.measure_flow:
        segments = _kernel_chunks(query, pool_k, pool_v, scaling, state, out)
    if mixed is not None:  # the decode chunks in one call
        decode, (rows, cols), span = mixed
        q = query[rows, :, cols].unsqueeze(2)  # [S, Hq, 1, D]
        out[rows, cols] = _decode_span(q, pool_k, pool_v, scaling, span)[:, 0]
        segments = [seg for seg in segments if seg not in decode]
    for seg in segments:
        q = query[seg.row, :, seg.q_start : seg.q_start + seg.num_tokens]  # [Hq, n, D]
        k, v = own_keys(pool_k, seg), own_keys(pool_v, seg)  # [Hkv, end, D]
        causal = state.causal(seg, query.device)
        if state.measure_flow:
            o, probs = _eager(q, k, v, causal, scaling)
            _add_flow(state, seg, probs)
        elif causal is not None and seg.start_pos == 0:  # a whole prompt from position 0: SDPA's own causal
            o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scaling,
                                               enable_gqa=True)[0]  # kernel, which skips the masked blocks
        else:
            o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=causal, scale=scaling,
                                               enable_gqa=True)[0]
        out[seg.row, seg.q_start : seg.q_start + seg.num_tokens] = o.transpose(0, 1)
    return out


def _decode_rows(query, pool_k, pool_v, scaling: float, state: StepState, kernel: bool) -> torch.Tensor:
    """A decode-only step (StepState.decode_rows) in one call: on kvtui's kernel (`kernel`), else SDPA over a
    span of slots (StepState.span), else one SDPA call per row. Returns [R, 1, Hq, D]."""
    if kernel and query.shape[2] == 1:  # (racy_threads may run another batch's query under this state)
        return cpu_kernels.decode_attention(query, pool_k, pool_v, *state.kernel_plan(state.batch.segments), scaling)
    plan = state.span(query.device)
    if plan is not None:
        return _decode_span(query, pool_k, pool_v, scaling, plan)
    outs = [F.scaled_dot_product_attention(query[r : r + 1], pool_k[slot : slot + 1, :, :end],
                                           pool_v[slot : slot + 1, :, :end], scale=scaling, enable_gqa=True)
            for r, slot, end in state.decode_rows()]
    return torch.cat(outs).transpose(1, 2)  # [R, 1, Hq, D]


def _kernel_chunks(query, pool_k, pool_v, scaling: float, state: StepState, out: torch.Tensor) -> list:
    """The decode chunks (one query token each, slot pool) of a step that also prefills, on kvtui's kernel,
    written into `out` [R, Q, Hq, D]; returns the step's other segments, left for the caller."""
    segments = state.batch.segments
    decode = [seg for seg in segments if seg.num_tokens == 1 and seg.blocks is None]
    if not decode:
        return list(segments)
    rows, cols = [seg.row for seg in decode], [seg.q_start for seg in decode]
    q = query[rows, :, cols].unsqueeze(2)  # [S, Hq, 1, D]
    out[rows, cols] = cpu_kernels.decode_attention(q, pool_k, pool_v, *state.kernel_plan(decode), scaling)[:, 0]
    return [seg for seg in segments if not (seg.num_tokens == 1 and seg.blocks is None)]


def _flow_plan(segments: tuple, device, pool: KVPool | None):
    """See StepState.flow_plan. Also, when the rows' slots are distinct and lie in a range no more than
    twice their number, the view plan of _span_plan (the keys read in place, no gather)."""
    as_index = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    k_len = max(s.end_pos for s in segments)
    ends = as_index([s.end_pos for s in segments])
    valid = torch.arange(k_len, device=device)[None, :] < ends[:, None]  # [S, K]
    rows, cols, keys = [], [], []
    for s in segments:
        rows += [s.row] * s.end_pos
        cols += [s.q_start] * s.end_pos
        keys += range(s.key_start, s.key_start + s.end_pos)
    span = _span_plan(tuple((s.row, s.slot, s.end_pos) for s in segments), device, pool) if len(segments) > 1 else None
    return (as_index([s.slot for s in segments]), as_index([s.row for s in segments]),
            as_index([s.q_start for s in segments]), valid, (as_index(rows), as_index(cols), as_index(keys)), span)


def _decode_flow(query, pool_k, pool_v, scaling: float, state: StepState, plan) -> torch.Tensor:
    """A measured decode step in one batch: softmax(q k^T * scale) v per chunk over its own slot's keys
    0 .. end-1 (transformers' eager formula, as _eager), keys past a chunk's end masked to probability
    exactly 0: read in place from the pool over a span of slots (where the positions past each row's
    end are zeros the pool wrote: _span_plan), else from a gathered copy with those values zeroed, so
    what an earlier owner left there adds nothing, as on the per-chunk path. The probabilities summed
    over heads are added to the step's flow sums (StepState.settle_flow). Returns [R, Q, Hq, D]."""
    slots, rows, cols, valid, _, span = plan
    k_len = valid.shape[1]
    q = query[rows, :, cols]  # [S, Hq, D]
    n, hq, d = q.shape
    if span is not None:  # the pool's slots lo..hi-1 in place
        lo, hi, order = span[0], span[1], span[2]
        k, v = pool_k[lo:hi, :, :k_len], pool_v[lo:hi, :, :k_len]
        if order is not None:
            q_span = q.new_zeros((hi - lo, hq, d))
            q_span[order] = q
            q, valid_span = q_span, valid.new_zeros((hi - lo, k_len))
            valid_span[order] = valid
        else:
            valid_span = valid
    else:
        order, valid_span = None, valid
        k = pool_k[slots, :, :k_len].to(q.dtype)  # [S, Hkv, K, D], a copy
        v = pool_v[slots, :, :k_len].to(q.dtype).masked_fill(~valid[:, None, :, None], 0)
    m, hkv = q.shape[0], k.shape[1]
    scores = (q.reshape(m, hkv, hq // hkv, d) @ k.transpose(2, 3) * scaling).reshape(m, hq, k_len)
    scores = scores.masked_fill(~valid_span[:, None, :], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # [m, Hq, K]
    o = (probs.reshape(m, hkv, hq // hkv, k_len) @ v).reshape(m, hq, d)
    summed = probs.float().sum(dim=1)  # [m, K], masked keys exactly 0
    if order is not None:
        o, summed = o[order], summed[order]
    state.flow_acc = summed if state.flow_acc is None else state.flow_acc.add_(summed)
    state.flow_terms += hq
    out = query.new_zeros(query.shape[0], query.shape[2], hq, d)  # [R, Q, Hq, D]
    out[rows, cols] = o
    return out


def _decode_flow_kernel(query, pool_k, pool_v, scaling: float, state: StepState, plan) -> torch.Tensor:
    """A measured decode step on kvtui's C++ kernel: each chunk over its own slot's keys 0 .. end-1, the
    probabilities summed over heads added into the step's [S, K] flow sums in the kernel (as _decode_flow
    adds them). Returns [R, Q, Hq, D]."""
    _, rows, cols, valid, _, _ = plan
    q = query[rows, :, cols].unsqueeze(2)  # [S, Hq, 1, D]
    if state.flow_acc is None:
        state.flow_acc = torch.zeros(valid.shape, dtype=torch.float32)
    o = cpu_kernels.decode_attention(q, pool_k, pool_v, *state.kernel_plan(state.batch.segments), scaling,
                                       flow=state.flow_acc)
    state.flow_terms += query.shape[1]
    out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])  # [R, Q, Hq, D]
    out[rows, cols] = o[:, 0]
    return out


def _span_plan(rows: tuple, device, pool: KVPool | None):
    """See StepState.span. None when there are fewer than two rows, their slots are too scattered, or no
    pool is given. Before returning a plan it has `pool` zero what each row will read past its own end
    (KVPool.clear_tails): a plan never exists without that."""
    if len(rows) < 2 or pool is None:
        return None
    slots = [slot for _, slot, _ in rows]
    lo, hi = min(slots), max(slots) + 1
    if hi - lo > 2 * len(rows) or len(set(slots)) != len(slots):
        return None
    k_len = max(end for _, _, end in rows)
    pool.clear_tails(((slot, end) for _, slot, end in rows), k_len)
    mask = torch.ones((hi - lo, 1, 1, k_len), dtype=torch.bool, device=device)  # rows not in the step: unread
    for _, slot, end in rows:
        mask[slot - lo, 0, 0, end:] = False
    in_order = slots == list(range(lo, hi))
    order = None if in_order else torch.tensor([slot - lo for slot in slots], device=device)
    return lo, hi, order, mask


def _decode_span(query, pool_k, pool_v, scaling: float, plan) -> torch.Tensor:
    """One SDPA call for every decode row: the pool's slots lo..hi-1 as a view, each row masked past its own
    length (rows of the range that are not in the step read garbage and are dropped)."""
    lo, hi, order, mask = plan
    k_len = mask.shape[-1]
    q = query
    if order is not None:
        q = query.new_zeros((hi - lo, *query.shape[1:]))
        q[order] = query
    out = F.scaled_dot_product_attention(q, pool_k[lo:hi, :, :k_len], pool_v[lo:hi, :, :k_len], attn_mask=mask,
                                         scale=scaling, enable_gqa=True)  # [span, Hq, 1, D]
    if order is not None:
        out = out[order]
    return out.transpose(1, 2)  # [R, 1, Hq, D]


def own_keys(pool: torch.Tensor, seg: Segment) -> torch.Tensor:
    """A segment's own keys (or values) at positions 0 .. end-1, [Hkv, end, D]: a view of its slot
    (pool [S, Hkv, L, D]), or its blocks gathered in table order (paged pool [N, Hkv, B, D])."""
    if seg.blocks is None:
        return pool[seg.slot, :, : seg.end_pos]
    blocks = pool.index_select(0, torch.tensor(seg.blocks, device=pool.device))  # [n, Hkv, B, D]
    return blocks.transpose(0, 1).reshape(pool.shape[1], -1, pool.shape[3])[:, : seg.end_pos]


def _causal(seg: Segment, device) -> torch.Tensor | None:
    """[n, end] bool, True where query t (position start + t) may see key j (j <= start + t); None
    for a single query, which sees every key of its range."""
    if seg.num_tokens == 1:
        return None
    positions = torch.arange(seg.start_pos, seg.end_pos, device=device)
    return torch.arange(seg.end_pos, device=device)[None, :] <= positions[:, None]


def _eager(q, k, v, allowed: torch.Tensor | None, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax(q k^T * scale) v for one segment, as transformers' eager attention (scores in the
    model dtype, softmax in float32). q [Hq, n, D], k and v [Hkv, end, D] (grouped-query heads share
    K/V without copies). Returns (output [Hq, n, D], probabilities [Hq, n, end])."""
    hq, n, d = q.shape
    hkv = k.shape[0]
    grouped = q.reshape(hkv, hq // hkv * n, d)  # heads of a group share their K/V head
    scores = (grouped @ k.transpose(1, 2) * scaling).reshape(hq, n, -1)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = (probs.reshape(hkv, -1, probs.shape[-1]) @ v).reshape(hq, n, d)
    return out, probs


def _add_flow(state: StepState, seg: Segment, probs: torch.Tensor) -> None:
    """Accumulate one segment's probabilities (summed over heads) into attn_sum [R, Q, K]."""
    if state.attn_sum is None:
        b = state.batch
        state.attn_sum = torch.zeros(b.allowed.shape, dtype=torch.float32, device=probs.device)
    rows = slice(seg.q_start, seg.q_start + seg.num_tokens)
    state.attn_sum[seg.row, rows, seg.key_start : seg.key_start + seg.end_pos] += probs.float().sum(dim=0)
    if seg is state.batch.segments[-1]:
        state.flow_terms += probs.shape[0]


def _repeat_kv(key: torch.Tensor, value: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention for the matmul paths: each of the [R, Hkv, K, D] key and value heads
    repeated `groups` times, to [R, Hkv * groups, K, D] (the SDPA path uses enable_gqa instead)."""
    if groups == 1:
        return key, value
    return key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)


def _masked(query, key, value, attention_mask, scaling: float, state: StepState | None) -> torch.Tensor:
    """The mask path over gathered keys [R, Hkv, K, D]: masked scores replaced by finfo.min, and a
    value row counted only where its probability is non-zero (0 x NaN stays 0)."""
    key, value = _repeat_kv(key, value, query.shape[1] // key.shape[1])
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        mask = attention_mask[:, :, :, : key.shape[-2]]
        scores = scores.masked_fill(mask != 0, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if state is not None and state.measure_flow:
        summed = probs.float().sum(dim=1)  # [R, Q, K] over heads
        state.attn_sum = summed if state.attn_sum is None else state.attn_sum + summed
        state.flow_terms += probs.shape[1]
    bad = ~torch.isfinite(value)
    if not bad.any():
        return torch.matmul(probs, value).transpose(1, 2).contiguous()
    out = torch.matmul(probs, value.masked_fill(bad, 0))
    reached = torch.matmul((probs != 0).to(value.dtype), bad.to(value.dtype)) > 0  # a non-finite value weighed
    return out.masked_fill(reached, float("nan")).transpose(1, 2).contiguous()


def _naive_fp16(query, key, value, attention_mask, scaling: float) -> torch.Tensor:
    """The fp16_cache fault: the whole attention in float16 with an additive mask whose -1e9 is -inf
    there, so a fully masked row is NaN and a zero weight times a NaN value is NaN."""
    dtype = query.dtype
    query, key, value = query.half(), key.half(), value.half()
    key, value = _repeat_kv(key, value, query.shape[1] // key.shape[1])
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : key.shape[-2]].half()
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, value).to(dtype).transpose(1, 2).contiguous()


_registered = False


def register_attention() -> str:
    """Register the "kvtui" attention and mask functions with transformers (idempotent); returns the name."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION_NAME, kvtui_attention)
        AttentionMaskInterface.register(ATTENTION_NAME, eager_mask)
        _registered = True
    return ATTENTION_NAME
