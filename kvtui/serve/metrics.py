"""`/metrics`: Prometheus text with vLLM's metric names, types and buckets, fed by the session's events.

Each server has its own CollectorRegistry (several can run in one process, as tests do). Labels are
vLLM's `model_name` and `engine` ("0": one engine). Names and buckets as vLLM's v1 Prometheus logger
(vllm/v1/metrics/loggers.py); `vllm:request_time_per_output_token_seconds` is vLLM's current name
for the per-request TPOT histogram (its older `vllm:time_per_output_token_seconds` was the ITL,
renamed `vllm:inter_token_latency_seconds`).

Token counts follow vLLM's v1 IterationStats: `vllm:prompt_tokens` adds a sequence's prompt length when it
samples its first token, whether the prompt was computed, taken from the prefix cache or shared from a
sibling (n > 1: each of the n sequences counts it, as vLLM's n child requests do; a preempted sequence
that prefills again does not count it twice); `vllm:generation_tokens` counts sampled tokens.

Timing: latencies are seconds on the engine's wall clock, from a request's arrival at the server to
its first token (TTFT), between its tokens (ITL), over its output tokens after the first (TPOT:
(last - first) / (n - 1)) and to its finish (E2E); queue time is arrival to admission into a slot.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvtui.events import Arrive, Contamination, Finish, FirstToken, RecordingFailed, StepEvent

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")  # error: the request alone failed in the engine
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServeMetrics:
    """The server's Prometheus metrics; `on_event` is a session listener (engine thread), `render`
    is called by `/metrics` (HTTP thread); prometheus_client's metrics are thread-safe.

    Args:
        model_name: the served model name (label `model_name`).
        block_size, prefix_caching: the engine's KV block size (tokens; None: slot KV, which has no blocks)
            and whether it caches prefixes, published as vLLM does in `vllm:cache_config_info`'s labels
            (without `block_size` under slot KV: a slot is no block a client could size anything to).
    """

    def __init__(self, model_name: str, *, block_size: int | None = None, prefix_caching: bool = False) -> None:
        disable_created_metrics()  # no `*_created` series, as vLLM (a process-wide switch of prometheus_client)
        self.registry = CollectorRegistry()
        labels, values = ("model_name", "engine"), (model_name, "0")
        self.model_name = model_name
        self._prompt_len: dict[str, int] = {}  # sequences arrived and not yet counted -> prompt length

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=self.registry).labels(*values)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=self.registry).labels(*values)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(*values)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          labels + ("finished_reason",), registry=self.registry)
        self.success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             TOKEN_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", TOKEN_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", REQUEST_BUCKETS)
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                      "queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.external_queries = counter("vllm:external_prefix_cache_queries", "External prefix cache queries from "
                                        "KV connector cross-instance cache sharing, in terms of number of queried "
                                        "tokens (kvtui: its KV offload tier).")
        self.external_hits = counter("vllm:external_prefix_cache_hits", "External prefix cache hits from KV "
                                     "connector cross-instance cache sharing, in terms of number of cached tokens "
                                     "(kvtui: its KV offload tier).")
        self.offload_stores = counter("kvtui:kv_offload_stores", "KV blocks evicted from the pool and stored in "
                                      "the offload tier.")
        self.offload_bytes = gauge("kvtui:kv_offload_bytes", "K/V bytes the KV offload tier holds.")
        info = {"block_size": str(block_size)} if block_size else {}
        info["enable_prefix_caching"] = str(bool(prefix_caching))
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info),
              registry=self.registry).labels(**info).set(1)
        self.contamination = Counter("kvtui:contamination_events", "Contamination events reported by kvtui's "
                                     "detectors (kind numeric is a near tie, not contamination).",
                                     ("model_name", "kind", "detector"), registry=self.registry)
        self.engine_step = counter("kvtui:engine_step_seconds", "Wall seconds the engine thread spent in steps "
                                   "(scheduling, the forward, sampling, detectors, events), idle waits excluded.")
        self.engine_wait = counter("kvtui:engine_step_wait_seconds", "Of kvtui:engine_step_seconds, the part the "
                                   "engine thread was off the CPU: waiting for the GIL (the HTTP event loop) or "
                                   "preempted by other processes (wall minus the thread's CPU time).")
        self.recording_errors = Counter("kvtui:recording_errors", "Recordings (--record) stopped by a failed write "
                                        "(disk full, I/O error); serving went on.", ("model_name",),
                                        registry=self.registry).labels(model_name)

    def on_event(self, event) -> None:
        """Fold one session event into the metrics (engine thread)."""
        if isinstance(event, StepEvent):
            self.running.set(event.num_running)
            self.waiting.set(event.num_waiting)
            self.kv_usage.set(event.kv_usage)
            self.generation_tokens.inc(sum(1 for r in event.running if r.token_id is not None))
            self.prefix_queries.inc(event.prefix_cache_queries or 0)
            self.prefix_hits.inc(event.prefix_cache_hits or 0)
            if event.kv_offload_capacity is not None:
                self._offload(event)
        elif isinstance(event, Arrive):
            self._prompt_len[event.request_id] = event.prompt_len
        elif isinstance(event, FirstToken):
            self.prompt_tokens.inc(self._prompt_len.pop(event.request_id, 0))
            if event.ttft_s is not None:
                self.ttft.observe(event.ttft_s)
        elif isinstance(event, Finish):
            self._finish(event)
        elif isinstance(event, Contamination):
            self.contamination.labels(self.model_name, event.kind, event.detector).inc()
        elif isinstance(event, RecordingFailed):
            self.recording_errors.inc()

    def _offload(self, event: StepEvent) -> None:
        self.external_queries.inc(event.kv_offload_queries)
        self.external_hits.inc(event.kv_offload_hits)
        self.offload_stores.inc(event.kv_offload_stores)
        self.offload_bytes.set(event.kv_offload_bytes)

    def on_engine_step(self, wall_s: float, cpu_s: float) -> None:
        """One pass of the engine thread that ran a step: its wall and thread CPU seconds."""
        self.engine_step.inc(wall_s)
        self.engine_wait.inc(max(0.0, wall_s - cpu_s))

    def _finish(self, e: Finish) -> None:
        self._prompt_len.pop(e.request_id, None)  # one that never sampled a token counts no prompt
        if e.finish_reason == "rejected":
            return
        self.success[e.finish_reason].inc()
        if not e.completed:
            return
        times = e.token_times_s
        for a, b in zip(times, times[1:]):
            self.itl.observe(b - a)
        if len(times) > 1:
            self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))
        if e.finish_s is not None and e.arrival_s is not None:
            self.e2e.observe(e.finish_s - e.arrival_s)
        if e.scheduled_s is not None and e.arrival_s is not None:
            self.queue.observe(e.scheduled_s - e.arrival_s)

    def render(self) -> bytes:
        """The Prometheus text exposition of this server's registry."""
        return generate_latest(self.registry)
