"""Model loading: the default SmolLM2 GGUF (converted once to a cached safetensors copy), local
Hugging Face directories, other GGUF files, and tiny random-weight test models.

    from kvtui.models import load_model
    lm = load_model("default")          # or "tiny-llama", "tiny-gpt2", a directory, a .gguf path
    lm.model, lm.tokenizer, lm.num_layers, lm.num_kv_heads, lm.head_dim, lm.eos_token_ids

The names below are imported on first use, so `kvtui.models.compat` (config checks, no torch) can be
imported by scenario validation without loading torch and transformers.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "DEFAULT_GGUF_SHA256": "default", "DEFAULT_MODEL_ID": "default", "INSTALL_COMMAND": "default",
    "cache_dir": "default", "default_model_path": "default",
    "model_label": "labels",
    "load_model": "loader", "parse_dtype": "loader", "check_model_available": "loader",
    "build_tiny": "tiny", "build_tiny_tokenizer": "tiny",
    "LoadedModel": "types", "ModelLoadError": "types",
    "load_tokenizer": "tokenizer",
}

__all__ = [
    "DEFAULT_GGUF_SHA256", "DEFAULT_MODEL_ID", "INSTALL_COMMAND", "LoadedModel", "ModelLoadError",
    "build_tiny", "build_tiny_tokenizer", "cache_dir", "check_model_available", "default_model_path", "load_model",
    "load_tokenizer",
    "parse_dtype",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
