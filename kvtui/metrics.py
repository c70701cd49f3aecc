"""Serving metrics from step reports and finished requests: throughput windows, latency percentiles,
goodput, padding ratio, slot occupancy, KV usage.

Names follow vLLM's Prometheus metrics where one exists (num_requests_running,
num_requests_waiting, kv_cache_usage_perc, time_to_first_token_seconds, inter_token_latency_seconds,
e2e_request_latency_seconds, request_queue_time_seconds, ...); kvtui's own carry a `kvtui:` prefix.
All times are seconds on the run's clock (virtual or wall, as the recording header says).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field

from kvtui.detect.findings import Findings
from kvtui.events import (
    Arrive,
    Contamination,
    CounterEntry,
    Finish,
    LatencyStats,
    ReferenceStatus,
    ServerSample,
    StepEvent,
    Summary,
    TimelineApplied,
)

PERCENTILES = (50, 90, 95, 99)


# a server's prefix-cache counters (tokens): vLLM's v1 names (vllm/v1/metrics/loggers.py)
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total",)
PREFIX_HITS = ("vllm:prefix_cache_hits_total",)


class ServerPrefixCounters:
    """A target server's cumulative prefix-cache counters (tokens queried, tokens hit), as the run's
    delta: the last sample fed minus the first."""

    def __init__(self) -> None:
        self.first: tuple[float, float] | None = None
        self.last: tuple[float, float] | None = None

    def add(self, metrics: dict[str, float]) -> None:
        """One sample's metrics (name -> value); ignored when the server has no such counters."""
        queries = next((metrics[n] for n in PREFIX_QUERIES if n in metrics), None)
        hits = next((metrics[n] for n in PREFIX_HITS if n in metrics), None)
        if queries is None or hits is None:
            return
        self.last = (queries, hits)
        if self.first is None:
            self.first = self.last

    def fields(self) -> dict:
        """prefix_cache_queries / prefix_cache_hits for the Summary (none without two samples)."""
        if self.first is None or self.last is None:
            return {}
        return dict(prefix_cache_queries=int(self.last[0] - self.first[0]),
                    prefix_cache_hits=int(self.last[1] - self.first[1]))


def percentile(values: list[float], q: float) -> float | None:
    """q-th percentile (0-100) with linear interpolation between closest ranks (numpy's default);
    None for an empty list."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: list[float]) -> LatencyStats:
    """Count, mean, p50, p90, p95, p99 of `values` (seconds; None entries when empty)."""
    return LatencyStats(count=len(values), mean=sum(values) / len(values) if values else None,
                        **{f"p{q}": percentile(values, q) for q in PERCENTILES})


@dataclass
class SlidingRate:
    """Tokens per second over the last `window_s` seconds of (time, count) samples."""

    window_s: float
    samples: deque = field(default_factory=deque)
    total: int = 0

    def add(self, t: float, count: int) -> None:
        self.samples.append((t, count))
        self.total += count
        while self.samples and self.samples[0][0] < t - self.window_s:
            self.total -= self.samples.popleft()[1]

    def rate(self) -> float:
        return self.total / self.window_s


@dataclass
class SLO:
    """Service-level objective for goodput: a request counts when TTFT <= ttft_s and TPOT <= tpot_s."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def met(self, ttft: float | None, tpot: float | None) -> bool:
        if self.ttft_s is not None and (ttft is None or ttft > self.ttft_s):
            return False
        return not (self.tpot_s is not None and tpot is not None and tpot > self.tpot_s)


# the engine's rejection texts, for a Finish event that carries no code (recordings made before codes)
_DETAIL_CODES = (("empty prompt", "empty"), ("waiting queue full", "queue_full"), ("out of vocabulary",
                 "out_of_vocabulary"), ("max_len", "too_long"), ("KV blocks", "too_long"))


def rejection_code(finish: Finish) -> str:
    """Why a request was rejected, as a code: the event's own `code` when it has one, else the code of
    the engine's detail text (`empty`, `too_long`, `queue_full`, `out_of_vocabulary`), else `other`."""
    code = getattr(finish, "code", None)
    if code:
        return code
    return next((c for text, c in _DETAIL_CODES if text in finish.detail), "other")


