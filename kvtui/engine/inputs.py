"""What a request feeds the model: one typed input from scenario and server to the engine.

A prompt is a sequence of positions. Each position is either a token id, embedded by the model's own
embedding table, or a row supplied from outside and spliced into the model's input embeddings at that
position: prompt embeddings a client sent (vLLM's `prompt_embeds`), or an image's projected features
(placeholder positions). An encoder-decoder's audio is not part of the prompt: it is read through
cross-attention (engine/encoder.py).

`RequestInput` carries all of it; `Engine.submit(request_id, RequestInput(...), ...)` takes it (a plain
list of token ids stays the short form of a text prompt). The prefix cache keys every position by what
fills it (`RequestInput.position_keys`): a token position by its id, a supplied row by a digest of the row,
an image position by the image's content hash and its index in the image, so two prompts share cached
KV only where every position is filled with the same thing, mask included (vLLM #56655 keyed supplied
rows by the tensor's digest and not the mask; the `embeds_mask_unkeyed` fault does that here).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvtui.engine.encoder_cache import AudioInput

PLACEHOLDER_ID = 0  # the token id a supplied or image position carries in prompt_ids (vLLM normalizes to 0 too)


def row_digest(row: torch.Tensor) -> str:
    """16 hex digits of sha256 over a row's float32 little-endian bytes (a supplied row's cache key)."""
    data = row.detach().to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
    return hashlib.sha256(b"kvtui:embeds:" + data).hexdigest()[:16]


@dataclass(frozen=True, eq=False)
class PromptEmbeds:
    """Embedding rows a client supplies for part or all of a prompt (vLLM's `prompt_embeds` with
    `prompt_is_token_ids`).

    Attributes:
        rows: [T, hidden] float tensor over the whole prompt (T = the prompt's length); the rows at
            token positions are not read (vLLM's chat renderer leaves zeros there).
        is_token_ids: [T] bool, True where the position is a token id embedded by the model; None:
            every position is supplied (a prompt given as embeddings only).

    Raises:
        ValueError: rows not 2-D, not floating point, holding NaN or inf at a supplied position, or a
            mask whose length differs from the rows'.
    """

    rows: torch.Tensor
    is_token_ids: torch.Tensor | None = None
    _digests: tuple = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if self.rows.dim() != 2:
            raise ValueError(f"prompt_embeds must be 2-D [tokens, hidden], got shape {tuple(self.rows.shape)}")
        if not self.rows.is_floating_point():
            raise ValueError(f"prompt_embeds must be floating point, got {self.rows.dtype}")
        if self.is_token_ids is not None and tuple(self.is_token_ids.shape) != (self.rows.shape[0],):
            raise ValueError(f"prompt_is_token_ids has shape {tuple(self.is_token_ids.shape)}, the rows "
                             f"{tuple(self.rows.shape)}: one flag per row")
        supplied = self.supplied_positions
        if supplied and not torch.isfinite(self.rows[list(supplied)]).all():
            raise ValueError("prompt_embeds holds NaN or inf")
        object.__setattr__(self, "_digests", tuple(row_digest(self.rows[p]) for p in supplied))

    @property
    def supplied_positions(self) -> tuple[int, ...]:
        """Prompt positions whose row is supplied (not a token id), ascending."""
        if self.is_token_ids is None:
            return tuple(range(self.rows.shape[0]))
        return tuple(int(i) for i in torch.nonzero(~self.is_token_ids.bool()).flatten())

    @property
    def digests(self) -> dict[int, str]:
        """Supplied position -> row_digest of its row."""
        return dict(zip(self.supplied_positions, self._digests))

    def block_digest(self, start: int, end: int) -> str:
        """sha256 (16 hex) of the full-length tensor's rows start .. end - 1 as they are, whatever the mask
        says (vLLM's per-block extra key, `_gen_prompt_embeds_extra_hash_keys`)."""
        data = self.rows[start:end].detach().to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
        return hashlib.sha256(b"kvtui:embeds-block:" + data).hexdigest()[:16]


@dataclass(frozen=True, eq=False)
class ImagePart:
    """One image in a prompt: where its rows go and what it is.

    Attributes:
        start: the prompt position of its first placeholder; it fills `tokens` positions from there.
        tokens: positions its projected features take (the projector's output rows).
        content_hash: sha256 hex of the decoded pixels (kvtui.models.dinov2.image_hash): the encoder
            cache's key and part of the prefix-cache key of its positions.
        pixels: [3, H, W] float32, preprocessed for the image encoder.
        uuid: a client-supplied id for the image (vLLM's `multi_modal_uuids`), or None; trusted as the
            cache key only under the mm_uuid_trusted fault.
        label: a name for reports (a file name), or "".
    """

    start: int
    tokens: int
    content_hash: str
    pixels: torch.Tensor
    uuid: str | None = None
    label: str = ""

    @property
    def positions(self) -> range:
        return range(self.start, self.start + self.tokens)


@dataclass(frozen=True, eq=False)
class RequestInput:
    """Everything one request feeds the model.

    Attributes:
        prompt_ids: the prompt's token ids, one per position (PLACEHOLDER_ID, or any id, where a supplied
            row or an image fills the position; the model never embeds those ids).
        embeds: supplied embedding rows (PromptEmbeds over the whole prompt) or None.
        audio: an encoder-decoder's audio (Whisper: encoder_cache.AudioInput) or None.
        images: the prompt's images, at disjoint placeholder spans.
        lora: the LoRA adapter the request runs under (engine/lora.py LoraAdapter) or None: not what it
            feeds the model but what the model computes with, carried here so a replay runs it alike.

    Raises:
        ValueError: embeds whose length differs from the prompt's, or an image span outside the prompt or
            overlapping another image or a supplied row.
    """

    prompt_ids: tuple[int, ...]
    embeds: PromptEmbeds | None = None
    audio: AudioInput | None = None
    images: tuple[ImagePart, ...] = ()
    lora: object = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        n = len(self.prompt_ids)
        if self.embeds is not None and self.embeds.rows.shape[0] != n:
            raise ValueError(f"prompt_embeds has {self.embeds.rows.shape[0]} rows for a prompt of {n} positions")
        taken = set(self.embeds.supplied_positions) if self.embeds is not None else set()
        for image in self.images:
            span = set(image.positions)
            if image.start < 0 or image.start + image.tokens > n:
                raise ValueError(f"image at positions {image.start}..{image.start + image.tokens - 1} is outside the "
                                 f"prompt of {n} positions")
            if span & taken:
                raise ValueError(f"image at position {image.start} overlaps another image or supplied embeddings")
            taken |= span

    @classmethod
    def of(cls, prompt: RequestInput | list[int] | tuple[int, ...]) -> RequestInput:
        """`prompt` as a RequestInput (a list of token ids is a text prompt)."""
        return prompt if isinstance(prompt, RequestInput) else cls(tuple(prompt))

    @classmethod
    def from_embeds(cls, rows: torch.Tensor, token_ids=None, is_token_ids=None) -> RequestInput:
        """A prompt given as embedding rows [T, hidden]: all of it (is_token_ids None: every id is the
        placeholder, whatever token_ids says), or mixed with token ids under the mask `is_token_ids` [T] bool
        (token_ids [T]: the ids at True positions, anything elsewhere; PLACEHOLDER_ID is put there)."""
        mask = None if is_token_ids is None else torch.as_tensor(is_token_ids, dtype=torch.bool)
        ids = [PLACEHOLDER_ID] * rows.shape[0]
        if mask is not None and token_ids is not None:
            ids = [int(t) if keep else PLACEHOLDER_ID for t, keep in zip(token_ids, mask.tolist())]
        return cls(tuple(ids), embeds=PromptEmbeds(rows, mask))

    @property
    def spliced_positions(self) -> frozenset[int]:
        """Positions filled by a supplied row or an image (never by the embedding table)."""
        supplied = set(self.embeds.supplied_positions) if self.embeds is not None else set()
        return frozenset(supplied.union(*(set(i.positions) for i in self.images)))

    def position_keys(self, faults: frozenset = frozenset()) -> list:
        """One prefix-cache key item per prompt position: the token id, "e:<row digest>" for a supplied
        row, "i:<content hash>:<index>" for an image position. Under embeds_unkeyed a supplied position
        is keyed by its placeholder id only; under embeds_mask_unkeyed by (id, the digest of the row the
        full-length tensor holds there), whatever the mask says (#56655); under mm_hash_missing an image
        position by its placeholder id only."""
        from kvtui.faults import FaultName

        keys: list = list(self.prompt_ids)
        if self.embeds is not None:
            if FaultName.EMBEDS_MASK_UNKEYED in faults:
                keys = [f"{t}|{row_digest(self.embeds.rows[p])}" for p, t in enumerate(keys)]
            elif FaultName.EMBEDS_UNKEYED not in faults:
                for p, digest in self.embeds.digests.items():
                    keys[p] = f"e:{digest}"
        if FaultName.MM_HASH_MISSING not in faults:
            for image in self.images:
                for k, p in enumerate(image.positions):
                    keys[p] = f"i:{image.content_hash[:32]}:{k}"
        return keys

    @property
    def identity(self) -> tuple:
        """A hashable summary of everything the input feeds the model: equal identities run equally (the
        reference detector's cache key). Ids, the supplied rows' digests by position, image hashes by
        position, the audio's hash, the LoRA adapter's (name, version, digest)."""
        embeds = tuple(sorted(self.embeds.digests.items())) if self.embeds is not None else None
        images = tuple((i.start, i.tokens, i.content_hash) for i in self.images)
        lora = self.lora.identity if self.lora is not None else None
        return self.prompt_ids, embeds, images, self.audio.content_hash if self.audio is not None else None, lora

    @property
    def content_key(self) -> str | None:
        """What the input shows besides text, as one key (the audio's hash, or its pictures' hashes), or None:
        two requests with equal keys see the same thing, so neither's answer is a canary leak of the other's."""
        if self.audio is not None:
            return self.audio.content_hash
        return ",".join(i.content_hash for i in self.images) or None

    @property
    def kind(self) -> str:
        """"tokens", "embeds" (some supplied rows), "image" (one or more images) or "audio"."""
        if self.audio is not None:
            return "audio"
        if self.images:
            return "image"
        return "embeds" if self.embeds is not None else "tokens"
