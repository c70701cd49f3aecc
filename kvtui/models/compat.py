"""Can kvtui run this model batch-invariantly, and how big is its KV cache? Answered from a model
config alone (a transformers config object or the plain dict of a config.json), so a scenario can be
checked without loading weights. Imports neither torch nor transformers.

Two kinds of model break the engine's promise that a request's tokens do not depend on its
neighbours, and are refused:

- RoPE whose frequencies depend on the sequence length. transformers' "dynamic" NTK RoPE recomputes
  the rotary frequencies from the largest position id in the whole forward (and keeps them for later
  forwards); "longrope" switches between its short and long factors once the largest position passes
  `original_max_position_embeddings`. In a batch the largest position is the longest neighbour's, so
  a short request's rotations change with who it is batched with. (transformers:
  modeling_rope_utils.dynamic_rope_update.) Static variants (default, linear, yarn, llama3,
  proportional) compute their frequencies once and are accepted.
- A learned position table shorter than the engine's max_len (GPT-2: `n_positions` rows). A
  position past the table raises IndexError inside the embedding lookup and kills the whole step.
  RoPE models have no table: positions past max_position_embeddings still compute.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvtui.models import registry

# Geometry of the named models (each name and alias), as a config.json would hold it: the registry entries'
# `config`. Checked against the loaded models in tests/models/test_compat.py.
NAMED_CONFIGS: dict[str, Mapping] = {name: entry.config for entry in registry.ENTRIES if entry.config is not None
                                     for name in entry.names}

# RoPE keys: a config holding any of these (not null) has rotary positions, not a learned table.
_ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta", "rotary_dim", "rotary_pct", "rotary_emb_base")


class IncompatibleModel(ValueError):
    """A model (or model + max_len) the engine cannot serve. The message is one line,
    `<problem>; <fix>`; both parts are kept as attributes."""

    def __init__(self, problem: str, fix: str):
        super().__init__(f"{problem}; {fix}")
        self.problem, self.fix = problem, fix


@dataclass(frozen=True)
class ModelShape:
    """What sizes the KV pool, from a config.

    Attributes:
        num_layers: decoder layers (each has its own K and V).
        num_kv_heads: key/value heads per layer.
        head_dim: size of one head's key/value vector.
        learned_positions: rows of a learned position table (GPT-2's n_positions), None with RoPE.
        positions_field: the config field holding learned_positions ("n_positions").
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    learned_positions: int | None = None
    positions_field: str | None = None

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes of K and V one cached token takes over all layers: 2 * layers * kv_heads * head_dim *
        itemsize (itemsize: bytes per element, 4 for float32, 2 for float16/bfloat16)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def _get(cfg, *names):
    """The first of `names` set (not None) in a config object or dict, else None."""
    for name in names:
        value = cfg.get(name) if isinstance(cfg, Mapping) else getattr(cfg, name, None)
        if value is not None:
            return value
    return None


def _text_config(cfg):
    """The language model's part of a multimodal config (text_config), the decoder's view of an
    encoder-decoder config (transformers' get_text_config(decoder=True): Whisper's decoder_layers and
    decoder_attention_heads, not the encoder's), or `cfg` itself."""
    if not isinstance(cfg, Mapping) and hasattr(cfg, "get_text_config"):
        return cfg.get_text_config(decoder=True)
    inner = _get(cfg, "text_config")
    return inner if inner is not None else cfg


def has_rope(cfg) -> bool:
    """True when the config describes rotary position embeddings."""
    return _get(_text_config(cfg), *_ROPE_KEYS) is not None


def shape_from_config(cfg) -> ModelShape:
    """ModelShape from a config (Llama names or GPT-2 names).

    Raises:
        ValueError: the config lacks the layer or head counts.
    """
    cfg = _text_config(cfg)
    # An encoder-decoder's KV cache is the decoder's. A config object's decoder view (see _text_config)
    # maps num_hidden_layers / num_attention_heads onto the decoder's (its decoder_* fields are then
    # defaults, not the model's); in a config.json dict the decoder_* fields themselves win.
    dec = isinstance(cfg, Mapping)
    layers = _get(cfg, *(["decoder_layers"] if dec else []), "num_hidden_layers", "n_layer", "num_layers")
    heads = _get(cfg, *(["decoder_attention_heads"] if dec else []), "num_attention_heads", "n_head")
    if not isinstance(layers, int) or not isinstance(heads, int) or heads < 1 or layers < 1:
        raise ValueError("config has no num_hidden_layers / num_attention_heads")
    kv_heads = _get(cfg, *(["decoder_attention_heads"] if dec else []), "num_key_value_heads") or heads
    head_dim = _get(cfg, "head_dim") or int(_get(cfg, "hidden_size", "n_embd", "d_model") or 0) // heads
    learned, field = None, None
    if not has_rope(cfg):
        for name in ("n_positions", "max_position_embeddings", "max_target_positions"):
            value = _get(cfg, name)
            if isinstance(value, int):
                learned, field = value, name
                break
    return ModelShape(int(layers), int(kv_heads), int(head_dim), learned, field)


def rope_types(cfg) -> list[str]:
    """Every rope_type a config names (one per layer type for configs with per-layer RoPE)."""
    params = _get(_text_config(cfg), "rope_parameters", "rope_scaling")
    if not isinstance(params, Mapping):
        return []
    tables = [v for v in params.values() if isinstance(v, Mapping)] or [params]
    return [str(t.get("rope_type", t.get("type", "default"))) for t in tables]


def length_dependent_rope(cfg) -> str | None:
    """The rope_type whose frequencies depend on the batch's longest sequence ("dynamic", "longrope",
    any "*dynamic*" variant), or None."""
    for rope_type in rope_types(cfg):
        if "dynamic" in rope_type or rope_type == "longrope":
            return rope_type
    return None


def check_batch_invariant(cfg) -> None:
    """Refuse a model whose outputs depend on its batch neighbours by construction.

    Raises:
        IncompatibleModel: a sequence-length-dependent RoPE (see the module docstring).
    """
    rope_type = length_dependent_rope(cfg)
    if rope_type:
        raise IncompatibleModel(
            f"rope_type {rope_type!r} recomputes the rotary frequencies from the longest sequence in each "
            "batch, so a request's tokens would depend on its neighbours",
            "use a copy of the model whose config.json sets rope_type 'default' (or a static scaling such "
            "as 'linear' or 'yarn')")


def check_max_len(cfg, max_len: int) -> None:
    """Refuse a max_len (tokens per KV slot) past the model's learned position table.

    Raises:
        IncompatibleModel: "max_len 2200 exceeds the model's 2048 learned positions (n_positions); ...".
    """
    shape = shape_from_config(cfg)
    if shape.learned_positions is not None and max_len > shape.learned_positions:
        raise IncompatibleModel(
            f"max_len {max_len} exceeds the model's {shape.learned_positions} learned positions "
            f"({shape.positions_field})", "lower engine.max_len")


def check_decoder_only(cfg) -> None:
    """Refuse an encoder-decoder model other than Whisper: the engine runs decoder-only models and
    Whisper (its encoder at admission, cross-attention per request: kvtui/engine/encoder.py).

    Raises:
        IncompatibleModel: "an encoder-decoder model (t5) ...".
    """
    if _get(cfg, "is_encoder_decoder") and _get(cfg, "model_type") != "whisper":
        raise IncompatibleModel(
            f"an encoder-decoder model ({_get(cfg, 'model_type') or 'unknown'}): the engine runs decoder-only "
            "models and Whisper", "use the default model, tiny-llama, tiny-gpt2, whisper-tiny.en or another "
            "decoder-only model")


def check_model(cfg, max_len: int) -> None:
    """check_decoder_only, check_batch_invariant and check_max_len in one call (what Engine.__init__
    and scenario validation run).

    Raises:
        IncompatibleModel: see those three.
    """
    check_decoder_only(cfg)
    check_batch_invariant(cfg)
    check_max_len(cfg, max_len)


def read_config(model: str, base_dir: Path | None = None) -> Mapping | None:
    """The config of a scenario's `model` without loading weights: a named model's from
    NAMED_CONFIGS, a folder's config.json, a .gguf file's metadata (gguf package). None when it
    cannot be read (the run-time checks still apply then)."""
    if model in NAMED_CONFIGS:
        return NAMED_CONFIGS[model]
    path = Path(model).expanduser()
    if not path.is_absolute():
        path = (base_dir or Path.cwd()) / path
    try:
        if path.is_dir():
            data = json.loads((path / "config.json").read_text(encoding="utf-8"))
            return data if isinstance(data, Mapping) else None
        if path.is_file() and path.suffix.lower() == ".gguf":
            return gguf_config(path)
    except (OSError, ValueError, RecursionError):
        return None
    return None


def gguf_config(path: Path) -> dict | None:
    """A config dict from a GGUF file's `{arch}.*` metadata (layers, heads, head size, context
    length, RoPE scaling type), or None when the keys are missing. Parses the header only.

    Raises:
        OSError, ValueError: the file cannot be read as GGUF.
    """
    from gguf import GGUFReader

    try:
        fields = GGUFReader(path).fields
    except (KeyError, IndexError, TypeError) as e:  # a malformed header
        raise ValueError(f"not a GGUF file ({type(e).__name__})") from None

    def value(key: str):
        field = fields.get(key)
        return field.contents() if field is not None else None

    arch = value("general.architecture")
    layers, heads = value(f"{arch}.block_count"), value(f"{arch}.attention.head_count")
    if not isinstance(layers, int) or not isinstance(heads, int):
        return None
    cfg: dict = {"model_type": arch, "num_hidden_layers": layers, "num_attention_heads": heads,
                 "num_key_value_heads": value(f"{arch}.attention.head_count_kv") or heads,
                 "hidden_size": value(f"{arch}.embedding_length"),
                 "head_dim": value(f"{arch}.attention.key_length")}
    context = value(f"{arch}.context_length")
    if arch in ("gpt2", "starcoder"):  # learned position tables; the other architectures use RoPE
        cfg["n_positions"] = context
    else:
        cfg["max_position_embeddings"] = context
        cfg["rope_parameters"] = {"rope_type": value(f"{arch}.rope.scaling.type") or "default"}
    return cfg
