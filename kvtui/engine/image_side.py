"""Images in a decoder-only engine: an encoder cache keyed by the image's content, rows spliced at placeholders.

A request shows images (`RequestInput.images`: each an ImagePart at a span of placeholder positions).
At admission the encoder side looks every image up in its encoder cache by the image's content hash;
the step's misses go through the image encoder in one batched forward (kvtui.models.vision.ImageEncoder:
DINOv2 then the projector), and each result, the image's LM input rows [tokens, hidden], is cached
read-only, shared by every request that shows the same picture, reference counted, evicted least
recently used (engine/encoder_cache.py's EncoderCache, one hold per image of a request). When a chunk of
prefill covers an image's positions, `bind` splices that image's rows there (as prompt embeddings are,
encoder_side.TokenInputs). The request's text KV stays private in the KV cache; the image's hash is
part of its positions' prefix-cache keys (RequestInput.position_keys).

Faults acting here (kvtui/faults.py): mm_uuid_trusted (the cache keyed by the client's uuid for the image
when it sends one, not the content), stale_image_embedding (one embedding buffer that the last image
encoded fills, read by every later image). `bind` reports every chunk that reads rows computed from
another picture than its own (the slot_taint detector's image part), naming the request whose admission
computed them; `report` gives the cache's fields for the dashboard.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvtui.engine.encoder_cache import EncoderCache
from kvtui.engine.encoder_side import TokenInputs
from kvtui.events import TaintEntry
from kvtui.faults import FaultName
from kvtui.model_kinds import ModelKind


@dataclass(eq=False)
class ImageEntry:
    """One picture's LM input rows, computed once and read-only.

    Attributes:
        key: what the cache files it under (the content hash; the client's uuid under mm_uuid_trusted).
        audio_hash: the content hash of the picture the rows came from (the name EncoderCache's reports use).
        computed_for: the request whose admission computed it.
        rows: [tokens, hidden] float32.
        refs: holds (one per image of a running request).
    """

    key: str
    audio_hash: str
    computed_for: str
    rows: torch.Tensor
    refs: int = 0

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()


def _holder(request_id: str, index: int) -> str:
    return f"{request_id}#img{index}"


class ImageInputs(TokenInputs):
    """The encoder side of a decoder-only model with an image encoder (see the module docstring).

    Args:
        hidden_size: the LM's input width; image_encoder: kvtui.models.vision.ImageEncoder; capacity:
            entries the cache keeps (held ones always stay).
    """

    model_kind = ModelKind.IMAGE_TEXT

    def __init__(self, hidden_size: int, image_encoder, capacity: int) -> None:
        super().__init__(hidden_size)
        self.image_encoder = image_encoder
        self.cache = EncoderCache(capacity)
        self.images: dict[str, tuple] = {}  # request id -> its ImageParts
        self.buffer: ImageEntry | None = None  # stale_image_embedding: the one buffer the last encode filled
        self.one_at_a_time = False  # the batch-invariant mode: each picture its own encoder forward

    def problem(self, inp) -> str:
        if inp.audio is not None:
            return "audio given to a decoder-only model; use a speech model (--model whisper-tiny.en)"
        bad = next((i for i in inp.images if i.tokens != self.image_encoder.tokens), None)
        if bad is not None:
            return f"an image takes {self.image_encoder.tokens} prompt positions with this model, not {bad.tokens}"
        bad = next((i for i in inp.images if tuple(i.pixels.shape) != (3, 224, 224)), None)
        if bad is not None:
            return f"image pixels of shape {tuple(bad.pixels.shape)}; the encoder takes (3, 224, 224)"
        return super().problem(replace(inp, images=())) if inp.images else super().problem(inp)

    def submit(self, request) -> None:
        if request.input.images:
            self.images[request.request_id] = request.input.images

    def key_of(self, image) -> str:
        """The cache key: the content hash (mm_uuid_trusted: the client's uuid when it sent one)."""
        if FaultName.MM_UUID_TRUSTED in self.faults and image.uuid:
            return "uuid:" + image.uuid
        return image.content_hash

    def admit(self, admitted) -> float:
        """Every newly admitted request's images: cache hits, and one batched encoder forward over the
        step's misses (one per distinct key; one forward per picture when `one_at_a_time`). A preempted request keeps its holds. Returns the modeled
        seconds (ImageEncoder.forward_s per image encoded)."""
        misses: dict[str, list[tuple[str, object]]] = {}
        for request in admitted:
            for k, image in enumerate(self.images.get(request.request_id, ())):
                holder, key = _holder(request.request_id, k), self.key_of(image)
                if self.cache.entry_of(holder) is None and (key in misses or self.cache.acquire(holder, key) is None):
                    misses.setdefault(key, []).append((holder, image))
        if not misses:
            return 0.0
        firsts = [group[0] for group in misses.values()]
        if self.one_at_a_time:  # a picture's rows then never depend on the pictures encoded beside it
            rows = torch.cat([self.image_encoder.encode(image.pixels[None]) for _, image in firsts])
        else:
            rows = self.image_encoder.encode(torch.stack([image.pixels for _, image in firsts]))
        for (key, group), computed in zip(misses.items(), rows):
            holder, image = group[0]
            entry = ImageEntry(key, image.content_hash, holder.rsplit("#", 1)[0], computed)
            self.cache.insert(holder, entry)
            self.buffer = entry
            for other, _ in group[1:]:
                self.cache.acquire(other, key)
        return self.image_encoder.forward_s * len(misses)

    def bind(self, chunks):
        bound, taint = [], []
        for chunk in chunks:
            chunk = self._spliced(chunk)  # supplied embedding rows, as TokenInputs
            chunk, sources = self._with_images(chunk)
            bound.append(chunk)
            if sources:
                taint.append(TaintEntry(request_id=chunk.request.request_id, sources=tuple(dict.fromkeys(sources)),
                                        positions=len(sources), examples=tuple(
                                            (-1 if chunk.slot is None else chunk.slot, 0, s) for s in sources[:5])))
        return tuple(bound), tuple(taint)

    def _with_images(self, chunk):
        """`chunk` with the rows of the image positions it feeds spliced in; and the requests whose picture
        those rows came from where it is not the chunk's own (one per position)."""
        rid = chunk.request.request_id
        offsets, rows, sources = list(chunk.spliced[0]) if chunk.spliced else [], [], []
        if chunk.spliced:
            rows.append(chunk.spliced[1])
        end = min(chunk.end_pos, chunk.request.prompt_len)
        for k, image in enumerate(self.images.get(rid, ())):
            entry = self._entry(rid, k)
            for j, p in enumerate(image.positions):
                if chunk.start_pos <= p < end:
                    offsets.append(p - chunk.start_pos)
                    rows.append(entry.rows[j : j + 1])
                    if entry.audio_hash != image.content_hash:
                        sources.append(entry.computed_for)
            fed = any(chunk.start_pos <= p < end for p in image.positions)
            if fed and self.faults and entry.audio_hash != image.content_hash:  # a fault gave another picture's rows
                stale = FaultName.STALE_IMAGE_EMBEDDING in self.faults and entry is self.buffer
                self.acts.note(FaultName.STALE_IMAGE_EMBEDDING if stale else FaultName.MM_UUID_TRUSTED, (rid,))
        if not rows:
            return chunk, sources
        order = sorted(range(len(offsets)), key=offsets.__getitem__)
        stacked = torch.cat(rows)[order]
        return replace(chunk, spliced=(tuple(offsets[i] for i in order), stacked)), sources

    def _entry(self, request_id: str, index: int) -> ImageEntry:
        """The rows image `index` of the request reads (stale_image_embedding: the last-filled buffer)."""
        if FaultName.STALE_IMAGE_EMBEDDING in self.faults and self.buffer is not None:
            return self.buffer
        return self.cache.entry_of(_holder(request_id, index))

    def finish(self, request_id: str) -> None:
        for k in range(len(self.images.pop(request_id, ()))):
            self.cache.release(_holder(request_id, k))

    def report(self) -> dict:
        """The step event's encoder-cache fields (entries, capacity, held, bytes, hits, misses)."""
        self.cache.stats.hit_log.clear()
        return self.cache.report()
