"""Encoder-decoder models (Whisper) in the engine: the encoder at admission, cross-attention per row.

A request to an encoder-decoder engine carries its audio (`encoder_cache.AudioInput`, given to
`Engine.submit(id, RequestInput(decoder_prompt, audio=...))`) and a decoder prompt (Whisper: [<|startoftranscript|>,
<|notimestamps|>]). Its life:

1. Admission: `CrossAttentionInputs.admit` looks each newly admitted request's audio up in the encoder cache
   (encoder_cache.py) by content hash. The misses of one step go through the encoder in one batched
   forward (`EncoderDecoderRunner.encode`), and every decoder layer's cross-attention k_proj / v_proj
   turns the encoder output into that audio's K/V, cached read-only and shared by later requests with
   the same audio.
2. Decoder steps: the decoder's self-attention KV lives in the slot pool or paged blocks and goes
   through the same "kvtui" attention as a decoder-only model (attention.py). Before each forward,
   `CrossAttentionInputs.bind` names the cross entry of every chunk of the step; each decoder layer's
   cross-attention then attends each chunk's queries to its own entry's K/V (`_cross_attention`, one
   SDPA call per chunk), so rows of one batch read different audio, and requests join and leave
   between steps as for any model.
3. Finish: the request lets its entry go (it stays cached while there is room).

transformers' Whisper layers are used as they are: the decoder gets an `EncoderDecoderCache` whose
self-attention part is the pooled cache and whose cross-attention part is marked as already filled,
so the layers never recompute K/V from encoder states; the cross-attention modules carry a hook
(`kvtui_attention_override`, read by attention.kvtui_attention) that does the per-chunk attention.

Faults acting here (kvtui/faults.py): stale_cross_kv (the cross table indexed by slot and not
refreshed when a slot is reused), cross_row_misalign (indexed by batch row, not compacted when a row
leaves), encoder_cache_unkeyed (entries keyed by the decoder prompt, not the audio). `bind` reports
every chunk that read K/V computed from other audio than its own (the slot_taint detector's
cross-attention part); `hits` reports every cache hit with the audio it was computed from.
"""

from __future__ import annotations

import hashlib
import threading
from functools import partial

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin, EncoderDecoderCache

from kvtui.engine.batching import BatchTensors
from kvtui.engine.encoder_cache import AudioInput, CrossEntry, EncoderCache
from kvtui.engine.fault_acts import FaultActs
from kvtui.engine.kv_pool import KVPool
from kvtui.engine.runner import ModelRunner
from kvtui.events import EncoderHitEntry, TaintEntry
from kvtui.faults import FP16_MASK_CONSTANT, FaultName
from kvtui.model_kinds import ModelKind

# The virtual clock's cost of one audio through the encoder (seconds): Whisper tiny.en's encoder forward on
# one 30 s input (always padded to 1500 positions) measured at 0.27 s on 2 CPU cores (torch 2.13, 2
# threads); batched inputs cost about as much each (the forward is compute-bound on the CPU).
ENCODER_FORWARD_S = 0.27
OVERRIDE = "kvtui_attention_override"  # the attribute attention.kvtui_attention looks for on a module
_running = threading.local()  # .runner: the EncoderDecoderRunner whose forward runs in this thread


class _FilledCrossLayer(CacheLayerMixin):
    """A cross-attention cache layer that reports itself filled; its tensors are placeholders (the
    per-chunk K/V come from the encoder cache through the attention hook)."""

    is_compileable = False

    def __init__(self) -> None:
        super().__init__()
        self.keys = self.values = torch.empty(0)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("the cross-attention K/V come from the encoder cache, never from an update")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return 1

    def get_max_length(self) -> int:
        return -1


class _FilledCrossCache(Cache):
    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[_FilledCrossLayer() for _ in range(num_layers)])


