"""kvtui's fused forward for Llama-family models: the same arithmetic as transformers' modules, fewer
and larger matrix multiplies, on weights laid out for the CPU's GEMM.

What changes against `LlamaModel.forward` with the "kvtui" attention (and nothing else does):
  - q, k and v come from one matrix multiply over a fused [hidden, (Hq + 2 Hkv) D] weight, and gate and
    up from one over [hidden, 2 I]; the model's own q/k/v/gate/up/o/down `nn.Linear` weights become
    views into these fused tensors, so no weight is held twice and `model.generate` on the same
    instance still runs (on the same numbers).
  - every weight is stored in the layout this CPU multiplies fastest for the model's dtype, measured
    once per process (input_major_is_faster): input-major ([in, out] contiguous, the `nn.Linear`
    weight a transposed view; a tied LM head then gets an input-major copy, 113 MB for SmolLM2 in
    float32) when `x @ W` beats `F.linear`, else nn.Linear's own [out, in]. Measured: on an Intel
    CPU with AMX `x @ W` was 1.3-2.3x faster in float32 at 8-64 rows, where decode steps live
    (576 x 1536 at 8 rows 445 -> 226 us); on a 2-core AMD EPYC without AMX it gained nothing in
    float32 and was 6x slower in bfloat16 (a whole bf16 step 7x slower than the modules' path), so
    the layout is measured, not assumed (docs/performance.md). The two layouts may differ in the
    last bits at a few rows (another kernel).
  - one Python function per layer instead of transformers' module stack (decorators, kwargs
    plumbing, output recording), and no additive mask unless the step's attention path reads one.
The attention call itself is `kvtui_attention` through the same `PooledCacheLayer.update`, so the
attention paths, the attention_flow measurement and every fault that acts in attention see what
they see on the module path.

Numerics: RMSNorm in float32 then cast back, the model's own rotary module for cos/sin, SiLU, the
residual adds, all in the order transformers' Llama code uses (transformers 5.x modeling_llama.py).
Answers equal transformers' own solo `generate` on a separate instance token for token in float32
(tests/test_fused_forward.py and the parity tests, which run on this path by default).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from kvtui.engine.attention import kvtui_attention
from kvtui.engine.invariant import RowTiles, choose_tile

SUPPORTED_TYPES = ("llama",)


def supports(model) -> bool:
    """Whether `model` (a transformers causal LM) can run the fused forward: a Llama-family body
    (model_type "llama": Llama, SmolLM2, TinyLlama, ...) with SiLU MLPs."""
    cfg = model.config
    return getattr(cfg, "model_type", None) in SUPPORTED_TYPES and getattr(cfg, "hidden_act", "silu") == "silu"


def _fuse(linears: list[torch.nn.Linear], input_major: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight for `linears`, whose weights (and biases) become views into it: input-major
    [in, sum(out)] when `input_major`, else output-major [sum(out), in] (nn.Linear's own layout), and
    bias [sum(out)] or None."""
    if input_major:
        weight = torch.cat([lin.weight.detach().t() for lin in linears], dim=1).contiguous()  # [in, N]
    else:
        weight = torch.cat([lin.weight.detach() for lin in linears], dim=0).contiguous()  # [N, in]
    bias = None
    if linears[0].bias is not None:
        bias = torch.cat([lin.bias.detach() for lin in linears]).contiguous()
    start = 0
    for lin in linears:
        n = lin.out_features
        lin.weight.data = weight[:, start : start + n].t() if input_major else weight[start : start + n]
        if bias is not None:
            lin.bias.data = bias[start : start + n]
        start += n
    return weight, bias


def _mm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, input_major: bool) -> torch.Tensor:
    """x [..., in] times a fused weight, input-major [in, out] (x @ W) or output-major [out, in]
    (F.linear), plus bias [out] when given."""
    if input_major:
        out = x.matmul(weight)
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


_LAYOUTS: dict = {}  # (dtype, in, out) -> input-major is faster (measured once per process)


