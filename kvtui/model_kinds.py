"""The kinds of model kvtui knows, typed (`ModelKind`), and `model_kind(config)`, the one rule that reads a
loaded model's kind from its config.

It imports nothing of kvtui, so the fault catalogue (kvtui/faults.py: the kinds each fault acts on) and the
model registry (kvtui/models/registry.py: the kind of each model name) both read it.
"""

from __future__ import annotations

from enum import Enum


class ModelKind(str, Enum):
    """The kind of a model: which faults act on it, and what its prompts carry.

    Each member is its string (`ModelKind.DECODER_ONLY == "decoder-only"`, `f"{ModelKind.IMAGE_TEXT}"` is
    "image-text"), so recordings (the header's `model.kind`), scenario files, the fault catalogue and the docs
    keep the strings they have always carried, and `ModelKind("encoder-decoder")` reads one back. A
    `(str, Enum)` rather than `enum.StrEnum`, which Python 3.10 lacks.

    Members:
        DECODER_ONLY: a causal LM over token ids (SmolLM2, the tiny Llama and GPT-2, a model folder or GGUF).
        ENCODER_DECODER: an encoder's output read through cross-attention (Whisper): audio in, text out.
        IMAGE_TEXT: a decoder-only LM with an image encoder (dinov2-smollm2, tiny-vision); a fault that acts on
            decoder-only models acts on these too.
        HYBRID: recurrent (gated-delta "linear attention") layers beside attention layers (tiny-qwen35moe): kvtui's
            engine keeps a recurrent-state slot per request beside its KV (kvtui/engine/state_side.py); the
            recurrent-state faults act on it, and only on it.
    """

    DECODER_ONLY = "decoder-only"
    ENCODER_DECODER = "encoder-decoder"
    IMAGE_TEXT = "image-text"
    HYBRID = "hybrid"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


def model_kind(config) -> ModelKind:
    """ModelKind.ENCODER_DECODER, HYBRID or DECODER_ONLY for a transformers model config (or anything with an
    `is_encoder_decoder` attribute): the one rule that says which kind a loaded model is, read by the
    engine's encoder and state sides and by LoadedModel.kind (which says IMAGE_TEXT when an image encoder is
    attached). HYBRID: `layer_types` names a "linear_attention" layer (Qwen3.5's gated delta net)."""
    if getattr(config, "is_encoder_decoder", False):
        return ModelKind.ENCODER_DECODER
    if "linear_attention" in (getattr(config, "layer_types", None) or ()):
        return ModelKind.HYBRID
    return ModelKind.DECODER_ONLY
