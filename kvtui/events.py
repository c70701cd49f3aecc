"""Typed events: one frozen pydantic model per kind of thing a run reports.

Every producer (session, detectors, audit) builds these, every consumer (recorder, metrics, the
dashboard's state, replay) reads them, and a recording is these models serialized one per line
(JSON Lines). Times (`t` and every `*_s` field) are seconds on the run's clock; token counts are tokens.

Wire format: version 3. Version 2 added to version 1 only optional fields; version 3 renamed the
`step` fields to the engine's own names (one step type, StepEvent, made by the engine and recorded as
it is). `parse_event` reads all three: a version-1 or -2 step line is mapped onto StepEvent on read,
so `kvtui replay` plays every version. recordings/README.md lists every field of every type.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal, Union

import pydantic
from pydantic import BaseModel, ConfigDict, Field, SkipValidation

from kvtui.faults import ContaminationKind

FORMAT = "kvtui-recording"
UNCOUNTED_KINDS = ("numeric", "unknown")  # contamination kinds that are reported but never counted
VERSION = 3
READABLE_VERSIONS = (1, 2, 3)


class _Frozen(BaseModel):
    """Base: immutable, unknown keys rejected (so drift between writer and reader is caught)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    def to_json(self) -> str:
        """One line of the recording (compact JSON, by the wire names)."""
        return self.model_dump_json(by_alias=True)

    def to_dict(self) -> dict:
        """JSON-ready dict by the wire names."""
        return self.model_dump(mode="json", by_alias=True)


# -- header -------------------------------------------------------------------------------------------
class ModelInfo(_Frozen):
    """The model a recording ran on: its id, source file and sha256, dtype, and kind ("decoder-only" or
    "encoder-decoder", as the loaded model says: LoadedModel.kind; None for a target server's)."""

    id: str
    path: str | None = None
    sha256: str | None = None
    dtype: str = "float32"
    kind: str | None = None  # (v3)


class Header(_Frozen):
    """Line 1 of a recording: what made it, and with which scenario, model, engine and clock."""

    type: Literal["header"] = "header"
    format: Literal["kvtui-recording"] = FORMAT
    version: int = VERSION
    kvtui_version: str = ""
    created_unix_s: float = 0.0
    python: str = ""
    torch: str = ""
    transformers: str = ""
    scenario: dict[str, Any] = {}
    scenario_hash: str = ""
    seed: int = 0
    model: ModelInfo = ModelInfo(id="?")
    engine: dict[str, Any] = {}
    clock: Literal["virtual", "paced", "wall"] = "virtual"
    detectors: tuple[str, ...] = ()
    measured: tuple[str, ...] = ()
    modeled: tuple[str, ...] = ()
    cost_model: dict[str, Any] | None = None  # the virtual clock's step-cost fit (v2)
    # (v3) the reference detector's numeric tolerance: value (logits), source (calibrated, measured or
    # built-in), and for a calibration its file, CPU, torch version and threads (kvtui/detect/tolerance.py)
    reference_tolerance: dict[str, Any] | None = None
    target: str | None = None  # the HTTP server driven by `kvtui run --target` (v2)


# -- request lifecycle --------------------------------------------------------------------------------
class Arrive(_Frozen):
    """A request arrived and was submitted to the engine."""

    type: Literal["request.arrive"] = "request.arrive"
    t: float
    request_id: str
    prompt_len: int
    max_new_tokens: int
    passphrase: str | None = None
    tenant: str | None = None  # (v2)
    parent: str | None = None  # parallel sampling (n > 1): the submitted request this sequence is one of
    sampling: tuple[str, ...] = ()  # (v3) its per-row sampling state: pen, bias, ban, min (SamplingParams.state_tags)
    audio: str | None = None  # (v3) a speech request's audio (its file name)
    image: str | None = None  # (v3) an image request's pictures (their names, comma-separated)
    client_id: str | None = None  # (v3, target runs) the request id its client sent (scenario request_ids)
    lora: str | None = None  # (v3) the LoRA adapter it runs under (its name; None: the base model)
    lora_version: int | None = None  # (v3) that adapter's version (1, +1 at each reload); None: the base model


class FirstToken(_Frozen):
    type: Literal["request.first_token"] = "request.first_token"
    t: float
    request_id: str
    ttft_s: float | None


class Finish(_Frozen):
    """A request left the engine: finished (stop, length), aborted, rejected, or `error`: its own
    sampling or stop check raised in kvtui's engine (the rest of the batch went on), or against a target
    server (`kvtui run --target`) an HTTP error, a timeout or a broken stream; the text is in `detail`.
    `code` (v2) names the cause of a rejection or an engine error for machines, one code per cause
    (kvtui.engine.FinishCode: empty, too_long, out_of_vocabulary, queue_full, internal_error,
    invalid_logit_bias, invalid_bad_words, invalid_structured_output, unsupported_input,
    adapter_unsupported; model_not_found from a session); None otherwise."""

    type: Literal["request.finish"] = "request.finish"
    t: float | None
    request_id: str
    finish_reason: Literal["stop", "length", "abort", "rejected", "error"]
    detail: str = ""
    code: str | None = None  # (v2)
    slot: int | None = None
    prompt_ids: tuple[int, ...] = ()
    output_ids: tuple[int, ...] = ()
    output_text: str = ""
    arrival_s: float | None = None
    scheduled_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    token_times_s: tuple[float, ...] = ()
    passphrase: str | None = None
    passphrase_echoed: bool | None = None
    tenant: str | None = None  # (v2)
    # (v2, target runs) when the HTTP request was sent (after the client's concurrency cap), and the
    # server's own token counts (`usage`, else streamed chunks); token_times_s then holds the arrival
    # time of each streamed chunk that carried a choice, as vLLM's `bench serve` times them.
    sent_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # (v2, target runs) prompt tokens the server said it took from its prefix cache
    # (`usage.prompt_tokens_details.cached_tokens` or llama.cpp's `timings.cache_n`); None: not said
    cached_tokens: int | None = None
    # (v3, target runs) its send time minus its planned time (arrival_s), the wait for a place under
    # --max-concurrency left out: how late the client sent it (kvtui/remote/fidelity.py)
    send_lag_s: float | None = None

    @property
    def completed(self) -> bool:
        """Finished normally (stop or length): the requests latency statistics count."""
        return self.finish_reason in ("stop", "length")


