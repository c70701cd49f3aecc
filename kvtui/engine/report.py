"""Plain-data results of one engine step: copies, never live tensors, safe to hand to any thread."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RunningRequestReport:
    """One request that took part in a step.

    Attributes:
        request_id, slot: who and where (slot None with paged KV).
        cache_len: tokens in its slot after the step (tokens).
        query_tokens: tokens it fed this step (prompt chunk, or 1 when decoding).
        new_token_id: the token sampled this step, or None while a chunked prefill is unfinished.
        phase: "prefill" or "decode".
        top2_gap: top-1 minus top-2 logit of the sampled position (None without a sample); a small
            gap marks a near tie that numerical batch variance may flip.
        nonfinite: the logits held NaN or inf.
        ttft_s: time to first token (seconds) when this step sampled its first token, else None.
        logprobs: when the request asked for them (SamplingParams.logprobs), (token id, logprob) pairs:
            the sampled token first, then the k most likely tokens in descending order; natural logs of
            log_softmax over the float32 logits. None otherwise.
    """

    request_id: str
    slot: int | None
    cache_len: int
    query_tokens: int
    new_token_id: int | None
    phase: str
    top2_gap: float | None = None
    nonfinite: bool = False
    ttft_s: float | None = None
    blocks: tuple[int, ...] | None = None
    logprobs: tuple[tuple[int, float], ...] | None = None


@dataclass(frozen=True)
class ReusedBlockReport:
    """One block a prefix-cache hit handed to a request, and where its contents came from.

    Attributes:
        index: its place in the reader's block table; block: the block id; tokens: tokens reused.
        writer, writer_tenant, writer_salt: the request that computed the block, its tenant, a
            digest of its cache_salt (None: no salt).
        writer_key, reader_key: content keys (hex: tokens chained to the whole prefix, no salt, no
            fault) of the block's contents and of what the reader would have computed there. A sound
            reuse has equal keys and the reader's own salt.
    """

    index: int
    block: int
    tokens: int
    writer: str
    writer_tenant: str | None
    writer_salt: str | None
    writer_key: str
    reader_key: str


@dataclass(frozen=True)
class PrefixHitReport:
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
    blocks: tuple[ReusedBlockReport, ...]


@dataclass(frozen=True)
class FinishedRequestReport:
    """A request that left the engine during the step (finished, aborted, rejected or failed); the
    engine forgets it once this report is out.

    Attributes (besides the timestamps of RequestState, seconds on the engine clock):
        finish_reason, detail: a FinishReason value and one line on why; code: a FinishCode value for a
            rejection or an error, else "".
        stop_str, text_end: the stop string that ended it and how many characters of the decoded
            output to return (None: all).
        top2_gaps: top-1 minus top-2 logit at each generated token.
        sampling: its SamplingParams.
        faults: the faults active in any step it took part in.
        draws: sampling requests: the Draw of each generated token (uniform and the CDF around it);
            empty when greedy.
    """

    request_id: str
    finish_reason: str
    detail: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    slot: int | None
    arrival_s: float | None
    scheduled_s: float | None
    first_token_s: float | None
    finish_s: float | None
    token_times_s: tuple[float, ...]
    metadata: dict = field(default_factory=dict)
    stop_str: str | None = None
    text_end: int | None = None
    top2_gaps: tuple[float, ...] = ()
    sampling: object = None
    faults: frozenset = frozenset()
    tenant: str | None = None
    code: str = ""
    draws: tuple = ()


@dataclass(frozen=True)
class StepReport:
    """What one `Engine.step()` did.

    Attributes:
        step: step index (0-based).
        start_s, end_s: engine clock at the start and end of the step (seconds; modeled on the
            virtual clock, measured on the wall clock).
        wall_s: measured wall time of the step (seconds).
        layout: "padded" or "packed".
        rows: rows of the model input (requests in padded layout, 1 in packed, 0 when idle).
        prefill_tokens, decode_tokens: real tokens fed (tokens).
        query_positions: positions computed on the query side, pads included (rows x query length).
        padded_positions: query positions that were padding (tokens).
        padding_ratio: padded_positions / query_positions (query side; 0 when idle).
        key_positions, key_padded_positions, key_padding_ratio: the same on the key side (mask cells
            per query row that hold no key of the row's own request).
        slots_used, num_slots, slot_occupancy: slots owned after the step and their share.
        kv_tokens, kv_capacity_tokens, kv_usage: cached tokens after the step, pool capacity, share.
        running: RunningRequestReport per request in the step.
        finished: FinishedRequestReport per request that left during the step.
        num_waiting: requests queued after the step.
        faults: isolation faults active in the step.
        taint: TaintReport per request that could read cache positions it does not own (slot_taint on).
        flow: FlowReport per request (attention_flow on).
        nonfinite: NonfiniteRead per request whose logits were not finite (slot_taint or attention_flow
            on): who wrote the non-finite K/V it could read.
        errors: (request_id, error text) for requests whose forward raised under a fault.
        stale_starts: (request_id, slot, previous owner, tokens kept) for slots reused stale.
        kv: "slots" or "paged". The rest is paged KV only (zero, None or empty with slots):
        num_blocks, blocks_used: usable blocks (the null block excluded) and those in use.
        kv_cache_usage_perc: blocks_used / num_blocks (vLLM's metric; cached free blocks are free).
        num_preemptions: requests preempted this step (preempted: their ids).
        prefix_cache_queries, prefix_cache_hits: tokens looked up / found in the prefix cache this step;
        prefix_cache_cross_tenant_hits: of the hits, tokens of blocks another tenant computed.
        prefix_hits: PrefixHitReport per request admitted with a cache hit this step.
        block_state: one character per block (BlockManager.state: `_` null, `.` free, `c` cached
            free, digits: reference count); block_tables: (request id, block table) per running request.
    """

    step: int
    start_s: float
    end_s: float
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
    running: tuple[RunningRequestReport, ...]
    finished: tuple[FinishedRequestReport, ...]
    num_waiting: int
    faults: tuple[str, ...] = ()
    taint: tuple = ()
    flow: tuple = ()
    nonfinite: tuple = ()
    errors: tuple[tuple[str, str], ...] = ()
    stale_starts: tuple[tuple[str, int, str | None, int], ...] = ()
    kv: str = "slots"
    num_blocks: int = 0
    blocks_used: int = 0
    kv_cache_usage_perc: float | None = None
    num_preemptions: int = 0
    preempted: tuple[str, ...] = ()
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_cross_tenant_hits: int = 0
    prefix_hits: tuple[PrefixHitReport, ...] = ()
    block_state: str | None = None
    block_tables: tuple[tuple[str, tuple[int, ...]], ...] = ()

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens
