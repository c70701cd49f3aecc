"""What a model load returns, and the one error it raises."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from kvtui.model_kinds import ModelKind, model_kind


class ModelLoadError(Exception):
    """A model could not be loaded. The message is one user-facing line saying what to do."""


def one_line(exc: BaseException) -> str:
    """`Type: first line of message`, for embedding an underlying error in a ModelLoadError."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


@dataclass
class LoadedModel:
    """A model ready for inference, its tokenizer, and where it came from.

    Attributes:
        model: in eval() mode, every parameter with requires_grad False, in `dtype`, on the
            requested device. Weights are shared read-only state: never modify them.
        tokenizer: has a pad token; causal LMs' also a chat template (ChatML for SmolLM2 and the
            tiny models). Whisper's has none: its decoder prompt is [<|startoftranscript|>,
            <|notimestamps|>].
        model_id: "SmolLM2-135M-Instruct" for the default model, the registry name for the others
            ("tiny-llama", "whisper-tiny.en", "dinov2-smollm2", ...), or the path given.
        source_path: the GGUF file, CTranslate2 model.bin or model directory it came from (None for
            tiny models).
        source_sha256: hex sha256 of the GGUF file or model.bin when loaded from one, else None.
        dtype: the parameters' dtype.
        eos_token_ids: token ids that end a generation (generation config, tokenizer eos, and
            `<|im_end|>` when the chat template uses it), without duplicates.
        cache_path: the safetensors copy a GGUF or model.bin was converted into, when one is in use.
        feature_extractor: for Whisper models, the WhisperFeatureExtractor turning 16 kHz audio into
            log-mel input features [batch, 80, 3000]; None for text models.
        image_encoder: for image models (dinov2-smollm2, tiny-vision), the kvtui.models.vision.ImageEncoder
            turning pictures into LM input rows; None otherwise.
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    model_id: str
    source_path: str | None
    source_sha256: str | None
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    cache_path: str | None = None
    feature_extractor: Any = None
    image_encoder: Any = None

    @property
    def kind(self) -> ModelKind:
        """ModelKind.IMAGE_TEXT with an image encoder, else DECODER_ONLY or ENCODER_DECODER
        (kvtui.model_kinds.model_kind of its config); recorded in the header's model info as its string."""
        return ModelKind.IMAGE_TEXT if self.image_encoder is not None else model_kind(self.model.config)

    @property
    def _text_config(self):
        # the decoder's view of an encoder-decoder (Whisper: decoder_layers, decoder_attention_heads)
        return self.model.config.get_text_config(decoder=True)

    @property
    def num_layers(self) -> int:
        """Decoder layers (each has its own self-attention K/V cache)."""
        return int(self._text_config.num_hidden_layers)

    @property
    def num_heads(self) -> int:
        """Query heads per layer."""
        return int(self._text_config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads per layer (fewer than num_heads with grouped-query attention)."""
        kv = getattr(self._text_config, "num_key_value_heads", None)
        return int(kv) if kv is not None else self.num_heads

    @property
    def head_dim(self) -> int:
        """Size of one head's query/key/value vectors."""
        cfg = self._text_config
        head_dim = getattr(cfg, "head_dim", None)
        return int(head_dim) if head_dim else int(cfg.hidden_size) // self.num_heads

    @property
    def device(self) -> torch.device:
        """Where the parameters live."""
        return self.model.device

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of K and V that one cached token takes over all layers (in `dtype`, default
        the model's)."""
        itemsize = torch.empty((), dtype=dtype or self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


@contextlib.contextmanager
def quiet_progress_bars():
    """Hide transformers' "Loading weights" tqdm bar during a load, restoring the setting after."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