# -- steps --------------------------------------------------------------------------------------------
# One type per step, made by the engine (`Engine.step()` returns a StepEvent) and recorded as it is: the
# session only adds each sampled token's text (`piece`). Fields marked `exclude=True` stay in memory
# (they hold engine objects or facts recorded by other events) and are not written to a recording.
class RunningEntry(_Frozen):
    """One request that took part in a step.

    Attributes:
        request_id, slot: who and where (slot None with paged KV).
        cache_len: tokens in its cache after the step (tokens).
        query_tokens: tokens it fed this step (a prompt chunk, or 1 when decoding).
        token_id: the token sampled this step, or None while a chunked prefill is unfinished.
        phase: "prefill" or "decode".
        piece: the sampled token's text (the session decodes it, so replays need no tokenizer).
        blocks: (v2, paged KV) its block table.
        logprobs: (v2) when the request asked for them (SamplingParams.logprobs), (token id, logprob) pairs:
            the sampled token first, then the k most likely tokens in descending order; natural logs of
            log_softmax over the float32 logits. None otherwise.
    In memory only (not recorded):
        top2_gap: top-1 minus top-2 logit of the sampled position (None without a sample); a small gap
            marks a near tie that numerical batch variance may flip.
        nonfinite: the logits held NaN or inf.
        ttft_s: time to first token (seconds) when this step sampled its first token, else None (recorded
            as a request.first_token event).
        sampled_with: the request whose per-row sampling state picked the token (its own unless a
            fault moved the row arrays: row_state_misalign; its own also when the state it used and its
            own are both greedy with no stages, so the pick is argmax either way); None without a sample.
        penalized_with: the requests whose tokens the penalties counted (a history's owner when
            repetition_penalty reads its prompt, and each request whose sampled tokens it holds): only the
            request itself unless a fault mixed histories (row_state_misalign, penalty_shared_history);
            None when no penalty applied or nothing was sampled.
        drawn_with: the trail of the generator that drew a sampled token, before the draw: the request
            that seeded it ("<unseeded>": a shared generator nobody seeded), then each other request
            that drew from it since, in order of their first draw; (its own id,) unless a fault shared
            generators (shared_rng, row_state_misalign); None for a greedy token or without a sample.
        These three are the engine's provenance of the sampling state (kvtui.engine.row_state.SampledWith),
        read by the sampling_provenance detector.
    """

    request_id: str
    slot: int | None
    cache_len: int
    query_tokens: int
    token_id: int | None
    phase: Literal["prefill", "decode"]
    piece: str | None = None
    blocks: tuple[int, ...] | None = None
    logprobs: tuple[tuple[int, float], ...] | None = None
    top2_gap: float | None = Field(default=None, exclude=True)
    nonfinite: bool = Field(default=False, exclude=True)
    ttft_s: float | None = Field(default=None, exclude=True)
    sampled_with: str | None = Field(default=None, exclude=True)
    # the engine's own tuples, kept as they are (no per-token copy by validation)
    penalized_with: SkipValidation[tuple[str, ...] | None] = Field(default=None, exclude=True)
    drawn_with: SkipValidation[tuple[str, ...] | None] = Field(default=None, exclude=True)


class TaintEntry(_Frozen):
    """A request whose mask let it read cache positions it does not own (slot_taint).

    Attributes:
        request_id: the victim.
        sources: request ids whose keys it could read ("<unwritten>" / "<pad>" for never-written or pad
            positions), most positions first.
        positions: number of (query, key) cells affected.
        examples: up to 5 (slot, position, owner) of the keys read; paged KV: (block, offset, owner).
    """

    request_id: str
    sources: tuple[str, ...]
    positions: int
    examples: tuple[tuple[int, int, str], ...]


class NonfiniteEntry(_Frozen):
    """A request whose logits were not finite, and who wrote the non-finite K/V it was allowed to read.

    Attributes:
        request_id: the request with non-finite logits.
        sources: writers of the non-finite positions it could read (its own id when it wrote them itself;
            "<unwritten>" / "<pad>" as in TaintEntry), most positions first.
        positions: how many such positions.
        examples: up to 5 (slot, position, writer).
    """

    request_id: str
    sources: tuple[str, ...]
    positions: int
    examples: tuple[tuple[int, int, str], ...]


class FlowEntry(_Frozen):
    """Attention mass a request's queries put on keys written by others (attention_flow).

    Attributes:
        request_id: the victim.
        foreign_mass: max over its query positions of the mean (over layers and heads) attention
            probability on keys written by other requests, in [0, 1].
        pad_mass: the same for never-written or pad keys.
        top_source: the request whose keys got the most mass, or None.
    """

    request_id: str
    foreign_mass: float
    pad_mass: float
    top_source: str | None


class ReusedBlockEntry(_Frozen):
    """One block a prefix-cache hit handed to a request, and where its contents came from.

    Attributes:
        index: its place in the reader's block table; block: the block id; tokens: tokens reused.
        writer, writer_tenant, writer_salt: the request that computed the block, its tenant, a digest of
            its cache_salt (None: no salt).
        writer_key, reader_key: content keys (hex: tokens chained to the whole prefix, no salt, no fault)
            of the block's contents and of what the reader would have computed there. A sound reuse has
            equal keys and the reader's own salt.
        tier: restored from the KV offload tier (the fields below only then, not recorded otherwise);
        intact: its bytes after the restore equal those the tier stored; found_writer: when not, the
            request whose bytes it holds (the block's previous owner after a restore that skipped it).
    """

    index: int
    block: int
    tokens: int
    writer: str
    writer_tenant: str | None
    writer_salt: str | None
    writer_key: str
    reader_key: str
    tier: bool = False
    intact: bool | None = None
    found_writer: str | None = None

    @pydantic.model_serializer(mode="wrap")
    def _pool_blocks_as_before(self, handler):
        data = handler(self)
        if not self.tier:
            for name in ("tier", "intact", "found_writer"):
                data.pop(name, None)
        return data