def input_major_is_faster(dtype: torch.dtype, in_features: int, out_features: int, rows: int = 8,
                          repeats: int = 5) -> bool:
    """Whether `x @ W` with W [in, out] contiguous beats `F.linear(x, W)` with W [out, in] on this CPU
    for `rows` rows of `dtype`: the median of `repeats` timed calls each (a few ms in all, once per
    shape and process). Measured Dec 2026: an Intel CPU with AMX gained 1.3-2.3x input-major in
    float32 at 8-64 rows; a 2-core AMD EPYC (avx512_bf16, no AMX) gained nothing in float32 and was
    6x slower input-major in bfloat16 and float16 (another kernel), so the layout is measured, not
    assumed."""
    key = (dtype, in_features, out_features)
    if key not in _LAYOUTS:
        x = torch.randn(rows, in_features).to(dtype)
        w_out = torch.randn(out_features, in_features).to(dtype)
        w_in = w_out.t().contiguous()

        def median(fn) -> float:
            fn()  # warm-up: the first call may pick and pack a kernel
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return sorted(times)[len(times) // 2]

        with torch.inference_mode():
            _LAYOUTS[key] = median(lambda: x.matmul(w_in)) < median(lambda: F.linear(x, w_out))
    return _LAYOUTS[key]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward: float32 variance, rsqrt, cast back, times the weight."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary_pos_emb for one of q or k [R, H, Q, D] (cos, sin [R, 1, Q, D])."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


class _Layer:
    """One decoder layer's fused weights and the modules the forward still calls."""

    def __init__(self, layer, index: int, input_major: bool) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.index = index
        self.input_major = input_major
        self.attn = attn
        self.qkv, self.qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj], input_major)
        self.q_size = attn.q_proj.out_features
        self.kv_size = attn.k_proj.out_features
        self.o, self.o_bias = _fuse([attn.o_proj], input_major)
        self.gate_up, self.gate_up_bias = _fuse([mlp.gate_proj, mlp.up_proj], input_major)
        self.inter = mlp.gate_proj.out_features
        self.down, self.down_bias = _fuse([mlp.down_proj], input_major)
        self.norm1, self.eps1 = layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon
        self.norm2, self.eps2 = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon
        self.head_dim = attn.head_dim


def fused_for(model) -> "FusedLlama":
    """The model's FusedLlama, built on first use and kept on the model (every engine over the same
    instance shares it; building re-lays about the model's size in bytes once)."""
    built = getattr(model, "_kvtui_fused", None)
    if built is None:
        built = FusedLlama(model)
        model._kvtui_fused = built
    return built


