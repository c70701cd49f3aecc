"""kvtui's fused forward for Llama-family models: the same arithmetic as transformers' modules, fewer
and larger matrix multiplies, on weights laid out for the CPU's GEMM.

What changes against `LlamaModel.forward` with the "kvtui" attention (and nothing else does):
  - q, k and v come from one matrix multiply over a fused weight, and gate and up from one; each fused
    weight is held once, in the layout of the linear kernel chosen for this CPU by measurement at load
    (kvtui/engine/linear.py: F.linear, tiled F.linear, input-major `x @ W`, or oneDNN prepacked), and the model's own
    q/k/v/gate/up/o/down modules keep working on it (views into it, or PackedSlice modules over a
    prepacked weight), so `model.generate` on the same instance still runs. A tied LM head stays the
    embedding table (re-laid input-major in place when that multiplies faster), or, where a oneDNN
    prepacked copy of the table measured fastest at load, runs on that copy (the embedding keeps the table).
  - one Python function per layer instead of transformers' module stack (decorators, kwargs
    plumbing, output recording), and no additive mask unless the step's attention path reads one.
  - element-wise work with fewer temporaries, exactly: q and k rotated in one pass, the residual adds
    and SiLU x up in place.
The attention call itself is `kvtui_attention` through the same `PooledCacheLayer.update`, so the
attention paths, the attention_flow measurement and every fault that acts in attention see what
they see on the module path.

Numerics: RMSNorm in float32 then cast back, the model's own rotary module for cos/sin, SiLU, the
residual adds, all in the order transformers' Llama code uses (transformers 5.x modeling_llama.py).
Answers equal transformers' own solo `generate` on a separate instance token for token in float32
(tests/engine/test_fused_forward.py and the parity tests, which run on this path by default).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from kvtui.engine import cpu_kernels
from kvtui.engine.attention import kvtui_attention
from kvtui.engine.invariant import RowTiles, choose_tile
from kvtui.engine.linear import FusedLinear, choose_kernel

SUPPORTED_TYPES = ("llama",)


def supports(model) -> bool:
    """Whether `model` (a transformers causal LM) can run the fused forward: a Llama-family body
    (model_type "llama": Llama, SmolLM2, TinyLlama, ...) with SiLU MLPs."""
    cfg = model.config
    return getattr(cfg, "model_type", None) in SUPPORTED_TYPES and getattr(cfg, "hidden_act", "silu") == "silu"


def auto_batch_invariant(loaded, config, detectors: tuple[str, ...]) -> bool:
    """engine.batch_invariant left unset (null): on for a bfloat16 or float16 run whose reference detector
    runs, on a model the mode runs (Llama-family, kvtui's fused forward); off otherwise. There, rounding
    flips near ties batched against solo, and the mode makes the reference check exact for about 1.2x
    (float32) to 1.4x (bfloat16) the step time (measured on a 2-core AMD EPYC, docs/performance.md).

    Args:
        loaded: the LoadedModel (its dtype and model); config: the run's EngineConfig; detectors: the
            detector names the run uses."""
    low = loaded.dtype in (torch.bfloat16, torch.float16)
    return low and "reference" in detectors and not config.enforce_eager and supports(loaded.model)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward: float32 variance, rsqrt, cast back, times the weight."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary_pos_emb for q or k, or both at once: x [..., D] with cos, sin broadcasting to it.
    transformers' arithmetic, (x * cos) + (rotate_half(x) * sin) with rotate_half(x) = (-x2, x1), bit for
    bit ((-x2) * s is -(x2 * s) exactly), written into one product buffer instead of a negated copy,
    a concatenation and two products."""
    half = x.shape[-1] // 2
    out = x * cos
    rotated = torch.empty_like(out)
    torch.mul(x[..., half:], sin[..., :half], out=rotated[..., :half]).neg_()
    torch.mul(x[..., :half], sin[..., half:], out=rotated[..., half:])
    return out.add_(rotated)


class _Layer:
    """One decoder layer's fused linear layers and the modules the forward still calls."""

    def __init__(self, layer, index: int, kernel: str) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.index = index
        self.attn = attn
        self.q_size = attn.q_proj.out_features
        self.kv_size = attn.k_proj.out_features
        self.inter = mlp.gate_proj.out_features
        self.qkv = FusedLinear([attn.q_proj, attn.k_proj, attn.v_proj], kernel,
                               [(attn, "q_proj"), (attn, "k_proj"), (attn, "v_proj")])
        self.o = FusedLinear([attn.o_proj], kernel, [(attn, "o_proj")])
        self.gate_up = FusedLinear([mlp.gate_proj, mlp.up_proj], kernel, [(mlp, "gate_proj"), (mlp, "up_proj")])
        self.down = FusedLinear([mlp.down_proj], kernel, [(mlp, "down_proj")])
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


def kernel_choice(model, announce=None) -> dict:
    """The linear kernels for `model` (a Llama-family causal LM) on this machine: linear.choose_kernel on
    its layer shapes, layer count and LM head, stored or measured now (`announce` hears about a
    measurement). FusedLlama builds on this choice; calling it at load time makes the one-time
    measurement visible where a status line can be printed."""
    built = getattr(model, "_kvtui_fused", None)
    if built is not None:  # already re-laid (a prepacked head has no .weight left to look at)
        return built.kernel_choice
    cfg = model.config
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embed.weight.device.type != "cpu":  # the candidates and their timings are CPU kernels
        return {"kernel": "linear", "head_kernel": "linear", "ms": {},
                "why": f"the model is on {embed.weight.device.type}: F.linear (the measured kernels are the CPU's)"}
    return choose_kernel(embed.weight.dtype, layer_shapes(cfg), cfg.num_hidden_layers,
                         (head.in_features, head.out_features), head.weight is embed.weight, announce)


def choose_kernels_at_load(model, announce) -> None:
    """Pick the linear kernel now for a model the fused forward runs on the CPU (others: nothing), so a
    one-time measurement (about 15 s for SmolLM2) is announced (`announce`, one line) before a run or a
    server starts instead of pausing its first step."""
    if supports(model) and model.device.type == "cpu":
        kernel_choice(model, announce)


def layer_shapes(config) -> list[tuple[int, int]]:
    """(in, out) of a Llama layer's four fused linear layers: qkv, o, gate_up, down."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    q = config.num_attention_heads * head_dim
    return [(hidden, q + 2 * kv_heads * head_dim), (q, hidden), (hidden, 2 * inter), (inter, hidden)]


class FusedLlama:
    """The fused forward over a Llama-family `model`'s body (see the module docstring).

    Building it re-lays the model's linear weights in the kernel chosen for this machine
    (kvtui/engine/linear.py: `kernel`, `kernel_choice`), keeping one copy of each; the model's own
    forward keeps working on them.

    Raises:
        ValueError: the model is not supported (see `supports`), or $KVTUI_LINEAR_KERNEL is invalid.
    """

    def __init__(self, model) -> None:
        if not supports(model):
            raise ValueError(f"the fused forward runs Llama-family models, not {model.config.model_type!r}")
        body = model.base_model
        self.embed = body.embed_tokens
        self.rotary = body.rotary_emb
        self.final_norm, self.final_eps = body.norm.weight, body.norm.variance_epsilon
        cfg = model.config
        head = model.get_output_embeddings()
        tied = head.weight is self.embed.weight
        self.kernel_choice = kernel_choice(model)
        self.kernel = self.kernel_choice["kernel"]
        self.layers = [_Layer(layer, i, self.kernel) for i, layer in enumerate(body.layers[: cfg.num_hidden_layers])]
        # tied: the embedding table is the head, re-laid in place (input-major: the embedding reads rows of
        # the transposed view); untied: the head's own weight, prepacked where that won
        owners = None if tied else [(model, _attribute_of(model, head))]
        self.head = FusedLinear([head], self.kernel_choice["head_kernel"], owners)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on hidden states [S, hidden]: logits [S, V] in the model dtype."""
        return self.head(hidden)

    def invariant_tiles(self) -> tuple[RowTiles, dict]:
        """The batch-invariant mode's RowTiles, chosen on this CPU (invariant.choose_tile on layer 0's
        projections and the LM head; every layer has layer 0's shapes), and the figures it chose by
        (tile size -> passed). Probed once per model instance and kept, so every engine over the model
        tiles alike."""
        if getattr(self, "_tiles", None) is None:
            layer = self.layers[0]
            linears = [(lin, lin.in_features) for lin in (layer.qkv, layer.o, layer.gate_up, layer.down, self.head)]
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
        return tiles.map(self.head, hidden)

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
            qkv = layer.qkv(_rms_norm(h, layer.norm1, layer.eps1))
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
            h = h + layer.o(o)
            gate, up = layer.gate_up(_rms_norm(h, layer.norm2, layer.eps2)).split(layer.inter, dim=-1)
            return h + layer.down(F.silu(gate) * up)

        return tiles.map(finish, hidden, out.reshape(rows * q_len, -1))

    def __call__(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, cache, state,
                 attention_mask: torch.Tensor | None, lora=None) -> torch.Tensor:
        """The body's forward: inputs_embeds [R, Q, hidden] (ModelRunner.input_embeds, which this forward
        may overwrite) and position_ids [R, Q] int64; `cache` the runner's PooledCache bound to `state`;
        attention_mask the [R, 1, Q, K] additive mask where the step's attention path reads one, else None;
        `lora` the step's per-row LoRA adapters (engine/lora.py LoraBatch) or None.
        Returns the final hidden states [R, Q, hidden] (after the last norm)."""
        hidden = inputs_embeds
        cos, sin = self.rotary(hidden, position_ids=position_ids)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [R, Q, 1, D]: q and k heads rotate together
        linear = _linear if lora is None else partial(_lora_linear, lora)
        for layer in self.layers:
            hidden = self._layer(layer, hidden, cos, sin, cache, state, attention_mask, linear)
        return _rms_norm(hidden, self.final_norm, self.final_eps)

    @staticmethod
    def _layer(layer: _Layer, hidden, cos, sin, cache, state, attention_mask, linear) -> torch.Tensor:
        """One decoder layer on hidden [R, Q, hidden] (updated in place: the residual adds); `linear`
        runs a fused linear layer (the base multiply, plus each row's LoRA delta)."""
        rows, q_len = hidden.shape[:2]
        d = layer.head_dim
        native = cpu_kernels.elementwise(hidden)  # the element-wise parts on kvtui's C++ kernels
        x = cpu_kernels.rms_norm(hidden, layer.norm1, layer.eps1) if native else _rms_norm(hidden, layer.norm1, layer.eps1)
        qkv = linear(layer, "qkv", x)  # [R, Q, (Hq + 2 Hkv) D]
        split = layer.q_size + layer.kv_size
        if native and qkv.is_contiguous():
            cpu_kernels.rotate_(qkv, split // d, d, cos, sin)
            qk = qkv[..., :split].view(rows, q_len, -1, d)  # [R, Q, Hq + Hkv, D], rotated in place
        else:
            qk = _rotate(qkv[..., :split].view(rows, q_len, -1, d), cos, sin)
        heads = layer.q_size // d
        q = qk[:, :, :heads].transpose(1, 2)  # [R, Hq, Q, D]
        k = qk[:, :, heads:].transpose(1, 2)  # [R, Hkv, Q, D]
        v = qkv[..., split:].view(rows, q_len, -1, d).transpose(1, 2)
        kwargs: dict = {}
        k, v = cache.layers[layer.index].update(k, v, kwargs=kwargs)
        out, _ = kvtui_attention(layer.attn, q, k, v, attention_mask, scaling=layer.attn.scaling, **kwargs)
        o = linear(layer, "o", out.reshape(rows, q_len, -1))
        if native:
            gate_up = linear(layer, "gate_up", cpu_kernels.add_rms_norm(hidden, o, layer.norm2, layer.eps2))
            return hidden.add_(linear(layer, "down", cpu_kernels.silu_mul(gate_up, layer.inter)))
        gate, up = linear(layer, "gate_up", _rms_norm(hidden.add_(o), layer.norm2, layer.eps2)).split(layer.inter, dim=-1)
        return hidden.add_(linear(layer, "down", F.silu(gate).mul_(up)))


def _linear(layer: _Layer, name: str, x: torch.Tensor) -> torch.Tensor:
    """The layer's fused linear layer `name` (qkv, o, gate_up, down) on x [..., in]."""
    return getattr(layer, name)(x)


def _lora_linear(lora, layer: _Layer, name: str, x: torch.Tensor) -> torch.Tensor:
    """The fused linear layer `name` on x [..., in] plus each row's LoRA delta (engine/lora.py)."""
    return lora.apply(layer.index, name, x, getattr(layer, name)(x))


def _attribute_of(parent: torch.nn.Module, child: torch.nn.Module) -> str:
    """The attribute name under which `parent` holds `child` directly (e.g. "lm_head")."""
    return next(name for name, module in parent.named_children() if module is child)