class PrefixHitEntry(_Frozen):
    """A request admitted with part of its prompt from the prefix cache (paged KV, prefix caching).

    Attributes:
        request_id, tenant, salt: the reader, its tenant, the digest of its cache_salt.
        hit_tokens: tokens taken from the cache; query_tokens: tokens it looked up (its prefill).
        blocks: the reused blocks.
    """

    request_id: str
    tenant: str | None
    salt: str | None
    hit_tokens: int
    query_tokens: int
    blocks: tuple[ReusedBlockEntry, ...]


class EncoderHitEntry(_Frozen):
    """A request whose cross-attention K/V came from the encoder cache (encoder-decoder models).

    Attributes:
        request_id: the reader; audio_hash: the first 12 hex digits of its own audio's sha256.
        entry_audio_hash: those of the audio the cached K/V were computed from.
        computed_for: the request whose admission computed them.
    """

    request_id: str
    audio_hash: str
    entry_audio_hash: str
    computed_for: str


class StateStartEntry(_Frozen):
    """(v3, hybrid models) The recurrent state a request started from when it took its state slot: at admission
    (a fresh start or a prefix hit) or when it forked from its lead (parallel sampling).

    Attributes:
        request_id, slot: the request and its state slot.
        via: "slot" (a start at position 0: what the slot held, the zero state unless a fault kept another),
            "checkpoint" (a prefix hit: the checkpoint kept with the hit's last block, restored into the slot),
            "fork" (a copy of its lead's state).
        tokens: the positions its state should cover (0 for a fresh start, the hit's tokens, the lead's length).
        writer: the request whose forward computed the state it got (None: the zero state).
        writer_tokens: the positions that state covers.
        publisher: the request that kept the checkpoint at its boundary when that is not the writer (None: the
            writer, or no checkpoint).
        writer_key, reader_key: 16 hex digits of the digest of the key items of the positions the state covers,
            and of the request's own first `tokens` positions. A sound start has equal keys.
    """

    request_id: str
    slot: int
    via: Literal["slot", "checkpoint", "fork"]
    tokens: int
    writer: str | None
    writer_tokens: int
    publisher: str | None = None
    writer_key: str
    reader_key: str

    @property
    def matches(self) -> bool:
        """The state covers exactly the request's own first `tokens` positions."""
        return self.writer_key == self.reader_key


class FaultActed(_Frozen):
    """(v3) Where an isolation fault acted in one step: the code path it changes took another decision than
    the sound one on real data (a block handed over under a faulty key, a mask left open over another
    request's keys, a slot kept stale, ...). One event per fault per step it acted in; a fault that was on
    and has none acted 0 times (kvtui.faults.inert_line says why).

    Attributes:
        t: engine clock at the end of the step (seconds); step: the step index.
        fault: the fault's name.
        request_ids: the requests it acted on (the victims, as far as the code path knows them).
        where: what `ids` number: "block" (paged KV block ids), "slot" (KV slots), "row" (batch rows),
            "state_slot" (a hybrid's state slots), "entry" (encoder-cache entries, by their reader), or "".
        ids: the blocks, slots or rows it touched (empty when it touched none by number).
    """

    type: Literal["fault.acted"] = "fault.acted"
    t: float
    step: int
    fault: str
    request_ids: tuple[str, ...] = ()
    where: str = ""
    ids: tuple[int, ...] = ()


