"""Model loading: the default SmolLM2 GGUF (converted once to a cached safetensors copy), local
Hugging Face directories, other GGUF files, and tiny random-weight test models.

    from kvtui.models import load_model
    lm = load_model("default")          # or "tiny-llama", "tiny-gpt2", a directory, a .gguf path
    lm.model, lm.tokenizer, lm.num_layers, lm.num_kv_heads, lm.head_dim, lm.eos_token_ids
"""

from kvtui.models.default import (
    DEFAULT_GGUF_SHA256,
    DEFAULT_MODEL_ID,
    INSTALL_COMMAND,
    cache_dir,
    default_model_path,
)
from kvtui.models.loader import load_model, parse_dtype
from kvtui.models.tiny import TINY_NAMES, build_tiny, build_tiny_tokenizer
from kvtui.models.types import LoadedModel, ModelLoadError

__all__ = [
    "DEFAULT_GGUF_SHA256",
    "DEFAULT_MODEL_ID",
    "INSTALL_COMMAND",
    "TINY_NAMES",
    "LoadedModel",
    "ModelLoadError",
    "build_tiny",
    "build_tiny_tokenizer",
    "cache_dir",
    "default_model_path",
    "load_model",
    "parse_dtype",
]