class EncoderDecoderRunner(ModelRunner):
    """ModelRunner for Whisper-style encoder-decoders: the decoder body over the pooled self-attention
    cache, the encoder at admission (`encode`).

    Attributes:
        entries: the step's cross entry per chunk (segment order), set by CrossAttentionInputs.bind; None
            outside a step (then the hooks fall back to plain SDPA, so the model still works alone).
    """

    def __init__(self, model, pool: KVPool) -> None:
        super().__init__(model, pool)
        self.encoder, self.decoder = model.get_encoder(), model.get_decoder()
        self.entries: list[CrossEntry] | None = None
        self.cache_pair = EncoderDecoderCache(self.cache, _FilledCrossCache(len(self.decoder.layers)))
        for i, layer in enumerate(self.decoder.layers):  # one model may serve several engines (the reference's)
            setattr(layer.encoder_attn, OVERRIDE, partial(_cross_hook, i))
        for layer in self.encoder.layers:
            setattr(layer.self_attn, OVERRIDE, _sdpa)

    def _run_body(self, batch: BatchTensors, state, *, bind: bool = True) -> torch.Tensor:
        """The decoder on `batch`: self-attention through the pooled cache, cross-attention per chunk;
        returns [S, V] float32 logits (as ModelRunner._run_body)."""
        if bind:
            self.cache.state = state
        self.cache_pair.is_updated = dict.fromkeys(range(len(self.decoder.layers)), True)
        rows = batch.input_ids.shape[0]
        _running.runner = self
        try:
            out = self._decode(batch, rows, FP16_MASK_CONSTANT if state.fp16 else None)
        finally:
            _running.runner = None
        hidden = out.last_hidden_state[batch.sample_row, batch.sample_col]
        return self.head(hidden).float().cpu()

    def _decode(self, batch: BatchTensors, rows: int, masked: float | None):
        mask = batch.additive_mask(self.dtype, masked).to(self.device)
        return self.decoder(input_ids=batch.input_ids, attention_mask=mask,
                           position_ids=batch.position_ids, cache=self.cache_pair, use_cache=True,
                           encoder_hidden_states=torch.empty(rows, 0, self.decoder.config.d_model, dtype=self.dtype,
                                                             device=self.device))

    def _cross(self, layer: int, query, key, value, attention_mask, scaling):
        """Cross-attention of decoder layer `layer`: each chunk's queries [Hq, n, D] over its own entry's
        K/V [H, S, D]. Returns [R, Q, H, D], or None outside an engine step."""
        state = self.cache.state
        if state is None or self.entries is None:
            return None
        segments = state.batch.segments
        if all(s.num_tokens == 1 and s.q_start == 0 and s.row == i for i, s in enumerate(segments)):
            outs = [F.scaled_dot_product_attention(query[i : i + 1], e.keys[layer][None], e.values[layer][None],
                                                   scale=scaling) for i, e in enumerate(self.entries)]
            return torch.cat(outs).transpose(1, 2)
        out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
        for seg, entry in zip(segments, self.entries):
            cols = slice(seg.q_start, seg.q_start + seg.num_tokens)
            o = F.scaled_dot_product_attention(query[seg.row, :, cols][None], entry.keys[layer][None],
                                               entry.values[layer][None], scale=scaling)[0]
            out[seg.row, cols] = o.transpose(0, 1)
        return out

    @torch.inference_mode()
    def encode(self, features: torch.Tensor) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
        """One encoder forward over `features` [n, mel_bins, frames]; per input, (keys, values) per
        decoder layer, each [heads, source positions, head_dim], as transformers' cross-attention
        computes them (k_proj / v_proj of the encoder output)."""
        hidden = self.encoder(input_features=features.to(self.device, self.dtype)).last_hidden_state  # [n, S, d]
        n = hidden.shape[0]
        per_layer = []
        for layer in self.decoder.layers:
            attn = layer.encoder_attn
            shape = (n, -1, attn.num_heads, attn.head_dim)
            per_layer.append((attn.k_proj(hidden).view(shape).transpose(1, 2), attn.v_proj(hidden).view(shape).transpose(1, 2)))
        return [(tuple(k[i].clone() for k, _ in per_layer), tuple(v[i].clone() for _, v in per_layer)) for i in range(n)]


