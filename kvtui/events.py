"""Typed events: one frozen pydantic model per kind of thing a run reports.

Every producer (session, detectors, audit) builds these, every consumer (recorder, metrics, the
dashboard's state, replay) reads them, and a recording is these models serialized one per line
(JSON Lines). Times (`t` and every `*_s` field) are seconds on the run's clock; token counts are tokens.

Wire format: version 2. It adds to version 1 only optional fields, so a version-1 recording reads
with these same models (`parse_event`), and `kvtui replay` plays both. recordings/README.md lists
every field of every type.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from kvtui.faults import ContaminationKind

FORMAT = "kvtui-recording"
UNCOUNTED_KINDS = ("numeric", "unknown")  # contamination kinds that are reported but never counted
VERSION = 2
READABLE_VERSIONS = (1, 2)


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
    id: str
    path: str | None = None
    sha256: str | None = None
    dtype: str = "float32"


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


class FirstToken(_Frozen):
    type: Literal["request.first_token"] = "request.first_token"
    t: float
    request_id: str
    ttft_s: float | None


class Finish(_Frozen):
    """A request left the engine: finished (stop, length), aborted, rejected, or `error`: its own
    sampling or stop check raised in kvtui's engine (the rest of the batch went on), or against a target
    server (`kvtui run --target`) an HTTP error, a timeout or a broken stream; the text is in `detail`.
    `code` (v2) names the cause of a rejection or an engine error for machines (kvtui.engine.FinishCode:
    empty, too_long, out_of_vocabulary, queue_full, internal_error); None otherwise."""

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

    @property
    def completed(self) -> bool:
        """Finished normally (stop or length): the requests latency statistics count."""
        return self.finish_reason in ("stop", "length")


# -- steps --------------------------------------------------------------------------------------------
class RunningEntry(_Frozen):
    """One request's part in a step."""

    id: str
    slot: int | None  # None with paged KV
    cache_len: int
    q: int  # tokens fed this step
    token: int | None  # token sampled this step, None during an unfinished chunked prefill
    phase: Literal["prefill", "decode"]
    piece: str | None = None  # the sampled token's text
    blocks: tuple[int, ...] | None = None  # (v2, paged KV) its block table
    # (v2) when the request asked for them: (token id, logprob) of the sampled token, then the top k
    logprobs: tuple[tuple[int, float], ...] | None = None


class TaintEntry(_Frozen):
    request_id: str
    sources: tuple[str, ...]
    positions: int
    examples: tuple[tuple[int, int, str], ...]


class FlowEntry(_Frozen):
    request_id: str
    foreign_mass: float
    pad_mass: float
    top_source: str | None


class ReusedBlockEntry(_Frozen):
    """One block a prefix-cache hit reused (see kvtui/engine/report.py ReusedBlockReport)."""

    index: int
    block: int
    tokens: int
    writer: str
    writer_tenant: str | None
    writer_salt: str | None
    writer_key: str
    reader_key: str


class PrefixHitEntry(_Frozen):
    """A request admitted with part of its prefill from the prefix cache (paged KV)."""

    request_id: str
    tenant: str | None
    salt: str | None
    hit_tokens: int
    query_tokens: int
    blocks: tuple[ReusedBlockEntry, ...]


class StepEvent(_Frozen):
    """One engine step (the engine's StepReport; see kvtui/engine/report.py for each field)."""

    type: Literal["step"] = "step"
    t: float  # end of the step
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
    slots_used: int
    num_slots: int
    slot_occupancy: float
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
    foreign_attention: dict[str, float] | None = None
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


# StepEvent fields that only paged KV fills (dropped from a slots run's step events)
PAGED_STEP_FIELDS = ("kv", "num_blocks", "blocks_used", "kv_cache_usage_perc", "num_preemptions", "preempted",
                     "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_cross_tenant_hits", "prefix_hits",
                     "block_state", "block_tables")


# -- contamination ------------------------------------------------------------------------------------
class ReferenceEvidence(_Frozen):
    """The first token where a request's batched output differs from its solo run."""

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


class EngineErrorEvidence(_Frozen):
    error: str


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
    "prefix_provenance": ProvenanceEvidence,
}
Evidence = Union[ReferenceEvidence, CanaryEvidence, FlowEvidence, TaintEvidence, EngineErrorEvidence,
                 NoninterferenceEvidence, ProvenanceEvidence]


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


# Why a completed request was left without a reference check (ReferenceStatus.skipped_by_reason), in words.
SKIP_REASONS = {
    "stopped": "the run was stopped before they were checked",
    "queue_full": "the oldest were dropped when more were waiting than the queue holds",
    "sampled": "sampled answers (temperature > 0) from a server have no reference",
    "error": "their request (the batched or the solo one) failed",
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
    stopped_early: bool = False
    requests_not_submitted: int = 0
    requests_completed: int | None = None  # (v2) stop or length
    requests_in_flight: int | None = None  # (v2) arrived, not finished when the recording ended
    findings_by_kind: dict[str, int] | None = None  # (v2)
    reference_checked: int | None = None  # (v2) requests compared with their solo run
    reference_skipped: int | None = None  # (v2) requests left unchecked
    reference_skipped_by_reason: dict[str, int] | None = None  # (v2) why, by the keys of SKIP_REASONS
    num_preemptions_total: int | None = None  # (v2, paged KV)
    prefix_cache_queries: int | None = None  # (v2, tokens)
    prefix_cache_hits: int | None = None  # (v2, tokens)
    prefix_cache_cross_tenant_hits: int | None = None  # (v2, tokens of blocks another tenant computed)
    # (v2, target runs) references not counted: the server took part of their prompts from its cache;
    # references whose server reported 0 cached tokens; prompt tokens of the load the server reported
    # cached (summed over requests); prefix_cache_queries / _hits then hold the server's own counters
    # (vLLM's `vllm:prefix_cache_queries` / `_hits`, tokens) over the load
    reference_cached: int | None = None
    reference_uncached_verified: int | None = None
    prompt_tokens_cached: int | None = None

    def contamination_total(self) -> int:
        """Events that count (cross_request, cross_tenant and corruption, not numeric or unknown)."""
        return sum(c.value for c in self.contamination_events_total if c.kind not in UNCOUNTED_KINDS)


Event = Annotated[Union[Arrive, FirstToken, Finish, StepEvent, Contamination, FaultSwitch, TimelineApplied, Marker,
                        ReferenceStatus, ServerSample, Summary], Field(discriminator="type")]
_EVENT = pydantic.TypeAdapter(Event)
EVENT_TYPES: dict[str, type[_Frozen]] = {
    m.model_fields["type"].default: m
    for m in (Header, Arrive, FirstToken, Finish, StepEvent, Contamination, FaultSwitch, TimelineApplied, Marker,
              ReferenceStatus, ServerSample, Summary)}


def parse_event(data: dict) -> _Frozen:
    """A recorded line (already JSON-decoded) as its typed event; the header too.

    Raises:
        pydantic.ValidationError: the line does not match its type (or names no known type).
    """
    if isinstance(data, dict) and data.get("type") == "header":
        return Header.model_validate(data)
    return _EVENT.validate_python(data)