class StepEvent(_Frozen):
    """What one `Engine.step()` did: the engine's report and the recorded `step` line, one type.

    Attributes:
        t: engine clock at the end of the step; start_s: at its start (seconds; modeled on the virtual
            clock, measured on the wall clock). wall_s: measured wall time of the step (seconds).
        step: step index (0-based).
        layout: "padded" or "packed".
        rows: rows of the model input (requests in padded layout, 1 in packed, 0 when idle).
        prefill_tokens, decode_tokens: real tokens fed (tokens).
        query_positions: positions computed on the query side, pads included (rows x query length).
        padded_positions: query positions that were padding (tokens).
        padding_ratio: padded_positions / query_positions (query side; 0 when idle).
        key_positions, key_padded_positions, key_padding_ratio: the same on the key side (mask cells per
            query row that hold no key of the row's own request).
        num_running: requests running after the step; max_batch_size: the most that may (EngineConfig).
        slots_used, num_slots: (slot KV only; None and not recorded with paged KV) slots owned after the
            step and slots in the pool.
        kv_tokens, kv_capacity_tokens, kv_usage: cached tokens after the step, pool capacity, share (with
            paged KV, kv_usage is kv_cache_usage_perc, by blocks).
        running: RunningEntry per request in the step.
        num_waiting: requests queued after the step.
        faults: isolation faults active in the step.
        taint: TaintEntry per request that could read cache positions it does not own (slot_taint on).
        flow: FlowEntry per request (attention_flow on).
        errors: (request_id, error text) for requests whose forward raised under a fault.
        stale_starts: (request_id, slot, previous owner, tokens kept) for slots reused stale.
        stale_masks: (request_id, previous owner, bitmask row) for plain requests that sampled through a
            structured-output bitmask row another request's grammar filled (the stale_bitmask fault).
        kv: "slots" or "paged". The rest is paged KV only (None or empty, and not recorded, with slots):
        num_blocks, blocks_used: usable blocks (the null block excluded) and those in use.
        kv_cache_usage_perc: blocks_used / num_blocks (vLLM's metric; cached free blocks are free).
        num_preemptions: requests preempted this step (preempted: their ids).
        prefix_cache_queries, prefix_cache_hits: tokens looked up / found in the prefix cache this step;
        prefix_cache_cross_tenant_hits: of the hits, tokens of blocks another tenant computed.
        prefix_hits: PrefixHitEntry per request admitted with a cache hit this step.
        block_state: one character per block (BlockManager.state: `_` null, `.` free, `c` cached free,
            digits: reference count); block_tables: (request id, block table) per running request.
    Paged KV with an offload tier only (None, and not recorded, otherwise): kv_offload_stores: blocks the
        tier stored (evicted from the pool) this step; kv_offload_queries, kv_offload_hits: prompt tokens
        past the pool's own hit asked of the tier / restored from it this step (vLLM's external prefix
        cache counters);
        kv_offload_blocks, kv_offload_bytes: blocks and K/V bytes it holds; kv_offload_capacity: the most
        blocks it holds.
    Encoder-decoder models only (None or empty, and not recorded, otherwise): encoder_entries,
        encoder_capacity, encoder_referenced: cross-K/V entries in the encoder cache after the step, the
        most it keeps, those held by a running request; encoder_bytes: their K/V bytes; encoder_hits,
        encoder_misses: lookups since the engine started; encoder_hit_log: EncoderHitEntry per hit this step.
    Hybrid models only (None, and not recorded, otherwise): state_slots_used, num_state_slots: recurrent-state
        slots owned after the step and slots in the state pool; state_checkpoints: state checkpoints kept
        with their blocks this step (paged KV with prefix caching); state_checkpoint_hits: prefix-cache hit
        tokens whose state came from a checkpoint this step; state_restores: state slots restored from a
        checkpoint this step; state_starts: StateStartEntry per request that took a state slot this step
        (admitted or forked), for the state_provenance detector; state_slot_map: (slot, owner or None, the
        positions of the owner's last checkpoint or None) per state slot after the step, for the dashboard.
    In memory only (not recorded):
        finished: kvtui.engine.FinishedRequestReport per request that left during the step (the session
            records each as a request.finish event); the engine forgets them once the step is out.
        nonfinite: NonfiniteEntry per request whose logits were not finite (slot_taint or attention_flow
            on); recorded as the contamination events the detectors make of them.
        acted: FaultActed per fault that acted in the step (recorded as fault.acted events after the step).
    """

    type: Literal["step"] = "step"
    t: float
    step: int
    start_s: float
    wall_s: float
    layout: str
    rows: int
    prefill_tokens: int
    decode_tokens: int
    query_positions: int
    padded_positions: int
    padding_ratio: float
    key_positions: int
    key_padded_positions: int
    key_padding_ratio: float
    num_running: int
    max_batch_size: int
    slots_used: int | None = None
    num_slots: int | None = None
    kv_tokens: int
    kv_capacity_tokens: int
    kv_usage: float
    running: tuple[RunningEntry, ...]
    num_waiting: int
    faults: tuple[str, ...] = ()
    taint: tuple[TaintEntry, ...] = ()
    flow: tuple[FlowEntry, ...] = ()
    errors: tuple[tuple[str, str], ...] = ()
    stale_starts: tuple[tuple[str, int, str | None, int], ...] = ()
    stale_masks: tuple[tuple[str, str, int], ...] = ()
    # (v2, paged KV only; absent with slots)
    kv: Literal["slots", "paged"] = "slots"
    num_blocks: int | None = None
    blocks_used: int | None = None
    kv_cache_usage_perc: float | None = None
    num_preemptions: int | None = None
    preempted: tuple[str, ...] = ()
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    prefix_cache_cross_tenant_hits: int | None = None
    prefix_hits: tuple[PrefixHitEntry, ...] = ()
    block_state: str | None = None
    block_tables: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # paged KV with an offload tier only
    kv_offload_stores: int | None = None
    kv_offload_queries: int | None = None
    kv_offload_hits: int | None = None
    kv_offload_blocks: int | None = None
    kv_offload_bytes: int | None = None
    kv_offload_capacity: int | None = None
    # encoder-decoder models only
    encoder_entries: int | None = None
    encoder_capacity: int | None = None
    encoder_referenced: int | None = None
    encoder_bytes: int | None = None
    encoder_hits: int | None = None
    encoder_misses: int | None = None
    encoder_hit_log: tuple[EncoderHitEntry, ...] = ()
    # hybrid models only
    state_slots_used: int | None = None
    num_state_slots: int | None = None
    state_checkpoints: int | None = None
    state_checkpoint_hits: int | None = None
    state_restores: int | None = None
    state_starts: tuple[StateStartEntry, ...] = ()
    state_slot_map: tuple[tuple[int, str | None, int | None], ...] = ()
    # in memory only
    finished: tuple[Any, ...] = Field(default=(), exclude=True)
    nonfinite: tuple[NonfiniteEntry, ...] = Field(default=(), exclude=True)
    acted: tuple[FaultActed, ...] = Field(default=(), exclude=True)

    @property
    def tokens(self) -> int:
        """Real tokens fed this step (prefill + decode)."""
        return self.prefill_tokens + self.decode_tokens

    @property
    def occupancy(self) -> float:
        """Share of the batch in use after the step: slots_used / num_slots with slots, num_running /
        max_batch_size with paged KV (0..1)."""
        if self.num_slots is not None:
            return self.slots_used / self.num_slots if self.num_slots else 0.0
        return self.num_running / self.max_batch_size if self.max_batch_size else 0.0

    def to_json(self) -> str:
        """One line of the recording, without the fields of the other KV mode."""
        return self.model_dump_json(by_alias=True, exclude=self._other_mode())

    def to_dict(self) -> dict:
        return self.model_dump(mode="json", by_alias=True, exclude=self._other_mode())

    def _other_mode(self) -> set[str]:
        other = set(PAGED_STEP_FIELDS if self.kv == "slots" else SLOT_STEP_FIELDS)
        if self.kv_offload_capacity is None:
            other |= set(OFFLOAD_STEP_FIELDS)
        if self.num_state_slots is None:
            other |= set(STATE_STEP_FIELDS)
        return other if self.encoder_entries is not None else other | set(ENCODER_STEP_FIELDS)