class FusedLlama:
    """The fused forward over a Llama-family `model`'s body (see the module docstring).

    Building it re-lays the model's linear weights (views, no copies kept); the model's own forward
    keeps working on them.

    Raises:
        ValueError: the model is not supported (see `supports`).
    """

    def __init__(self, model) -> None:
        if not supports(model):
            raise ValueError(f"the fused forward runs Llama-family models, not {model.config.model_type!r}")
        body = model.base_model
        self.embed = body.embed_tokens
        self.rotary = body.rotary_emb
        self.final_norm, self.final_eps = body.norm.weight, body.norm.variance_epsilon
        cfg = model.config
        self.input_major = input_major_is_faster(self.embed.weight.dtype, cfg.hidden_size, cfg.intermediate_size)
        self.layers = [_Layer(layer, i, self.input_major) for i, layer in enumerate(body.layers[: cfg.num_hidden_layers])]
        head = model.get_output_embeddings()
        if head.weight is self.embed.weight:  # tied: input-major, the head gets its own copy; else the rows
            weight = head.weight.detach()  # [V, hidden]
            self.head, self.head_bias = (weight.t().contiguous() if self.input_major else weight), None
        else:
            self.head, self.head_bias = _fuse([head], self.input_major)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on hidden states [S, hidden]: logits [S, V] in the model dtype."""
        return _mm(hidden, self.head, self.head_bias, self.input_major)

    def invariant_tiles(self) -> tuple[RowTiles, dict]:
        """The batch-invariant mode's RowTiles, chosen on this CPU (invariant.choose_tile on layer 0's
        projections and the LM head; every layer has layer 0's shapes), and the figures it chose by
        (tile size -> passed). Probed once per model instance and kept, so every engine over the model
        tiles alike."""
        if getattr(self, "_tiles", None) is None:
            layer = self.layers[0]
            shapes = [(layer.qkv, layer.qkv_bias), (layer.o, layer.o_bias), (layer.gate_up, layer.gate_up_bias),
                      (layer.down, layer.down_bias), (self.head, self.head_bias)]
            linears = [(lambda x, w=w, b=b: _mm(x, w, b, self.input_major),
                        w.shape[0] if self.input_major else w.shape[1]) for w, b in shapes]
            size, figures = choose_tile(linears, self.embed.weight.dtype)
            self._tiles = (RowTiles(size), figures)
        return self._tiles

    def _rope_table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, D] of the flat positions [N] from one table per position (the model's own rotary
        module run once over 0 .. L-1, L a power of two past the largest position), so a position's
        values never depend on the batch it is computed in."""
        need = int(positions.max()) + 1 if positions.numel() else 1
        table = getattr(self, "_rope", None)
        if table is None or table[0].shape[0] < need:
            size = max(512, 1 << (need - 1).bit_length())
            probe = torch.zeros(1, dtype=self.embed.weight.dtype, device=self.embed.weight.device)
            cos, sin = self.rotary(probe, position_ids=torch.arange(size, device=probe.device)[None])
            table = self._rope = (cos[0], sin[0])
        index = positions.clamp(min=0)
        return table[0][index], table[1][index]

    def invariant_logits(self, hidden: torch.Tensor, tiles: RowTiles) -> torch.Tensor:
        """The LM head on hidden states [S, hidden] in fixed row tiles: logits [S, V] in the model dtype."""
        return tiles.map(lambda h: _mm(h, self.head, self.head_bias, self.input_major), hidden)

    def invariant(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, cache, state,
                  tiles: RowTiles) -> torch.Tensor:
        """The body's forward in the batch-invariant mode (kvtui/engine/invariant.py): the same inputs and
        result as __call__ ([R, Q, hidden] final hidden states), every row-wise operation in `tiles`, the
        attention per query position (the state's `invariant` flag routes kvtui_attention there)."""
        rows, q_len, width = inputs_embeds.shape
        hidden = inputs_embeds.reshape(rows * q_len, width)
        cos, sin = self._rope_table(position_ids.reshape(-1))  # [N, D]
        for layer in self.layers:
            hidden = self._invariant_layer(layer, hidden, cos, sin, cache, state, tiles, rows, q_len)
        normed = tiles.map(lambda h: _rms_norm(h, self.final_norm, self.final_eps), hidden)
        return normed.reshape(rows, q_len, width)

    @staticmethod
    def _invariant_layer(layer: _Layer, hidden, cos, sin, cache, state, tiles: RowTiles, rows: int,
                         q_len: int) -> torch.Tensor:
        d = layer.head_dim

        def project(h, c, s):  # [T, hidden], [T, D] -> q [T, Hq, D], k, v [T, Hkv, D]
            qkv = _mm(_rms_norm(h, layer.norm1, layer.eps1), layer.qkv, layer.qkv_bias, layer.input_major)
            q, k, v = qkv.split((layer.q_size, layer.kv_size, layer.kv_size), dim=-1)
            c, s = c[:, None, :], s[:, None, :]
            return _rotate(q.reshape(len(h), -1, d), c, s), _rotate(k.reshape(len(h), -1, d), c, s), \
                v.reshape(len(h), -1, d)

        q, k, v = tiles.map(project, hidden, cos, sin)
        heads = lambda x: x.reshape(rows, q_len, -1, d).transpose(1, 2)  # noqa: E731  [R, H, Q, D]
        kwargs: dict = {}
        k, v = cache.layers[layer.index].update(heads(k), heads(v), kwargs=kwargs)
        out, _ = kvtui_attention(layer.attn, heads(q), k, v, None, scaling=layer.attn.scaling, **kwargs)

        def finish(h, o):  # [T, hidden], [T, Hq * D] -> [T, hidden]
            h = h + _mm(o, layer.o, layer.o_bias, layer.input_major)
            gate, up = _mm(_rms_norm(h, layer.norm2, layer.eps2), layer.gate_up, layer.gate_up_bias,
                           layer.input_major).split(layer.inter, dim=-1)
            return h + _mm(F.silu(gate) * up, layer.down, layer.down_bias, layer.input_major)

        return tiles.map(finish, hidden, out.reshape(rows * q_len, -1))

    def __call__(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, cache, state,
                 attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The body's forward: inputs_embeds [R, Q, hidden] (ModelRunner.input_embeds) and position_ids
        [R, Q] int64; `cache` the runner's PooledCache bound to `state`; attention_mask the [R, 1, Q, K]
        additive mask where the step's attention path reads one, else None. Returns the final hidden
        states [R, Q, hidden] (after the last norm)."""
        hidden = inputs_embeds
        cos, sin = self.rotary(hidden, position_ids=position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [R, 1, Q, D]
        for layer in self.layers:
            hidden = self._layer(layer, hidden, cos, sin, cache, state, attention_mask)
        return _rms_norm(hidden, self.final_norm, self.final_eps)

    @staticmethod
    def _layer(layer: _Layer, hidden, cos, sin, cache, state, attention_mask) -> torch.Tensor:
        rows, q_len = hidden.shape[:2]
        x = _rms_norm(hidden, layer.norm1, layer.eps1)
        qkv = _mm(x, layer.qkv, layer.qkv_bias, layer.input_major)  # [R, Q, (Hq + 2 Hkv) D]
        q, k, v = qkv.split((layer.q_size, layer.kv_size, layer.kv_size), dim=-1)
        shape = (rows, q_len, -1, layer.head_dim)
        q = _rotate(q.view(shape).transpose(1, 2), cos, sin)  # [R, Hq, Q, D]
        k = _rotate(k.view(shape).transpose(1, 2), cos, sin)  # [R, Hkv, Q, D]
        v = v.view(shape).transpose(1, 2)
        kwargs: dict = {}
        k, v = cache.layers[layer.index].update(k, v, kwargs=kwargs)
        out, _ = kvtui_attention(layer.attn, q, k, v, attention_mask, scaling=layer.attn.scaling, **kwargs)
        hidden = hidden + _mm(out.reshape(rows, q_len, -1), layer.o, layer.o_bias, layer.input_major)
        x = _rms_norm(hidden, layer.norm2, layer.eps2)
        gate, up = _mm(x, layer.gate_up, layer.gate_up_bias, layer.input_major).split(layer.inter, dim=-1)
        return hidden + _mm(F.silu(gate) * up, layer.down, layer.down_bias, layer.input_major)
