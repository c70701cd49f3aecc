"""kvtui's fused forward for Llama-family models: the same arithmetic as transformers' modules, fewer
and larger matrix multiplies, on weights laid out for the CPU's GEMM.

What changes against `LlamaModel.forward` with the "kvtui" attention (and nothing else does):
  - q, k and v come from one matrix multiply over a fused [hidden, (Hq + 2 Hkv) D] weight, and gate and
    up from one over [hidden, 2 I]; the model's own q/k/v/gate/up/o/down `nn.Linear` weights become
    views into these fused tensors, so no weight is held twice and `model.generate` on the same
    instance still runs (on the same numbers).
  - every weight is stored input-major (a tied LM head, which shares the embedding's rows, as an
    input-major copy: 113 MB for SmolLM2 in float32) ([in, out] contiguous, i.e. the `nn.Linear` weight [out, in] is
    a transposed view). On this project's CPUs (MKL sgemm, one thread) `x @ W` with W [in, out]
    contiguous is 1.3-2.3x faster than `F.linear(x, W_out_in)` at 8-64 rows, where decode steps live
    (measured: 576 x 1536 at 8 rows 445 -> 226 us; docs/performance.md); at 16 rows and more the
    results are bitwise equal to F.linear, at fewer they differ in the last bits (another kernel).
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

import torch
import torch.nn.functional as F

from kvtui.engine.attention import kvtui_attention

SUPPORTED_TYPES = ("llama",)


def supports(model) -> bool:
    """Whether `model` (a transformers causal LM) can run the fused forward: a Llama-family body
    (model_type "llama": Llama, SmolLM2, TinyLlama, ...) with SiLU MLPs."""
    cfg = model.config
    return getattr(cfg, "model_type", None) in SUPPORTED_TYPES and getattr(cfg, "hidden_act", "silu") == "silu"


def _fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One input-major weight [in, sum(out)] (and bias [sum(out)] or None) for `linears`, whose
    weights (and biases) become views into it."""
    weight = torch.cat([lin.weight.detach().t() for lin in linears], dim=1).contiguous()  # [in, N]
    bias = None
    if linears[0].bias is not None:
        bias = torch.cat([lin.bias.detach() for lin in linears]).contiguous()
    start = 0
    for lin in linears:
        n = lin.out_features
        lin.weight.data = weight[:, start : start + n].t()  # [out, in] view, same values
        if bias is not None:
            lin.bias.data = bias[start : start + n]
        start += n
    return weight, bias


def _mm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ weight [in, out] (+ bias [out])."""
    out = x.matmul(weight)
    return out if bias is None else out + bias


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

    def __init__(self, layer, index: int) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.index = index
        self.attn = attn
        self.qkv, self.qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        self.q_size = attn.q_proj.out_features
        self.kv_size = attn.k_proj.out_features
        self.o, self.o_bias = _fuse([attn.o_proj])
        self.gate_up, self.gate_up_bias = _fuse([mlp.gate_proj, mlp.up_proj])
        self.inter = mlp.gate_proj.out_features
        self.down, self.down_bias = _fuse([mlp.down_proj])
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
        self.layers = [_Layer(layer, i) for i, layer in enumerate(body.layers[: model.config.num_hidden_layers])]
        head = model.get_output_embeddings()
        if head.weight is self.embed.weight:  # tied: the embedding keeps its rows, the head gets its own copy
            self.head, self.head_bias = head.weight.detach().t().contiguous(), None  # [hidden, V]
        else:
            self.head, self.head_bias = _fuse([head])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on hidden states [S, hidden]: logits [S, V] in the model dtype."""
        return _mm(hidden, self.head, self.head_bias)

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
        qkv = _mm(x, layer.qkv, layer.qkv_bias)  # [R, Q, (Hq + 2 Hkv) D]
        q, k, v = qkv.split((layer.q_size, layer.kv_size, layer.kv_size), dim=-1)
        shape = (rows, q_len, -1, layer.head_dim)
        q = _rotate(q.view(shape).transpose(1, 2), cos, sin)  # [R, Hq, Q, D]
        k = _rotate(k.view(shape).transpose(1, 2), cos, sin)  # [R, Hkv, Q, D]
        v = v.view(shape).transpose(1, 2)
        kwargs: dict = {}
        k, v = cache.layers[layer.index].update(k, v, kwargs=kwargs)
        out, _ = kvtui_attention(layer.attn, q, k, v, attention_mask, scaling=layer.attn.scaling, **kwargs)
        hidden = hidden + _mm(out.reshape(rows, q_len, -1), layer.o, layer.o_bias)
        x = _rms_norm(hidden, layer.norm2, layer.eps2)
        gate, up = _mm(x, layer.gate_up, layer.gate_up_bias).split(layer.inter, dim=-1)
        return hidden + _mm(F.silu(gate) * up, layer.down, layer.down_bias)