class LoraCounts:
    """A run's LoRA figures from its events: arrived requests by adapter and version (Arrive.lora,
    lora_version; "none" for the base model) and the timeline's reloads by adapter."""

    def __init__(self) -> None:
        self.requests: Counter = Counter()
        self.reloads: Counter = Counter()
        self.used = False  # some request ran under an adapter

    def arrive(self, e: Arrive) -> None:
        lora = getattr(e, "lora", None)
        if lora is None:
            self.requests["none"] += 1
            return
        self.used = True
        version = getattr(e, "lora_version", None)
        self.requests[lora if version is None else f"{lora}@{version}"] += 1

    def timeline(self, e: TimelineApplied) -> None:
        name = (e.set or {}).get("lora.reload")
        if name:
            self.reloads[name] += 1

    def fields(self) -> dict:
        """Summary's lora_requests and lora_reloads ({} when no request ran under an adapter)."""
        if not self.used and not self.reloads:
            return {}
        return dict(lora_requests=dict(self.requests), lora_reloads=dict(self.reloads))


class Metrics:
    """Accumulates a run's figures from its events; `summary()` gives the final ones.

    Latency statistics (TTFT, TPOT, ITL, E2E, queue time), the prompt and generated token totals (so
    output tokens/s) and the passphrase echo count cover completed requests only (finish reason stop
    or length), as vLLM's `bench serve` counts only successful requests; aborted, rejected and failed
    requests are counted separately in `finish_reasons` (the engine's prefill / decode rates still
    count every token its steps computed).

    A target run (`kvtui run --target`, Finish events with `sent_s`) is timed as vLLM's `bench serve`
    times it (vllm/benchmarks/lib/endpoint_request_func.py, calculate_metrics): TTFT and E2E from the
    request's send time, ITL between streamed chunks, TPOT = (last chunk - first chunk) / (output
    tokens - 1) with the server's token count; queue time is the wait for the client's concurrency cap.
    """

    def __init__(self, slo: SLO | None = None) -> None:
        self.slo = slo or SLO()
        self.prefill_1s, self.decode_1s = SlidingRate(1.0), SlidingRate(1.0)
        self.steps = 0
        self.first_t: float | None = None
        self.last_t = 0.0
        self.prompt_tokens = self.generated_tokens = 0
        self.prefill_tokens = self.decode_tokens = 0
        self.padding_sum = self.key_padding_sum = 0.0
        self.busy_steps = 0  # steps that computed something (padding means are over these)
        self.peak_slot_occupancy = 0.0
        self.peak_kv_usage = 0.0
        self.peak_waiting = 0
        self.last: StepEvent | None = None
        self.contamination: Counter = Counter()  # (kind, detector) -> events
        self.findings = Findings()  # reports joined per victim
        self.arrived = 0
        self.arrived_alone = 0  # arrivals that are a whole request (n = 1)
        self.parents: set[str] = set()  # parallel sampling: the requests whose sequences arrived
        self.reference: ReferenceStatus | None = None
        self.canary_requests = 0
        self.canary_echoed = 0
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.itl: list[float] = []
        self.e2e: list[float] = []
        self.queue: list[float] = []
        self.finish_reasons: Counter = Counter()
        self.rejection_reasons: Counter = Counter()  # rejected requests by code (too_long, queue_full, ...)
        self.requests_finished = 0
        self.good_requests = 0
        self.measured_wall_s = 0.0
        self.paged = False  # paged KV: preemptions and prefix-cache counters (vLLM's names)
        self.num_preemptions = self.prefix_queries = self.prefix_hits = self.cross_tenant_hits = 0
        self.offload_queries = self.offload_hits = self.offload_stores = 0  # the KV offload tier (tokens, blocks)
        self.state: list[int] | None = None  # hybrids: state checkpoints kept, hit tokens, restores (None: no state)
        self.cached_tokens: int | None = None  # target runs: prompt tokens the server reported cached
        self.server_prefix = ServerPrefixCounters()
        self.lora = LoraCounts()

    def add_event(self, event) -> None:
        """Feed one typed event (kvtui.events); live runs and replays feed the same events, so a
        replay reproduces the live summary exactly."""
        if isinstance(event, StepEvent):
            self._add_step(event)
        elif isinstance(event, Finish):
            self._add_finished(event)
        elif isinstance(event, Contamination):
            self.contamination[(event.kind, event.detector)] += 1
            self.findings.add(event)
        elif isinstance(event, Arrive):
            self.arrived += 1
            if event.parent is None:
                self.arrived_alone += 1
            else:
                self.parents.add(event.parent)
            self.lora.arrive(event)
        elif isinstance(event, TimelineApplied):
            self.lora.timeline(event)
        elif isinstance(event, ReferenceStatus):
            self.reference = event
        elif isinstance(event, ServerSample):
            self._add_server_sample(event)

    def _add_server_sample(self, e: ServerSample) -> None:
        """A target server's gauges: its peak KV usage and waiting count stand for the engine's; its
        prefix-cache counters until the reference checks begin (the load's share)."""
        if self.reference is None:
            self.server_prefix.add(e.metrics)
        if e.kv_usage is not None:
            self.peak_kv_usage = max(self.peak_kv_usage, e.kv_usage)
        if e.waiting is not None:
            self.peak_waiting = max(self.peak_waiting, int(e.waiting))

    def _add_step(self, e: StepEvent) -> None:
        if self.first_t is None:
            self.first_t = e.start_s
        self.last_t = max(self.last_t, e.t)
        self.steps += 1
        self.measured_wall_s += e.wall_s
        self.prefill_tokens += e.prefill_tokens
        self.decode_tokens += e.decode_tokens
        self.prefill_1s.add(e.t, e.prefill_tokens)
        self.decode_1s.add(e.t, e.decode_tokens)
        if e.rows:
            self.busy_steps += 1
            self.padding_sum += e.padding_ratio
            self.key_padding_sum += e.key_padding_ratio
        self.peak_slot_occupancy = max(self.peak_slot_occupancy, e.occupancy)
        self.peak_kv_usage = max(self.peak_kv_usage, e.kv_usage)
        self.peak_waiting = max(self.peak_waiting, e.num_waiting)
        self.last = e
        if e.kv == "paged":
            self._add_paged(e)
        if e.num_state_slots is not None:
            counts = (e.state_checkpoints or 0, e.state_checkpoint_hits or 0, e.state_restores or 0)
            self.state = [a + b for a, b in zip(self.state or [0, 0, 0], counts)]

    def _add_paged(self, e: StepEvent) -> None:
        self.paged = True
        self.num_preemptions += e.num_preemptions or 0
        self.prefix_queries += e.prefix_cache_queries or 0
        self.prefix_hits += e.prefix_cache_hits or 0
        self.cross_tenant_hits += e.prefix_cache_cross_tenant_hits or 0
        if e.kv_offload_capacity is not None:
            self.offload_queries += e.kv_offload_queries
            self.offload_hits += e.kv_offload_hits
            self.offload_stores += e.kv_offload_stores

    def encoder_fields(self) -> dict:
        """Summary fields of the encoder cache, from the last step (its counts run since the engine started);
        {} for a model without one."""
        e = self.last
        if e is None or e.encoder_hits is None:
            return {}
        return dict(encoder_cache_hits=e.encoder_hits, encoder_cache_misses=e.encoder_misses,
                    encoder_cache_entries=e.encoder_entries, encoder_cache_bytes=e.encoder_bytes)

    def state_fields(self) -> dict:
        """Summary fields of a hybrid's recurrent state over the run ({} for a model without one)."""
        if self.state is None:
            return {}
        return dict(zip(("state_checkpoints", "state_checkpoint_hits", "state_restores"), self.state))

    def paged_fields(self) -> dict:
        """Summary fields of paged KV (None when the run used slots, or looked nothing up in the prefix cache)."""
        if not self.paged:
            return {}
        cached = self.prefix_queries > 0
        tier = self.last is not None and self.last.kv_offload_capacity is not None
        offload = dict(kv_offload_queries=self.offload_queries, kv_offload_hits=self.offload_hits,
                       kv_offload_stores=self.offload_stores, kv_offload_bytes=self.last.kv_offload_bytes) if tier else {}
        return dict(**offload, num_preemptions_total=self.num_preemptions,
                    prefix_cache_queries=self.prefix_queries if cached else None,
                    prefix_cache_hits=self.prefix_hits if cached else None,
                    prefix_cache_cross_tenant_hits=self.cross_tenant_hits if cached else None)

    def _add_finished(self, r: Finish) -> None:
        self.requests_finished += 1
        self.finish_reasons[r.finish_reason] += 1
        if r.finish_s is not None:
            self.last_t = max(self.last_t, r.finish_s)
        if r.finish_reason == "rejected":
            self.rejection_reasons[rejection_code(r)] += 1
        if not r.completed:  # rejected, aborted or failed: no answer to count
            return
        if r.cached_tokens is not None:
            self.cached_tokens = (self.cached_tokens or 0) + r.cached_tokens
        self.prompt_tokens += r.prompt_tokens if r.prompt_tokens is not None else len(r.prompt_ids)
        self.generated_tokens += r.completion_tokens if r.completion_tokens is not None else len(r.output_ids)
        if r.passphrase:
            self.canary_requests += 1
            echoed = r.passphrase_echoed  # as the finish event says (a spoken passphrase: words and number)
            self.canary_echoed += int(r.passphrase in r.output_text if echoed is None else echoed)
        self._add_latencies(r)

    def _add_latencies(self, r: Finish) -> None:
        arrival, first, times = r.arrival_s, r.first_token_s, r.token_times_s
        start = r.sent_s if r.sent_s is not None else arrival  # a target's latencies count from the send
        queued_until = r.sent_s if r.sent_s is not None else r.scheduled_s
        ttft = first - start if first is not None and start is not None else None
        tokens = r.completion_tokens if r.completion_tokens is not None else len(times)
        tpot = (times[-1] - times[0]) / (tokens - 1) if len(times) > 1 and tokens > 1 else None
        if ttft is not None:
            self.ttft.append(ttft)
        if tpot is not None:
            self.tpot.append(tpot)
        self.itl.extend(b - a for a, b in zip(times, times[1:]))
        if r.finish_s is not None and start is not None:
            self.e2e.append(r.finish_s - start)
        if queued_until is not None and arrival is not None:
            self.queue.append(queued_until - arrival)
        if ttft is not None and self.slo.met(ttft, tpot):
            self.good_requests += 1

    @property
    def duration_s(self) -> float:
        return max(self.last_t - (self.first_t or 0.0), 1e-9)

    @property
    def requests_completed(self) -> int:
        return self.finish_reasons.get("stop", 0) + self.finish_reasons.get("length", 0)

    def summary(self, t: float | None = None, **session_fields) -> Summary:
        """Final figures of the run; `session_fields` are the Summary fields only the session knows
        (stopped_early, faults_active_at_end, ...)."""
        d = self.duration_s
        busy = max(self.busy_steps, 1)
        return Summary(
            t=self.last_t if t is None else t, duration_s=d, steps=self.steps,
            measured_step_wall_s=self.measured_wall_s, requests_finished=self.requests_finished,
            requests_completed=self.requests_completed, finish_reasons=dict(self.finish_reasons),
            rejections=self.finish_reasons.get("rejected", 0), rejection_reasons=dict(self.rejection_reasons) or None,
            prompt_tokens=self.prompt_tokens,
            generated_tokens=self.generated_tokens, prefill_tokens_per_s=self.prefill_tokens / d,
            decode_tokens_per_s=self.decode_tokens / d, output_tokens_per_s=self.generated_tokens / d,
            request_throughput_per_s=self.requests_completed / d, goodput_requests_per_s=self.good_requests / d,
            time_to_first_token_seconds=summarize(self.ttft), time_per_output_token_seconds=summarize(self.tpot),
            inter_token_latency_seconds=summarize(self.itl), e2e_request_latency_seconds=summarize(self.e2e),
            request_queue_time_seconds=summarize(self.queue), padding_ratio_mean=self.padding_sum / busy,
            key_padding_ratio_mean=self.key_padding_sum / busy, slot_occupancy_peak=self.peak_slot_occupancy,
            kv_cache_usage_perc_peak=self.peak_kv_usage, num_requests_waiting_peak=self.peak_waiting,
            passphrase_requests=self.canary_requests, passphrase_echoed=self.canary_echoed,
            contamination_events_total=tuple(
                CounterEntry(kind=kind, detector=detector, value=n)
                for (kind, detector), n in sorted(self.contamination.items())),
            findings_by_kind=self.findings.by_kind(), requests_in_flight=self.arrived - self.requests_finished,
            requests_submitted=self.arrived_alone + len(self.parents) if self.parents else None,
            reference_checked=self.reference.checked if self.reference else None,
            reference_skipped=self.reference.skipped if self.reference else None,
            reference_cached=self.reference.cached if self.reference else None,
            reference_uncached_verified=self.reference.uncached_verified if self.reference else None,
            reference_skipped_by_reason=self.reference.skipped_by_reason if self.reference else None,
            prompt_tokens_cached=self.cached_tokens, **self.paged_fields(), **self.server_prefix.fields(),
            **self.encoder_fields(), **self.state_fields(), **self.lora.fields(),
            **session_fields,
        )
