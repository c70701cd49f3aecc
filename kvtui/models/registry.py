"""The model registry: every model name kvtui knows, and everything kvtui decides by that name.

Each entry gives a name (and its aliases) its kind (kvtui.model_kinds.ModelKind), its loader, its
tokenizer, what it needs installed, its geometry, and how messages name it. The loader (`load_model`,
`check_model_available`, the unknown-model message), `load_tokenizer`, the scenario schema and planner,
the `--llama-server` and prompt-embeds clients and `kvtui serve`'s defaults all read it; no other module
lists model names (tests/models/test_model_registry.py checks that with an ast pass).

Import-light: it imports nothing but kvtui.model_kinds. Loaders, tokenizers and checks are named as
"module:function" references and imported only when called (`resolve`), so importing the registry, or
the loader, imports neither torch (for the registry) nor Whisper's classes, ctranslate2, the image encoder
or the hybrid's transformers classes (for both).

Adding a model is one entry here plus its loader (a function `f(name, dtype, progress) -> LoadedModel` in
kvtui/models/); a new kind is a ModelKind member, and the faults that act on it say so in their `models`.
An entry without a loader is a model kvtui's engine does not run; its `refusal` line names what runs it
(none today: the hybrid, tiny-qwen35moe, runs on the engine with a recurrent-state pool, and on llama.cpp's
server through its GGUF).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvtui.model_kinds import ModelKind


@dataclass(frozen=True)
class ModelEntry:
    """One model kvtui knows by name.

    Attributes:
        name: the canonical name, lower-case: what `--model` and a scenario's `model:` take, and the loaded
            model's id (the default model's id is its file's, SmolLM2-135M-Instruct).
        kind: its ModelKind (which faults act on it, what its prompts must carry).
        label: how messages name it (e.g. the one-time conversion's status line: "converting SmolLM2 GGUF").
        aliases: other names `--model` takes for it (a scenario's `model:` takes `name` only).
        load: "module:function" of its loader, called as `f(name, dtype: torch.dtype, progress: bool)` and
            returning a LoadedModel; None for a model kvtui's engine does not run (`refusal` says what does).
        tokenizer: "module:function" returning its tokenizer with a chat template and a pad token, no weights
            read (what `kvtui validate` and `--target` runs plan prompts with).
        needs: "module:function" checks of what it needs installed, in order; each returns quietly or raises
            ModelLoadError with one line naming the pip command (check_model_available runs them, reading
            no weights).
        config: its geometry as a config.json would hold it, for checking a scenario without loading weights
            (kvtui.models.compat.read_config; tests/models/test_compat.py compares it with the loaded model's);
            None where not written down.
        gguf: "module:function" returning the GGUF file llama.cpp's server serves for it (`--llama-server`);
            None when it has none.
        embeds_from: the name of the entry whose input embedding table the rows of a prompt_embeds request
            come from when a server runs this model (kvtui.remote.embeds: its own for a tiny LM, the default
            model's for dinov2-smollm2, whose LM it is); None: prompt_embeds against such a server refused.
        refusal: the one line a load prints instead, for a model the engine does not run ("" otherwise).
        lora: whether it runs on kvtui's fused forward, which applies peft LoRA adapters (what `kvtui
            conformance` serves its two built-in adapters on).
    """

    name: str
    kind: ModelKind
    label: str
    aliases: tuple[str, ...] = ()
    load: str | None = None
    tokenizer: str = ""
    needs: tuple[str, ...] = ()
    config: Mapping | None = field(default=None, compare=False)
    gguf: str | None = None
    embeds_from: str | None = None
    refusal: str = ""
    lora: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        """The name and its aliases, in that order."""
        return (self.name, *self.aliases)

    @property
    def runs_on_engine(self) -> bool:
        """Whether kvtui's engine runs it (it has a loader)."""
        return self.load is not None


def resolve(ref: str):
    """The function a "module:function" reference names, importing its module now.

    Raises:
        ImportError, AttributeError: the reference names no such module or function (a registry mistake;
            tests/models/test_model_registry.py resolves every reference).
    """
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


_SMOLLM2_TOKENIZER = "kvtui.models.tokenizer:smollm2_tokenizer"
_TINY_TOKENIZER = "kvtui.models.tiny:build_tiny_tokenizer"
_SMOLLM2_FILE = "kvtui.models.default:default_model_path"

# Geometry of the named models, as a config.json would hold it. "default" is SmolLM2-135M-Instruct (the
# GGUF's llama.* metadata); the tiny ones are built in kvtui/models/tiny.py; the encoder-decoders give their
# decoder's geometry (its self-attention KV) and learned position table.
SMOLLM2 = ModelEntry(
    "default", ModelKind.DECODER_ONLY, "SmolLM2", aliases=("smollm2",), lora=True,
    load="kvtui.models.loader:load_default", tokenizer=_SMOLLM2_TOKENIZER, needs=(_SMOLLM2_FILE,),
    config={"model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
            "head_dim": 64, "hidden_size": 576, "max_position_embeddings": 8192,
            "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}},
    gguf=_SMOLLM2_FILE, embeds_from="default",
)
TINY_LLAMA = ModelEntry(
    "tiny-llama", ModelKind.DECODER_ONLY, "tiny-llama", lora=True,
    load="kvtui.models.loader:load_tiny", tokenizer=_TINY_TOKENIZER,
    config={"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "hidden_size": 64, "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    embeds_from="tiny-llama",
)
TINY_GPT2 = ModelEntry(
    "tiny-gpt2", ModelKind.DECODER_ONLY, "tiny-gpt2",
    load="kvtui.models.loader:load_tiny", tokenizer=_TINY_TOKENIZER,
    config={"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 64, "n_positions": 2048},
    embeds_from="tiny-gpt2",
)
WHISPER_TINY_EN = ModelEntry(
    "whisper-tiny.en", ModelKind.ENCODER_DECODER, "Whisper tiny.en",
    load="kvtui.models.loader:load_whisper_tiny_en", tokenizer="kvtui.models.tokenizer:whisper_tokenizer",
    needs=("kvtui.models.whisper:whisper_model_dir",),
    config={"model_type": "whisper", "decoder_layers": 4, "decoder_attention_heads": 6, "d_model": 384,
            "max_target_positions": 448},
)
TINY_WHISPER = ModelEntry(
    "tiny-whisper", ModelKind.ENCODER_DECODER, "tiny-whisper",
    load="kvtui.models.loader:load_tiny_whisper", tokenizer="kvtui.models.whisper:build_tiny_whisper_tokenizer",
    config={"model_type": "whisper", "decoder_layers": 2, "decoder_attention_heads": 4, "d_model": 64,
            "max_target_positions": 64},
)
DINOV2_SMOLLM2 = ModelEntry(
    "dinov2-smollm2", ModelKind.IMAGE_TEXT, "DINOv2-small + SmolLM2",
    load="kvtui.models.loader:load_dinov2_smollm2", tokenizer=_SMOLLM2_TOKENIZER,
    needs=(_SMOLLM2_FILE, "kvtui.models.dinov2:dinov2_onnx_path"), embeds_from="default",
)
TINY_VISION = ModelEntry(
    "tiny-vision", ModelKind.IMAGE_TEXT, "tiny-vision",
    load="kvtui.models.loader:load_tiny_vision", tokenizer=_TINY_TOKENIZER,
)
_HYBRID_NAME = "tiny-qwen35moe"
TINY_QWEN35MOE = ModelEntry(
    _HYBRID_NAME, ModelKind.HYBRID, "tiny-qwen35moe", tokenizer=_SMOLLM2_TOKENIZER,  # SmolLM2's tokenizer
    load="kvtui.models.hybrid:load_hybrid", gguf="kvtui.models.hybrid:hybrid_gguf",
)

# Every entry, in the order messages list them. The functions below read it on each call (8 entries).
ENTRIES: tuple[ModelEntry, ...] = (SMOLLM2, TINY_LLAMA, TINY_GPT2, WHISPER_TINY_EN, TINY_WHISPER, DINOV2_SMOLLM2,
                                   TINY_VISION, TINY_QWEN35MOE)


def find_model(name: str) -> ModelEntry | None:
    """The entry `name` names (its name or an alias, any case, spaces around ignored, as `--model` takes it),
    or None: a path, or a name kvtui does not know."""
    key = name.strip().lower() if isinstance(name, str) else None
    return next((entry for entry in ENTRIES if key in entry.names), None)


def known_names() -> tuple[str, ...]:
    """Every name and alias, in entry order (the names a mistyped `--model` is matched against)."""
    return tuple(name for entry in ENTRIES for name in entry.names)


def engine_names() -> tuple[str, ...]:
    """The canonical names of the models kvtui's engine runs, in entry order (a scenario's `model:` takes
    these, or a path)."""
    return tuple(entry.name for entry in ENTRIES if entry.runs_on_engine)


def accepted() -> str:
    """What `--model` takes, for the end of an error line: "use default (alias smollm2), tiny-llama, ...,
    a local Hugging Face model directory, or a path to a .gguf file"."""
    listed = [entry.name + (f" (alias {', '.join(entry.aliases)})" if entry.aliases else "")
              for entry in ENTRIES if entry.runs_on_engine]
    return f"use {', '.join(listed)}, a local Hugging Face model directory, or a path to a .gguf file"


def kind_of(name: str) -> ModelKind | None:
    """The kind of model `name` loads on kvtui's engine, for the names kvtui knows (any spelling `--model`
    takes); None for a path (its kind shows when it is loaded) or a model the engine does not run (its load
    says why)."""
    entry = find_model(name)
    return entry.kind if entry is not None and entry.runs_on_engine else None