# StepEvent fields that only paged KV fills (not recorded for a slots run), and those only slots fill
PAGED_STEP_FIELDS = ("kv", "num_blocks", "blocks_used", "kv_cache_usage_perc", "num_preemptions", "preempted",
                     "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_cross_tenant_hits", "prefix_hits",
                     "block_state", "block_tables")
SLOT_STEP_FIELDS = ("slots_used", "num_slots")
# StepEvent fields that only paged KV with an offload tier fills
OFFLOAD_STEP_FIELDS = ("kv_offload_stores", "kv_offload_queries", "kv_offload_hits", "kv_offload_blocks", "kv_offload_bytes",
                       "kv_offload_capacity")
# StepEvent fields that only a hybrid model's engine fills (not recorded otherwise)
STATE_STEP_FIELDS = ("state_slots_used", "num_state_slots", "state_checkpoints", "state_checkpoint_hits",
                     "state_restores", "state_starts", "state_slot_map")
# StepEvent fields that only an encoder-decoder engine fills (not recorded otherwise)
ENCODER_STEP_FIELDS = ("encoder_entries", "encoder_capacity", "encoder_referenced", "encoder_bytes", "encoder_hits",
                       "encoder_misses", "encoder_hit_log")


def _step_v2(data: dict, engine: dict | None) -> dict:
    """A version-1 or -2 `step` line in this version's names: running entries' `id`, `q`, `token` become
    `request_id`, `query_tokens`, `token_id`; `slots_used` / `num_slots` meant running requests and
    max_batch_size under paged KV (`num_running`, `max_batch_size` now), slots with slot KV (kept, and
    `num_running` taken from `slots_used`: each running request owns one slot); `slot_occupancy` and
    `foreign_attention` (flow's foreign_mass, rounded) are derived, no longer stored. `engine`: the
    header's engine config, for max_batch_size of a slot run."""
    data = dict(data)
    used, total = data.pop("slots_used", 0), data.pop("num_slots", 0)
    data.pop("slot_occupancy", None)
    data.pop("foreign_attention", None)
    if data.get("kv", "slots") == "paged":
        data.update(num_running=used, max_batch_size=total)
    else:
        data.update(num_running=used, max_batch_size=int((engine or {}).get("max_batch_size") or total),
                    slots_used=used, num_slots=total)
    data["running"] = [{"request_id": r["id"], "query_tokens": r["q"], "token_id": r["token"],
                        **{k: v for k, v in r.items() if k not in ("id", "q", "token")}}
                       for r in data.get("running", ())]
    return data


# -- contamination ------------------------------------------------------------------------------------
class ReferenceEvidence(_Frozen):
    """The token where a request's batched output differs from its solo run: the first divergence, or
    the first one not numeric after numeric flips (kvtui/detect/reference.py)."""

    token_index: int
    batched_token: int | None
    solo_token: int | None
    top2_gap: float | None  # logits; None when a logit was not finite
    tolerance: float
    batched_text: str
    solo_text: str
    nonfinite: bool = False  # (v2) the batched logits held NaN/inf at or before the divergence
    suspects: tuple[str, ...] = ()  # (v2) co-batched requests and the slot's earlier owners
    batched_piece: str | None = None  # (v2, target runs) the two tokens' text at the divergence
    solo_piece: str | None = None
    draw_u: float | None = None  # (v2, sampled tokens) the uniform that drew the token in both runs
    draw_shift: float | None = None  # (v2, sampled) log-odds move of a CDF boundary that explains the flip
    logit_spread: float | None = None  # (v2, sampled) relative move of the logits listed by both runs
    draw_tolerance: float | None = None  # (v2, sampled) tolerance / temperature: the largest numeric shift
    # (v3) when the first divergence was a numeric flip and the rest was checked teacher-forced on the
    # batched tokens: that first divergence, and the flips judged numeric there (before token_index in a
    # counted report; all of the request's in a numeric one); None: the first divergence alone was judged
    first_divergence: int | None = None
    numeric_flips: int | None = None


class CanaryEvidence(_Frozen):
    leaked: str  # the other request's passphrase
    matched: str  # the fragment found
    text: str  # the end of the victim's text


class FlowEvidence(_Frozen):
    foreign_mass: float | None  # mean attention probability on keys written by others; None: not finite
    pad_mass: float | None
    nonfinite: bool = False  # (v2) a non-finite value was read from another request's positions


class TaintExample(_Frozen):
    """A key position a query could read: slot and position, or with paged KV block and offset."""

    slot: int | None = None
    pos: int | None = None
    written_by: str
    block: int | None = None  # (v2, paged KV)
    offset: int | None = None  # (v2, paged KV)


class TaintEvidence(_Frozen):
    positions: int
    sources: tuple[str, ...]
    examples: tuple[TaintExample, ...]
    nonfinite: bool = False  # (v2) the positions read hold NaN/inf (the victim's logits were not finite)


class ProvenanceEvidence(_Frozen):
    """(v2) A prefix-cache hit reused blocks that another tenant (another salt) or another prefix wrote."""

    blocks: tuple[int, ...]  # the reused block ids
    hit_tokens: int  # tokens the victim took from them
    victim_tenant: str | None
    source_tenant: str | None
    same_salt: bool
    same_prefix: bool  # the blocks' content keys (tokens chained to their prefix) equal the victim's own
    # (v3, encoder-decoder models) an encoder-cache hit: 12 hex of the reader's audio's sha256 and of the
    # audio the cached cross-attention K/V were computed from (blocks empty, hit_tokens 0 then)
    audio_hash: str | None = None
    source_audio_hash: str | None = None
    # (v3, paged KV with an offload tier) of the blocks restored from the tier: False when one's bytes after
    # the restore were not those the tier stored (another layout, or a restore that skipped it); None: none
    tier_intact: bool | None = None


class EngineErrorEvidence(_Frozen):
    error: str


