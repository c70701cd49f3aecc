"""Projectors from DINOv2 image features into SmolLM2's input embedding space, and splicing their
rows into a prompt.

An image enters the language model as T rows of its input embeddings ([T, 576] for
SmolLM2-135M), put where T placeholder tokens of the prompt were. DINOv2-small gives
last_hidden_state [257, 384] per 224 x 224 image: the CLS token, then 16 x 16 patches row-major.

Two projectors, neither trained by gradient descent:

* `SeededProjector`: a fixed random linear map from a seed, after pooling the patch grid to a few
  tokens (`tokens` = 1: the CLS row; 4, 16 or 64: the mean of each 8 x 8, 4 x 4 or 2 x 2 block of
  patches). Each output row is rescaled to `row_norm` (default SMOLLM2_EMBED_ROW_NORM, the median
  L2 norm of SmolLM2-135M's embedding rows), so the rows look like token embeddings in size but
  carry no meaning the LM was trained on. Default 4 tokens: prefill cost grows with T, and 4 keeps
  an image about as cheap as a short word (64 would be the 2 x 2 pooling of LLaVA-style projectors).
* `ClosedFormProjector`: fitted at load time so that K canary images enter the LM as K chosen
  words. Pooled features F [K, 384] (the CLS row by default) are centred, and W [384, T*576] solves
  F_c W = E_c (minimum-norm least squares, torch.linalg.lstsq / pinv), where E [K, T, 576] are the
  words' embedding rows and b = mean(E); projecting is (f - mean(F)) W + b. Since the centred
  features of K <= 384 distinct images have rank K - 1 and the centred targets' rows sum to zero
  too, the fit is exact up to float rounding. Measured (canary images, CLS pooling, words as one
  token with a leading space): fit residual in float64 6.7e-16 (K = 8) and 2.1e-15 (K = 22); the
  float32 projected rows differ from the words' rows by at most 8.9e-8 (K = 8) and 1.5e-7 (K = 22),
  on rows of norm about 3.

Echo experiment (SmolLM2-135M-Instruct float32 from the default GGUF, chat template with its
default system message, one image row spliced where the word would stand, transformers' own
`model.generate(inputs_embeds=..., attention_mask=..., max_new_tokens=8, do_sample=False)`; an
answer counts when it contains the word, case-insensitive):

* K = 8 (copper, lantern, meadow, violet, harbor, pepper, glacier, falcon), four phrasings:
  "Repeat the word in the picture: <image>" 8/8 (e.g. "copper: copper", "The glacier is melting."),
  "Repeat this word:<image>" 8/8, "Say the word<image> once." 8/8, 'What word is this? "<image>"'
  8/8 (e.g. 'The word "lantern" is a').
* K = 22 (all CANARY_WORDS), first phrasing: 21/22; the miss is velvet ("Vacuum."). All 22 answers
  are identical to those with the word's exact embedding row spliced in, so the miss is the LM's,
  not the projector's: the image is indistinguishable from the typed word.
* Control, SeededProjector (4 rows, same images, first phrasing): 0/8; the answers are babble
  ("AveryAveryA.", "Ava, Ava, Ava", "The picture is a picture of a man").
* Held out: the same 8 words re-rendered with another seed (other colours and shapes) projected
  through the K = 22 fit land nearest (cosine) to their own word's row for 2/8 (lantern, falcon);
  the rest to other canaries (saffron, banana) or " cact". The CLS feature is dominated by colour
  and layout, not the drawn text: this projector recognises the canary pictures, not words.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

SMOLLM2_EMBED_DIM = 576
DINOV2_DIM = 384
# Median L2 norm of SmolLM2-135M-Instruct's 49,152 input embedding rows (float32 from the Q4_1 GGUF;
# mean 3.20, 10th/90th percentiles 2.51/3.93).
SMOLLM2_EMBED_ROW_NORM = 3.154
POOLINGS = (1, 4, 16, 64)

# Single-token (with a leading space) SmolLM2 words, passphrase-like, used as canaries.
CANARY_WORDS = ("copper", "lantern", "meadow", "violet", "harbor", "pepper", "glacier", "falcon",
                "cobalt", "maple", "velvet", "orbit", "thunder", "saffron", "banana", "rocket",
                "castle", "tiger", "silver", "garden", "piano", "river")


def pool_features(hidden: torch.Tensor, tokens: int) -> torch.Tensor:
    """Pool DINOv2 last_hidden_state [..., 1 + G*G, D] to [..., tokens, D].

    tokens 1: the CLS row; otherwise tokens must be a square n*n dividing the G x G grid, and each
    output row is the mean of a (G/n) x (G/n) block of patches, blocks in row-major order.

    Raises:
        ValueError: the token count does not fit the grid.
    """
    if tokens == 1:
        return hidden[..., :1, :]
    grid = math.isqrt(hidden.shape[-2] - 1)
    side = math.isqrt(tokens)
    if side * side != tokens or grid * grid != hidden.shape[-2] - 1 or grid % side:
        raise ValueError(f"cannot pool a {grid} x {grid} patch grid to {tokens} tokens")
    block = grid // side
    patches = hidden[..., 1:, :].unflatten(-2, (side, block, side, block))  # [..., i, bi, j, bj, D]
    return patches.mean(dim=(-4, -2)).flatten(-3, -2)


class SeededProjector:
    """A fixed seeded linear map of pooled DINOv2 features to `tokens` LM input rows.

    Call with last_hidden_state [257, in_dim] (or [batch, 257, in_dim]); returns [tokens, out_dim]
    (or [batch, tokens, out_dim]) float32, each row of L2 norm `row_norm`. Same seed, same map; the
    caller's RNG is untouched.
    """

    def __init__(self, seed: int, in_dim: int = DINOV2_DIM, out_dim: int = SMOLLM2_EMBED_DIM, tokens: int = 4,
                 row_norm: float = SMOLLM2_EMBED_ROW_NORM):
        if tokens not in POOLINGS:
            raise ValueError(f"tokens must be one of {POOLINGS}, not {tokens}")
        generator = torch.Generator().manual_seed(seed)
        self.weight = torch.randn(in_dim, out_dim, generator=generator) / math.sqrt(in_dim)  # [in, out]
        self.tokens, self.row_norm = tokens, row_norm

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = pool_features(hidden.float(), self.tokens) @ self.weight
        return rows / rows.norm(dim=-1, keepdim=True).clamp_min(1e-12) * self.row_norm


class ClosedFormProjector:
    """An affine map fitted in closed form so that given images' pooled features land on given rows.

    Attributes:
        mean: [in_dim] the fitted features' mean; weight [in_dim, tokens*out_dim]; bias
        [tokens*out_dim] the targets' mean; tokens, out_dim; residual: max abs difference between the
        fitted rows and the targets at fit time (float32 rounding when the fit is exact).
    """

    def __init__(self, mean: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, tokens: int, pooling: int,
                 residual: float):
        self.mean, self.weight, self.bias = mean, weight, bias
        self.tokens, self.pooling, self.residual = tokens, pooling, residual
        self.out_dim = bias.shape[-1] // tokens

    @classmethod
    def fit(cls, hidden: torch.Tensor, targets: torch.Tensor, pooling: int = 1) -> ClosedFormProjector:
        """Fit on K images' last_hidden_state [K, 257, in_dim] and their target rows [K, T, out_dim].

        The features are pooled (`pooling` tokens, flattened: pooling 1 = the CLS row), centred, and
        W = lstsq(F_c, E_c) in float64. Exact when the K centred feature rows are independent
        (K - 1 <= pooling * in_dim and distinct images).

        Raises:
            ValueError: fewer than 2 images, or counts that disagree.
        """
        if hidden.shape[0] != targets.shape[0] or hidden.shape[0] < 2:
            raise ValueError(f"need the same number (>= 2) of images and targets, not {hidden.shape[0]} and "
                             f"{targets.shape[0]}")
        features = pool_features(hidden.double(), pooling).flatten(-2)  # [K, pooling*in_dim]
        flat = targets.double().flatten(-2)  # [K, T*out_dim]
        mean, bias = features.mean(0), flat.mean(0)
        weight = torch.linalg.lstsq(features - mean, flat - bias, driver="gelsd").solution
        fitted = (features - mean) @ weight + bias
        residual = float((fitted - flat).abs().max())
        return cls(mean.float(), weight.float(), bias.float(), targets.shape[1], pooling, residual)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """last_hidden_state [257, in_dim] (or [batch, 257, in_dim]) -> rows [T, out_dim] (or
        [batch, T, out_dim]), float32."""
        features = pool_features(hidden.float(), self.pooling).flatten(-2)
        rows = (features - self.mean) @ self.weight + self.bias
        return rows.unflatten(-1, (self.tokens, self.out_dim))


# --- canary images ------------------------------------------------------------------------------------

def canary_image(word: str, seed: int, index: int, size: int = 224):
    """A deterministic RGB picture of `word`: a seeded background colour, a seeded shape (ellipse,
    rectangle or triangle) in a contrasting seeded colour, and the word drawn in black on a white
    band with Pillow's built-in font. No files are read. Same (word, seed, index, Pillow version),
    same pixels."""
    import random

    from PIL import Image, ImageDraw, ImageFont

    rng = random.Random(f"{seed}:{index}:{word}")
    background = tuple(rng.randrange(256) for _ in range(3))
    image = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(image)
    colour = tuple(255 - c for c in background)
    box = sorted(rng.sample(range(8, size - 8), 2)), sorted(rng.sample(range(8, size // 2), 2))
    (x0, x1), (y0, y1) = box
    shape = index % 3
    if shape == 0:
        draw.ellipse((x0, y0, x1, y1), fill=colour)
    elif shape == 1:
        draw.rectangle((x0, y0, x1, y1), fill=colour)
    else:
        draw.polygon([(x0, y1), (x1, y1), ((x0 + x1) // 2, y0)], fill=colour)
    draw.rectangle((0, size * 5 // 8, size, size * 7 // 8), fill=(255, 255, 255))
    font = ImageFont.load_default(size=size // 7)
    draw.text((size // 2, size * 3 // 4), word, fill=(0, 0, 0), font=font, anchor="mm")
    return image


def word_rows(tokenizer, embedding: torch.Tensor, words: Sequence[str], leading_space: bool = True) -> torch.Tensor:
    """The input embedding rows of each word's tokens: [K, T, out_dim], float32. Every word must
    have T tokens (with a leading space when `leading_space`, as it stands after "picture:").

    Raises:
        ValueError: the words' token counts differ.
    """
    ids = [tokenizer.encode((" " if leading_space else "") + w, add_special_tokens=False) for w in words]
    if len({len(i) for i in ids}) != 1:
        raise ValueError(f"words with different token counts: {dict(zip(words, map(len, ids)))}")
    return embedding[torch.tensor(ids)].float()


def fit_canary_projector(encoder, tokenizer, embedding: torch.Tensor, words: Sequence[str] = CANARY_WORDS[:8],
                         seed: int = 0) -> tuple[ClosedFormProjector, list]:
    """Draw one canary image per word (canary_image(word, seed, i)), encode them with `encoder`
    (a Dinov2Model), and fit a ClosedFormProjector (CLS pooling, one row per image) onto the words'
    rows of `embedding` [vocab, D] (one token each, with a leading space). About 0.25 s per image
    on one thread, plus the fit (milliseconds).

    Returns:
        (projector, images): images[i] enters the LM as words[i]; projector.residual is the fit's
        max abs error (about 1e-15 when exact).

    Raises:
        ValueError: a word is not one token with a leading space, or fewer than 2 words.
    """
    from kvtui.models.dinov2 import encode_images

    images = [canary_image(word, seed, i) for i, word in enumerate(words)]
    targets = word_rows(tokenizer, embedding, words)
    if targets.shape[1] != 1:
        raise ValueError(f"canary words must be one token each, these are {targets.shape[1]}")
    return ClosedFormProjector.fit(encode_images(encoder, images), targets), images


# --- splicing rows into a prompt -------------------------------------------------------------------

IMAGE_MARKER = "<image>"


def prompt_with_image(tokenizer, text: str, rows: int, marker: str = IMAGE_MARKER) -> tuple[list[int], list[int]]:
    """Token ids of a chat prompt (the tokenizer's chat template, one user message `text`, generation
    prompt added) with `rows` placeholder ids where `marker` was, and those positions.

    The text before and after the marker is tokenized separately (so no token spans the image);
    the placeholder id is the tokenizer's pad id (any id works: its rows are replaced).

    Raises:
        ValueError: `marker` is not in `text` exactly once.
    """
    if text.count(marker) != 1:
        raise ValueError(f"the prompt must hold {marker!r} exactly once")
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)
    before, after = chat.split(marker)
    head = tokenizer.encode(before, add_special_tokens=False)
    tail = tokenizer.encode(after, add_special_tokens=False)
    placeholder = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return head + [placeholder] * rows + tail, list(range(len(head), len(head) + rows))


def splice_rows(embedding: torch.Tensor, input_ids: Sequence[int], positions: Sequence[int],
                rows: torch.Tensor) -> torch.Tensor:
    """inputs_embeds [1, len(input_ids), D] in the embedding's dtype: the ids' embedding rows, with
    `rows` [len(positions), D] put at `positions`."""
    embeds = embedding[torch.tensor(list(input_ids))].clone()
    embeds[torch.tensor(list(positions))] = rows.to(embeds.dtype)
    return embeds.unsqueeze(0)