def _cross_hook(layer: int, query, key, value, attention_mask, scaling):
    """The cross-attention modules' hook: the running EncoderDecoderRunner's per-chunk cross-attention, or
    None (transformers' own path) when no engine forward runs in this thread."""
    runner = getattr(_running, "runner", None)
    return None if runner is None else runner._cross(layer, query, key, value, attention_mask, scaling)


def _sdpa(query, key, value, attention_mask, scaling):
    """Plain SDPA (transformers' "sdpa" attention) for the encoder's self-attention: [B, Q, H, D]."""
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling).transpose(1, 2)


class CrossAttentionInputs:
    """The encoder side (engine/encoder_side.py) of an encoder-decoder: audio per request, the encoder
    cache, the cross tables.

    Args:
        runner: the EncoderDecoderRunner; capacity: encoder cache entries.
    """

    model_kind = ModelKind.ENCODER_DECODER

    def __init__(self, runner: EncoderDecoderRunner, capacity: int) -> None:
        self.runner = runner
        self.cache = EncoderCache(capacity)
        self.audio: dict[str, AudioInput] = {}
        self.faults: frozenset[str] = frozenset()
        self.acts = FaultActs()  # where the faults act (the engine hands its notebook in)
        self.slot_table: dict[int, CrossEntry] = {}  # the cross K/V a slot's request reads (stale_cross_kv)
        self.row_table: list[tuple[str, CrossEntry]] = []  # by admission order (cross_row_misalign)
        cfg = runner.model.config
        self.feature_shape = (cfg.num_mel_bins, 2 * cfg.max_source_positions)

    def configure(self, faults: frozenset[str]) -> None:
        self.faults = faults
        if FaultName.CROSS_ROW_MISALIGN not in faults:  # a healthy table holds running requests only
            self.row_table = [(rid, e) for rid, e in self.row_table if rid in self.audio]

    def problem(self, inp) -> str:
        """Why the RequestInput `inp` cannot run here ("" when it can): no audio, audio of the wrong shape,
        or supplied embeddings or images (the decoder reads token ids only)."""
        audio = inp.audio
        if inp.embeds is not None or inp.images:
            return "a speech model takes audio and a decoder prompt of token ids, not prompt_embeds or images"
        if audio is None:
            return "an encoder-decoder model needs audio: submit RequestInput(decoder prompt, audio=AudioInput(...))"
        if tuple(audio.features.shape) != self.feature_shape:
            return f"audio features of shape {tuple(audio.features.shape)}, the model takes {self.feature_shape}"
        return ""

    @staticmethod
    def salted(salt: str | None, audio: AudioInput) -> str:
        """The request's prefix-cache salt with its audio's hash added: the decoder's self-attention K/V
        depend on the audio (through cross-attention), so blocks are shared only between requests with the
        same audio (and tenant). The cross_kv_prefix_cached fault makes the block keys leave it out."""
        return f"{salt or ''}\x1faudio:{audio.content_hash}"

    def submit(self, request) -> None:
        """Keep the request's audio; its hash joins the request's prefix-cache salt (see `salted`)."""
        audio = request.input.audio
        self.audio[request.request_id] = audio
        request.cache_salt = self.salted(request.cache_salt, audio)

    def key_of(self, request) -> str:
        """The cache key: the audio's content hash (encoder_cache_unkeyed: a hash of the decoder prompt)."""
        if FaultName.ENCODER_CACHE_UNKEYED in self.faults:
            return "prompt:" + hashlib.sha256(repr(request.prompt_ids).encode()).hexdigest()
        return self.audio[request.request_id].content_hash

    def admit(self, admitted: list) -> float:
        """Give every newly admitted request its cross entry: a cache hit, or one batched encoder forward
        over the step's misses (one per distinct key). A preempted request keeps its entry. Returns the
        modeled seconds: ENCODER_FORWARD_S per audio input the encoder ran on."""
        misses: dict[str, list] = {}
        for request in admitted:
            rid = request.request_id
            if self.cache.entry_of(rid) is None:
                key = self.key_of(request)
                if key in misses or self.cache.acquire(rid, key) is None:
                    misses.setdefault(key, []).append(request)
        if misses:
            firsts = [group[0] for group in misses.values()]
            features = torch.stack([self.audio[r.request_id].features for r in firsts])
            for (key, group), (keys, values) in zip(misses.items(), self.runner.encode(features)):
                first = group[0].request_id
                self.cache.insert(first, CrossEntry(key, self.audio[first].content_hash, first, keys, values))
                for other in group[1:]:
                    self.cache.acquire(other.request_id, key)
        for request in admitted:
            self._place(request)
        return ENCODER_FORWARD_S * len(misses)

    def _place(self, request) -> None:
        entry = self.cache.entry_of(request.request_id)
        if request.slot is not None and not (FaultName.STALE_CROSS_KV in self.faults and request.slot in self.slot_table):
            self.slot_table[request.slot] = entry
        if all(rid != request.request_id for rid, _ in self.row_table):
            self.row_table.append((request.request_id, entry))

    def bind(self, chunks) -> tuple[tuple, tuple[TaintEntry, ...]]:
        """Name each chunk's cross entry for the coming forward; return the chunks (as they are) and a
        TaintEntry per chunk whose entry was computed from other audio than its own (victim: the chunk's
        request; source: the request whose admission computed the entry)."""
        request_ids = [c.request.request_id for c in chunks]
        entries = []
        for i, chunk in enumerate(chunks):
            entry = self.cache.entry_of(chunk.request.request_id)
            acted = FaultName.ENCODER_CACHE_UNKEYED  # the cache itself gave another audio's entry
            if FaultName.STALE_CROSS_KV in self.faults and chunk.slot in self.slot_table:
                entry, acted = self.slot_table[chunk.slot], FaultName.STALE_CROSS_KV
            if FaultName.CROSS_ROW_MISALIGN in self.faults and i < len(self.row_table):
                entry, acted = self.row_table[i][1], FaultName.CROSS_ROW_MISALIGN
            if acted in self.faults and entry.audio_hash != self.audio[request_ids[i]].content_hash:
                self.acts.note(acted, (request_ids[i],), "row", (i,))
            entries.append(entry)
        self.runner.entries = entries
        taint = []
        for chunk, entry, rid in zip(chunks, entries, request_ids):
            if entry.audio_hash != self.audio[rid].content_hash:
                positions = chunk.num_tokens * int(entry.keys[0].shape[1])
                taint.append(TaintEntry(request_id=rid, sources=(entry.computed_for,), positions=positions,
                                        examples=((-1 if chunk.slot is None else chunk.slot, 0, entry.computed_for),)))
        return chunks, tuple(taint)

    def unbind(self) -> None:
        self.runner.entries = None

    def finish(self, request_id: str) -> None:
        """The request is done: release its entry (it stays cached while there is room)."""
        self.cache.release(request_id)
        self.audio.pop(request_id, None)
        if FaultName.CROSS_ROW_MISALIGN not in self.faults:
            self.row_table = [(rid, e) for rid, e in self.row_table if rid != request_id]

    def hits(self) -> tuple[EncoderHitEntry, ...]:
        """The cache hits since the last call: reader, its audio, the audio and request the entry came from."""
        log, self.cache.stats.hit_log = self.cache.stats.hit_log, []
        return tuple(EncoderHitEntry(request_id=rid, audio_hash=self.audio[rid].content_hash[:12] if rid in self.audio
                                     else "", entry_audio_hash=e.audio_hash[:12], computed_for=e.computed_for)
                     for rid, e in log)

    def report(self) -> dict:
        """The step event's encoder-cache fields (EncoderCache.report) and this step's hits."""
        return dict(**self.cache.report(), encoder_hit_log=self.hits())

    def adjust_logits(self, logits: torch.Tensor, generated: int) -> torch.Tensor:
        """`logits` [V] with the generation config's suppressed tokens at -inf (and, for the first token,
        begin_suppress_tokens), as transformers' SuppressTokens(AtBegin)LogitsProcessor."""
        gen = self.runner.model.generation_config
        ids = list(gen.suppress_tokens or []) + (list(gen.begin_suppress_tokens or []) if generated == 0 else [])
        if not ids:
            return logits
        out = logits.clone()
        out[torch.tensor(ids, dtype=torch.long)] = float("-inf")
        return out