class ConstraintEvidence(_Frozen):
    """(v3) A token its own request did not allow (kvtui/detect/constraint.py)."""

    rule: Literal["bad_words", "min_tokens", "logit_bias", "grammar_bitmask"]  # the request's own rule that bans
    # the token; grammar_bitmask: the row was sampled through a bitmask row another request's grammar filled
    token_index: int  # the token's index in the victim's output
    token_id: int | None
    sampled_with: str | None = None  # the request whose per-row sampling state picked it (None: not known)
    suspects: tuple[str, ...] = ()  # the requests running beside the victim at that step
    bitmask_row: int | None = None  # grammar_bitmask: the bitmask buffer's row


class SamplingEvidence(_Frozen):
    """(v3) A token sampled with another request's sampling state (kvtui/detect/sampling.py): the
    engine's tags of the token, and how the source reached the victim."""

    via: tuple[Literal["row_state", "penalty_history", "generator"], ...]  # the tags that name the source
    token_index: int  # the token's index in the victim's output
    token_id: int
    row_state: str | None = None  # the request whose row state picked the token
    penalty_history: tuple[str, ...] = ()  # the requests whose tokens the penalties counted (none: no penalties)
    generator: tuple[str, ...] = ()  # the generator's trail: who seeded it, then who else drew (none: greedy)


class StateEvidence(_Frozen):
    """(v3, hybrid models) A request started from a recurrent state that does not cover its own prefix
    (kvtui/detect/state_provenance.py): the engine's StateStartEntry of that start."""

    via: Literal["slot", "checkpoint", "fork"]  # where the state came from (see StateStartEntry)
    slot: int  # the request's state slot
    tokens: int  # positions its state should cover
    writer: str | None  # who computed the state it got (None: the zero state)
    writer_tokens: int  # positions that state covers
    publisher: str | None = None  # who kept the checkpoint at its boundary, when not the writer
    writer_key: str  # digests (16 hex) of the positions the state covers and of the request's own
    reader_key: str


class RequestIdEvidence(_Frozen):
    """(v3) The request-id audit of a target server (kvtui/remote/request_ids.py): what the client of a
    request whose id collided with another's saw (hung, lost), or a probe with a fresh id after the load
    (stopped_serving)."""

    client_id: str  # the id the victim sent ("" for GET /health)
    sent_as: tuple[str, ...]  # where: header (x-request-id), user, request_id, traceparent, rid
    group: str  # e.g. "duplicate group 2", "near_duplicate group 4 (case)", "probe"
    shares_id_with: tuple[str, ...]  # the requests whose id equals or nears the victim's
    overlapped: bool  # one of them was in flight while the victim was
    outcome: str  # what the client saw, e.g. "no whole answer within 30 s", "HTTP 503: ..."
    waited_s: float | None = None  # send to giving up (or to the error)
    status: int | None = None  # the HTTP status, when one came
    probes_sent: int | None = None  # stopped_serving: probes with fresh ids sent after the load
    probes_answered: int | None = None
    health_status: int | None = None  # GET /health after the load; None: not asked, or no answer


class NoninterferenceEvidence(_Frozen):
    token_index: int
    baseline_text: str
    text_with_neighbours_replaced: str
    replaced_neighbours: tuple[str, ...]
    top2_gap: float | None = None  # (v2, target runs) top-2 logprob gap at the changed token, when known
    tolerance: float | None = None  # (v2, target runs) the gap under which a change counts as numeric


EVIDENCE: dict[str, type[_Frozen]] = {
    "reference": ReferenceEvidence, "canary": CanaryEvidence, "attention_flow": FlowEvidence,
    "slot_taint": TaintEvidence, "engine": EngineErrorEvidence, "noninterference": NoninterferenceEvidence,
    "prefix_provenance": ProvenanceEvidence, "constraint": ConstraintEvidence,
    "sampling_provenance": SamplingEvidence, "request_id": RequestIdEvidence, "state_provenance": StateEvidence,
}
Evidence = Union[ReferenceEvidence, CanaryEvidence, FlowEvidence, TaintEvidence, EngineErrorEvidence,
                 NoninterferenceEvidence, ProvenanceEvidence, ConstraintEvidence, SamplingEvidence, RequestIdEvidence,
                 StateEvidence]


class Contamination(_Frozen):
    """A detector's report: `victim` got information from `source` (cross_request), was served another
    tenant's cached KV (cross_tenant), damaged itself (corruption), or flipped a near tie (numeric,
    never counted as contamination); `unknown`: a target server's output differed from its solo run
    where the server gave no logprobs to tell a near tie from damage (reported, not counted)."""

    type: Literal["contamination"] = "contamination"
    t: float
    step: int
    detector: str
    kind: ContaminationKind
    victim: str
    source: str | None = None
    evidence: Evidence
    finding: int | None = None  # (v2) the finding this report is a witness of

    @pydantic.model_validator(mode="before")
    @classmethod
    def _evidence_by_detector(cls, data: Any) -> Any:
        """Validate `evidence` with the model of its detector (a dict names no type of its own)."""
        if isinstance(data, dict) and isinstance(data.get("evidence"), dict):
            model = EVIDENCE.get(data.get("detector"))
            if model is None:
                raise ValueError(f"unknown detector {data.get('detector')!r}; known: {', '.join(EVIDENCE)}")
            data = {**data, "evidence": model.model_validate(data["evidence"])}
        return data

    @property
    def counts(self) -> bool:
        """A real finding (cross_request, cross_tenant or corruption), not a numeric near tie or an
        unknown cause."""
        return self.kind not in UNCOUNTED_KINDS


# -- run control --------------------------------------------------------------------------------------
class FaultSwitch(_Frozen):
    type: Literal["fault"] = "fault"
    t: float
    name: str
    on: bool
    source: str  # config, key, timeline
    active: tuple[str, ...]


class TimelineApplied(_Frozen):
    type: Literal["timeline"] = "timeline"
    t: float
    at_s: float
    set: dict[str, Any]
    marker: str | None = None


