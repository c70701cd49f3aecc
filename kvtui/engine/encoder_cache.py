"""The encoder cache: each audio's cross-attention K/V, computed once and held read-only.

An encoder-decoder request (Whisper) carries its audio as an `AudioInput` (log-mel features and the
audio's content hash). At admission the engine runs the encoder once over the audio of every admitted
request whose K/V is not cached yet (one batched forward), and projects the encoder output through
every decoder layer's cross-attention k_proj and v_proj. Those K/V ([heads, source positions,
head_dim] per layer) are the same at every decoder step, so they are held for the request's whole life
in a `CrossEntry`, keyed by the audio's content hash: requests with the same audio share one entry
(a hit), reference counted; an entry nobody holds stays cached until space is needed, then the least
recently used goes first. The decoder's self-attention KV lives in the slot pool or paged blocks
(kv_cache.py) as for a decoder-only model; this cache sits beside it (engine/encoder.py ties the two).

Bookkeeping is plain Python; capacity is counted in entries (every Whisper input is padded to 30 s, so
every entry has the same size, `CrossEntry.nbytes`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class AudioInput:
    """One request's audio for an encoder-decoder engine.

    Attributes:
        features: float32 [mel_bins, frames] log-mel features (Whisper: [80, 3000], 30 s padded).
        content_hash: sha256 hex of the audio (the encoder cache's key); `audio_input` computes it
            from the 16 kHz samples.
        label: a name for reports and the dashboard (the clip's file name), or "".
    """

    features: torch.Tensor
    content_hash: str
    label: str = ""


def audio_hash(samples: np.ndarray, sample_rate: int) -> str:
    """sha256 hex over the sample rate and the float32 little-endian samples."""
    data = np.ascontiguousarray(samples, dtype="<f4").tobytes()
    return hashlib.sha256(f"kvtui:audio:{sample_rate}:".encode() + data).hexdigest()


def audio_input(samples: np.ndarray, feature_extractor, label: str = "", sample_rate: int = 16000) -> AudioInput:
    """An AudioInput from float32 samples [n] at `sample_rate` Hz, through Whisper's feature extractor
    (log-mel, padded to 30 s)."""
    feats = feature_extractor(samples, sampling_rate=sample_rate, return_tensors="pt").input_features[0]
    return AudioInput(features=feats, content_hash=audio_hash(samples, sample_rate), label=label)


class AudioFiles:
    """AudioInputs of WAV files (16 kHz mono 16-bit), each read and turned into features once; the
    `memory` most recently used are kept.

    Args:
        feature_extractor: Whisper's (the loaded model's `feature_extractor`).
    """

    def __init__(self, feature_extractor, memory: int = 64) -> None:
        self.feature_extractor, self.memory = feature_extractor, memory
        self._kept: OrderedDict[str, AudioInput] = OrderedDict()

    def get(self, path: str) -> AudioInput:
        """The file's AudioInput (label: its file name).

        Raises:
            OSError, ValueError: the file cannot be read, or is not a WAV file Whisper takes.
        """
        from pathlib import Path

        from kvtui.models.whisper import read_wav

        if path not in self._kept:
            self._kept[path] = audio_input(read_wav(Path(path)), self.feature_extractor, Path(path).name)
            while len(self._kept) > self.memory:
                self._kept.popitem(last=False)
        self._kept.move_to_end(path)
        return self._kept[path]


@dataclass(eq=False)
class CrossEntry:
    """One audio's cross-attention K/V over all decoder layers (read-only once made).

    Attributes:
        key: what the cache files it under (the audio's content hash; other under a fault).
        audio_hash: the content hash of the audio the K/V were computed from.
        computed_for: the request whose admission computed it.
        keys, values: per decoder layer, [heads, source positions, head_dim] in the model dtype.
        refs: running requests holding it.
    """

    key: str
    audio_hash: str
    computed_for: str
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    refs: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of its K and V tensors."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@dataclass
class EncoderCacheStats:
    """Counters since the engine started: lookups that found an entry (hits), that did not (misses),
    entries evicted."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    hit_log: list = field(default_factory=list)  # (request_id, entry) per hit since the last report


class EncoderCache:
    """Cross-attention K/V by key, reference counted, LRU eviction of unreferenced entries.

    Args:
        capacity: entries it keeps (referenced ones always stay; the engine sizes it so that every
            running request's entry fits: at least the running requests it may hold).

    Raises:
        ValueError: capacity < 1.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"encoder cache {capacity = } must be >= 1")
        self.capacity = capacity
        self.entries: OrderedDict[str, CrossEntry] = OrderedDict()  # least recently used first
        self.by_request: dict[str, CrossEntry] = {}
        self.stats = EncoderCacheStats()

    def acquire(self, request_id: str, key: str) -> CrossEntry | None:
        """The entry filed under `key`, now also held by `request_id` (a hit), or None (a miss)."""
        entry = self.entries.get(key)
        if entry is None:
            self.stats.misses += 1
            return None
        self.entries.move_to_end(key)
        self._hold(request_id, entry)
        self.stats.hits += 1
        self.stats.hit_log.append((request_id, entry))
        return entry

    def insert(self, request_id: str, entry: CrossEntry) -> CrossEntry:
        """File a newly computed entry, held by `request_id`; evicts unreferenced entries past capacity."""
        old = self.entries.pop(entry.key, None)
        if old is not None and not old.refs:
            self.stats.evictions += 1
        self.entries[entry.key] = entry
        self._hold(request_id, entry)
        self._evict()
        return entry

    def release(self, request_id: str) -> None:
        """`request_id` no longer holds its entry (finished); the entry stays cached while there is room."""
        entry = self.by_request.pop(request_id, None)
        if entry is not None:
            entry.refs -= 1
            self._evict()

    def entry_of(self, request_id: str) -> CrossEntry | None:
        return self.by_request.get(request_id)

    def _hold(self, request_id: str, entry: CrossEntry) -> None:
        self.release(request_id)
        entry.refs += 1
        self.by_request[request_id] = entry

    def _evict(self) -> None:
        """Drop unreferenced entries, least recently used first, while more than capacity are kept."""
        idle = [k for k, e in self.entries.items() if not e.refs]
        while len(self.entries) > self.capacity and idle:
            del self.entries[idle.pop(0)]
            self.stats.evictions += 1

    @property
    def nbytes(self) -> int:
        """Bytes of all cached entries' K/V."""
        return sum(e.nbytes for e in self.entries.values())

    def report(self) -> dict:
        """The step event's encoder-cache fields: entries kept, of capacity, referenced; bytes; hits and
        misses since the engine started."""
        return dict(encoder_entries=len(self.entries), encoder_capacity=self.capacity,
                    encoder_referenced=sum(1 for e in self.entries.values() if e.refs),
                    encoder_bytes=self.nbytes, encoder_hits=self.stats.hits, encoder_misses=self.stats.misses)