class Marker(_Frozen):
    type: Literal["marker"] = "marker"
    t: float
    text: str


class RecordingFailed(_Frozen):
    """The recording stopped: a write failed (disk full, file too large, I/O error). Never recorded (the
    file takes no more lines); listeners get it, so a server can log it and count it and the dashboard
    can show it. `lines`: whole lines the file kept; `error`: the cause, e.g. 'No space left on device
    (ENOSPC)'."""

    type: Literal["recording.failed"] = "recording.failed"
    t: float
    path: str
    lines: int
    error: str


class SkipReason(str, Enum):
    """Why a completed request was left without a reference check (the keys of
    ReferenceStatus.skipped_by_reason; a member equals its string value, as recorded, and prints as it). A
    `(str, Enum)`: Python 3.10 has no enum.StrEnum."""

    STOPPED = "stopped"
    QUEUE_FULL = "queue_full"
    SAMPLED = "sampled"
    ERROR = "error"
    SERVER_STOPPED = "server_stopped"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


# each SkipReason in words
SKIP_REASONS = {
    SkipReason.STOPPED: "the run was stopped before they were checked",
    SkipReason.QUEUE_FULL: "the oldest were dropped when more were waiting than the queue holds",
    SkipReason.SAMPLED: "sampled answers (temperature > 0) from a server have no reference",
    SkipReason.ERROR: "their request (the batched or the solo one) failed",
    SkipReason.SERVER_STOPPED: "the server stopped serving (the request-id audit's probes failed)",
}


class ReferenceStatus(_Frozen):
    """Progress of the reference detector's checks (v2): completed requests checked against their
    reference run, skipped (left unchecked; `skipped_by_reason` says why, by the keys of SKIP_REASONS),
    still waiting."""

    type: Literal["reference.status"] = "reference.status"
    t: float
    checked: int
    skipped: int
    pending: int
    # (v2, target runs) solo runs the server answered partly from its prefix cache: not counted as
    # checked; and of the checked ones, those whose server reported 0 cached prompt tokens
    cached: int | None = None
    uncached_verified: int | None = None
    skipped_by_reason: dict[str, int] | None = None  # (v2) reason -> requests; None in older recordings


# -- a target server's own view ---------------------------------------------------------------------
class SlotState(_Frozen):
    """One server slot as llama.cpp's `/slots` shows it."""

    id: int
    n_ctx: int | None = None  # the slot's context (tokens)
    busy: bool = False
    context_tokens: int | None = None  # prompt + generated tokens, when the server shows them
    request_id: str | None = None  # the run's request in the slot, matched by its prompt text when shown


class ServerSample(_Frozen):
    """What a target server exposes, polled during `kvtui run --target`: gauges and counters from its
    Prometheus `/metrics` (vLLM `vllm:*`, llama.cpp `llamacpp:*`, SGLang `sglang:*`, TGI `tgi_*`;
    under each sample name the sum over its labels, plus `name{label="value",...}` per label set where
    a family's labels go beyond `model_name` and `engine`) and llama.cpp's `/slots`. `running`, `waiting` and
    `kv_usage` (fraction 0-1) are read from whichever of those names the server has; None when none."""

    type: Literal["server.sample"] = "server.sample"
    t: float
    metrics: dict[str, float] = {}
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    slots: tuple[SlotState, ...] | None = None


class LoadFidelity(_Frozen):
    """(v3, target runs) How faithfully the client kept the scenario's schedule (kvtui/remote/fidelity.py):
    emitted while the load runs (about every second, for the dashboard) and once after it; the last one is
    also the summary's `load_fidelity`.

    Attributes:
        requests_sent: requests sent so far. capped: of those, how many waited for a place under
            --max-concurrency (that wait is the cap's, not lag).
        requested_rate_per_s / achieved_rate_per_s: (sent - 1) over the span of their planned / actual
            send times (req/s); None with fewer than two sends or all planned at one instant.
        lag_p50_s, lag_p99_s, lag_max_s: schedule lag, each request's actual minus planned send time
            (seconds, the cap's wait left out); None before the first send.
        client_cpu_s: CPU seconds the client used to send the load (user + system, all its threads) over
            `wall_s`, the wall seconds since the load started; client_cpu_share: their ratio per sending
            process (1.0 = each sender had one core busy all the time).
        senders: how many processes sent the load (1; `--workers N`: the N Ray workers, whose CPU
            seconds client_cpu_s sums).
        warning: one line when the client rather than the server limited the run (lag p99 over 10 ms, or
            under 98% of the requested rate sent), else None.
    """

    type: Literal["load.fidelity"] = "load.fidelity"
    t: float
    requests_sent: int = 0
    capped: int = 0
    requested_rate_per_s: float | None = None
    achieved_rate_per_s: float | None = None
    lag_p50_s: float | None = None
    lag_p99_s: float | None = None
    lag_max_s: float | None = None
    client_cpu_s: float = 0.0
    wall_s: float = 0.0
    client_cpu_share: float | None = None
    senders: int = 1
    warning: str | None = None


# -- summary ------------------------------------------------------------------------------------------
class LatencyStats(_Frozen):
    """Count, mean and percentiles (linear interpolation) of a latency list, seconds."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p95: float | None
    p99: float | None


class CounterEntry(_Frozen):
    kind: str
    detector: str
    value: int


class Summary(_Frozen):
    """The last line of a recording: the figures `kvtui run` prints (see kvtui/metrics.py)."""

    type: Literal["summary"] = "summary"
    t: float
    duration_s: float
    steps: int
    measured_step_wall_s: float
    requests_finished: int
    finish_reasons: dict[str, int]
    rejections: int
    rejection_reasons: dict[str, int] | None = None  # (v2) rejected requests by code, when any was
    prompt_tokens: int
    generated_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    output_tokens_per_s: float
    request_throughput_per_s: float
    goodput_requests_per_s: float
    time_to_first_token_seconds: LatencyStats
    time_per_output_token_seconds: LatencyStats
    inter_token_latency_seconds: LatencyStats
    e2e_request_latency_seconds: LatencyStats
    request_queue_time_seconds: LatencyStats
    padding_ratio_mean: float = Field(alias="kvtui:padding_ratio_mean")
    key_padding_ratio_mean: float = Field(alias="kvtui:key_padding_ratio_mean")
    slot_occupancy_peak: float = Field(alias="kvtui:slot_occupancy_peak")
    kv_cache_usage_perc_peak: float
    num_requests_waiting_peak: int
    passphrase_requests: int = Field(alias="kvtui:passphrase_requests")
    passphrase_echoed: int = Field(alias="kvtui:passphrase_echoed")
    contamination_events_total: tuple[CounterEntry, ...] = Field(alias="kvtui:contamination_events_total")
    faults_active_at_end: tuple[str, ...] = ()
    contamination_by_fault: dict[str, int] = {}
    # (v3) fault.acted events per fault that was on during the run (0: it never acted); None: no fault was on,
    # or the run does not know its faults (a target server's)
    fault_acts: dict[str, int] | None = None
    stopped_early: bool = False
    requests_not_submitted: int = 0
    requests_completed: int | None = None  # (v2) stop or length
    # (v3) parallel sampling: requests submitted, when some ran as n > 1 sequences (requests_finished and the
    # other per-request figures count sequences); None when every request ran as one
    requests_submitted: int | None = None
    requests_in_flight: int | None = None  # (v2) arrived, not finished when the recording ended
    findings_by_kind: dict[str, int] | None = None  # (v2)
    reference_checked: int | None = None  # (v2) requests compared with their solo run
    reference_skipped: int | None = None  # (v2) requests left unchecked
    reference_skipped_by_reason: dict[str, int] | None = None  # (v2) why, by the keys of SKIP_REASONS
    num_preemptions_total: int | None = None  # (v2, paged KV)
    prefix_cache_queries: int | None = None  # (v2, tokens)
    prefix_cache_hits: int | None = None  # (v2, tokens)
    prefix_cache_cross_tenant_hits: int | None = None  # (v2, tokens of blocks another tenant computed)
    # (v3, paged KV with an offload tier) prompt tokens asked of the tier / restored from it, blocks stored in
    # it, over the run; K/V bytes it held after the last step
    kv_offload_queries: int | None = None
    kv_offload_hits: int | None = None
    kv_offload_stores: int | None = None
    kv_offload_bytes: int | None = None
    # (v2, target runs) references not counted: the server took part of their prompts from its cache;
    # references whose server reported 0 cached tokens; prompt tokens of the load the server reported
    # cached (summed over requests); prefix_cache_queries / _hits then hold the server's own counters
    # (vLLM's `vllm:prefix_cache_queries` / `_hits`, tokens) over the load
    reference_cached: int | None = None
    reference_uncached_verified: int | None = None
    prompt_tokens_cached: int | None = None
    # (v3) models with an encoder cache (Whisper's audio, an image model's pictures): lookups that found an
    # entry / that ran the encoder, over the run; entries and bytes held after the last step
    encoder_cache_hits: int | None = None
    encoder_cache_misses: int | None = None
    encoder_cache_entries: int | None = None
    encoder_cache_bytes: int | None = None
    # (v3) hybrid models: recurrent-state checkpoints kept with their blocks, prefix-hit tokens whose state came
    # from a checkpoint, and state slots restored from one, over the run (paged KV with prefix caching)
    state_checkpoints: int | None = None
    state_checkpoint_hits: int | None = None
    state_restores: int | None = None
    # (v3, target runs with request_ids) the request-id audit's one line (kvtui/remote/request_ids.py)
    request_id_audit: str | None = None
    # (v3) runs with LoRA adapters: arrived requests by adapter and version ("lora-a@2"; "none": the base
    # model), and the timeline's reloads by adapter; None when no request ran under an adapter
    lora_requests: dict[str, int] | None = None
    lora_reloads: dict[str, int] | None = None
    # (v3, target runs) how faithfully the client kept the schedule: the run's last LoadFidelity
    load_fidelity: LoadFidelity | None = None
    # (v3, trace runs against a target) prefix hits: "all" (and each tenant's) -> {trace_hit_tokens,
    # trace_prompt_tokens: the trace's theoretical hits (kvtui.scenario.trace.hit_table); cached_tokens,
    # prompt_tokens: what the server's usage reported}; None: not a trace run
    trace_prefix_hits: dict[str, dict[str, int | None]] | None = None

    def contamination_total(self) -> int:
        """Events that count (cross_request, cross_tenant and corruption, not numeric or unknown)."""
        return sum(c.value for c in self.contamination_events_total if c.kind not in UNCOUNTED_KINDS)


Event = Annotated[Union[Arrive, FirstToken, Finish, StepEvent, Contamination, FaultSwitch, FaultActed, TimelineApplied, Marker,
                        ReferenceStatus, ServerSample, LoadFidelity, Summary], Field(discriminator="type")]
_EVENT = pydantic.TypeAdapter(Event)
EVENT_TYPES: dict[str, type[_Frozen]] = {
    m.model_fields["type"].default: m
    for m in (Header, Arrive, FirstToken, Finish, StepEvent, Contamination, FaultSwitch, FaultActed, TimelineApplied, Marker,
              ReferenceStatus, ServerSample, LoadFidelity, Summary)}


def parse_event(data: dict, version: int = VERSION, engine: dict | None = None) -> _Frozen:
    """A recorded line (already JSON-decoded) as its typed event; the header too.

    Args:
        version: the recording's format version (its header's); a `step` line of version 1 or 2 is
            mapped onto this version's names first. engine: the header's engine config (for that mapping).
    Raises:
        pydantic.ValidationError: the line does not match its type (or names no known type).
    """
    if isinstance(data, dict) and data.get("type") == "header":
        return Header.model_validate(data)
    if version < 3 and isinstance(data, dict) and data.get("type") == "step":
        data = _step_v2(data, engine)
    return _EVENT.validate_python(data)
