"""What the dashboard shows of a target server, folded from a target run's events (live or replayed).

The engine panels of a local run (slot map, KV usage, tokens/s from steps) need engine internals a
server does not show. For a target they show what the server exposes instead (ServerSample events):
llama.cpp's `/slots` for the slot map, `vllm:kv_cache_usage_perc` (or SGLang's `sglang:token_usage`) for
KV usage, the server's running/waiting gauges, and prompt/generation tokens per second from its token
counters, and its prefix cache: vLLM's `vllm:prefix_cache_queries` / `_hits` counters since the run's
first sample (SGLang's `sglang:cache_hit_rate`), the cached prompt tokens each response reported in its usage,
speculative decoding's acceptance (vLLM's accepted / drafted token counters, SGLang's
`sglang:spec_accept_length`), and a history of each, as the terminal monitors of these servers show them
(llama.cpp's KV usage as `llamacpp:kv_cache_usage_ratio`). Plain Python, no Textual: the dashboard's state
(state.py) holds a ServerTrack, its snapshots a ServerView.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvtui.events import Finish, LoadFidelity, ServerSample, SlotState, Summary
from kvtui.metrics import PREFIX_HITS, PREFIX_QUERIES

# the monitors' figures under each server's names (vLLM, SGLang, llama.cpp), the first one present wins
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage", "llamacpp:kv_cache_usage_ratio")
HIT_RATE = ("sglang:cache_hit_rate",)  # a gauge (0-1); vLLM's comes from its prefix-cache counters
SPEC_ACCEPTED = ("vllm:spec_decode_num_accepted_tokens_total",  # over the drafted tokens: the acceptance rate
                 "llamacpp:spec_decode_num_accepted_tokens_total")
SPEC_DRAFTED = ("vllm:spec_decode_num_draft_tokens_total", "llamacpp:spec_decode_num_draft_tokens_total")
# llama.cpp: prompt tokens taken from its cache, and those it computed (its prompt_tokens_total leaves them out)
CACHED_PROMPT, COMPUTED_PROMPT = ("llamacpp:prompt_tokens_cached_total",), ("llamacpp:prompt_tokens_total",)
SPEC_LENGTH = ("sglang:spec_accept_length",)  # SGLang: mean tokens accepted per step (a gauge)
KINDS = {"vllm:": "vLLM", "sglang:": "SGLang", "llamacpp:": "llama.cpp", "tgi_": "TGI"}
PROMPT_COUNTERS = ("vllm:prompt_tokens_total", "llamacpp:prompt_tokens_total", "sglang:prompt_tokens_total")
GENERATION_COUNTERS = ("vllm:generation_tokens_total", "llamacpp:tokens_predicted_total",
                       "sglang:generation_tokens_total")
HISTORY_LEN = 240  # samples kept for the sparklines


@dataclass(frozen=True)
class ServerView:
    """The server panels' content at one moment.

    Attributes:
        url: the target.
        samples: ServerSample events seen (0: the server has shown nothing, yet or at all).
        slots: llama.cpp's slots (None: the server exposes none).
        slot_colors: palette index per slot (-1: idle or not attributed).
        running, waiting: the server's request gauges (None: not exposed).
        kv_usage: fraction of the server's KV cache in use (None: not exposed); kv_history: per sample.
        prompt_rate, generation_rate: tokens/s from the server's token counters over the last two samples
            (None: no such counters); generation_history: per sample.
        metric_count: how many gauges and counters the last /metrics gave.
        prefix_queries, prefix_hits: prompt tokens the server looked up in / found in its prefix cache
            since the run's first sample (its counters; None: not exposed).
        cached_tokens: prompt tokens the finished requests' responses said came from the server's cache,
            of `prompt_tokens` (None: no response said).
        fidelity: how faithfully the client kept the schedule, the last LoadFidelity (None: none yet, or a
            recording made before kvtui measured it).
        kind: the server by its metric names (vLLM, SGLang, llama.cpp, TGI), None before /metrics answered.
        hit_rate: prefix-cache hit rate (0-1): vLLM's counters since the run's first sample, or SGLang's
            sglang:cache_hit_rate; None: not exposed. spec: speculative decoding, (value, unit): vLLM's
            accepted / drafted tokens since the first sample ("accepted", 0-1), or SGLang's mean accept length
            ("tokens/step"); None: not exposed, or nothing drafted yet (spec_exposed: the server has the counters).
            llama.cpp's hit rate: its cached prompt tokens over all its prompt tokens since the first sample.
        running_history, waiting_history, hit_history, spec_history: one value per sample that had it.
    """

    url: str
    samples: int
    slots: tuple[SlotState, ...] | None
    slot_colors: tuple[int, ...]
    running: float | None
    waiting: float | None
    kv_usage: float | None
    kv_history: tuple[float, ...]
    prompt_rate: float | None
    generation_rate: float | None
    generation_history: tuple[float, ...]
    metric_count: int
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    cached_tokens: int | None = None
    prompt_tokens: int = 0
    fidelity: LoadFidelity | None = None
    kind: str | None = None
    hit_rate: float | None = None
    spec: tuple[float, str] | None = None
    spec_exposed: bool = False
    running_history: tuple[float, ...] = ()
    waiting_history: tuple[float, ...] = ()
    hit_history: tuple[float, ...] = ()
    spec_history: tuple[float, ...] = ()


def _counter(sample: ServerSample, names: tuple[str, ...]) -> float | None:
    return next((sample.metrics[n] for n in names if n in sample.metrics), None)


class ServerTrack:
    """Folds ServerSample events, the cached tokens of Finish events and the client's LoadFidelity
    (others are ignored) into the latest ServerView."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.last: ServerSample | None = None
        self.samples = 0
        self.kv_history: deque = deque(maxlen=HISTORY_LEN)
        self.generation_history: deque = deque(maxlen=HISTORY_LEN)
        self.rates: tuple[float | None, float | None] = (None, None)
        self.first_prefix: tuple[float, float] | None = None
        self.prefix: tuple[float, float] | None = None
        self.cached_tokens: int | None = None
        self.prompt_tokens = 0
        self.fidelity: LoadFidelity | None = None
        self.kind: str | None = None
        self.kv_usage: float | None = None
        self.hit_rate: float | None = None
        self.spec: tuple[float, str] | None = None
        self.first_spec: tuple[float, float] | None = None
        self.first_cached: tuple[float, float] | None = None
        self.spec_exposed = False
        self.histories = {name: deque(maxlen=HISTORY_LEN) for name in ("running", "waiting", "hit", "spec")}

    def apply(self, event) -> None:
        if isinstance(event, Finish):
            self._finished(event)
        if isinstance(event, LoadFidelity):
            self.fidelity = event
        if isinstance(event, Summary) and event.load_fidelity is not None:
            self.fidelity = event.load_fidelity
        if not isinstance(event, ServerSample):
            return
        queries, hits = _counter(event, PREFIX_QUERIES), _counter(event, PREFIX_HITS)
        if queries is not None and hits is not None:
            self.prefix = (queries, hits)
            self.first_prefix = self.first_prefix or self.prefix
        previous, self.last = self.last, event
        self.samples += 1
        self._monitor(event)
        if self.kv_usage is not None:
            self.kv_history.append(self.kv_usage)
        if previous is not None and event.t > previous.t:
            self.rates = tuple(self._rate(previous, event, names) for names in (PROMPT_COUNTERS, GENERATION_COUNTERS))
            if self.rates[1] is not None:
                self.generation_history.append(self.rates[1])

    def _monitor(self, e: ServerSample) -> None:
        """The monitors' figures of one sample under whichever server's names it has, and their histories."""
        self.kind = next((kind for prefix, kind in KINDS.items() if any(n.startswith(prefix) for n in e.metrics)),
                         self.kind)
        self.kv_usage = _counter(e, KV_USAGE) if e.kv_usage is None else e.kv_usage
        if self.prefix is not None and self.first_prefix is not None:
            queries, hits = self.prefix[0] - self.first_prefix[0], self.prefix[1] - self.first_prefix[1]
            self.hit_rate = hits / queries if queries > 0 else self.hit_rate
        elif (cached := _counter(e, CACHED_PROMPT)) is not None and (computed := _counter(e, COMPUTED_PROMPT)) is not None:
            self.first_cached = self.first_cached or (cached, computed)
            hit, asked = cached - self.first_cached[0], cached - self.first_cached[0] + computed - self.first_cached[1]
            self.hit_rate = hit / asked if asked > 0 else self.hit_rate
        else:
            self.hit_rate = _counter(e, HIT_RATE)
        accepted, drafted = _counter(e, SPEC_ACCEPTED), _counter(e, SPEC_DRAFTED)
        self.spec_exposed = self.spec_exposed or accepted is not None or _counter(e, SPEC_LENGTH) is not None
        if accepted is not None and drafted is not None:
            self.first_spec = self.first_spec or (accepted, drafted)
            done = drafted - self.first_spec[1]
            self.spec = ((accepted - self.first_spec[0]) / done, "accepted") if done > 0 else self.spec
        elif (length := _counter(e, SPEC_LENGTH)) is not None:
            self.spec = (length, "tokens/step")
        for name, value in (("running", e.running), ("waiting", e.waiting), ("hit", self.hit_rate),
                            ("spec", self.spec[0] if self.spec else None)):
            if value is not None:
                self.histories[name].append(value)

    def _finished(self, e: Finish) -> None:
        if e.cached_tokens is not None:
            self.cached_tokens = (self.cached_tokens or 0) + e.cached_tokens
            self.prompt_tokens += e.prompt_tokens if e.prompt_tokens is not None else len(e.prompt_ids)

    @staticmethod
    def _rate(a: ServerSample, b: ServerSample, names: tuple[str, ...]) -> float | None:
        before, after = _counter(a, names), _counter(b, names)
        if before is None or after is None:
            return None
        return max(after - before, 0.0) / (b.t - a.t)

    def view(self, colors: dict[str, int]) -> ServerView:
        """The current view; `colors`: request id -> palette index, for the slots' owners."""
        last = self.last
        slots = last.slots if last is not None else None
        return ServerView(
            url=self.url, samples=self.samples, slots=slots,
            slot_colors=tuple(colors.get(s.request_id, -1) if s.busy and s.request_id else -1 for s in slots or ()),
            running=last.running if last else None, waiting=last.waiting if last else None,
            kv_usage=self.kv_usage, kv_history=tuple(self.kv_history),
            prompt_rate=self.rates[0], generation_rate=self.rates[1],
            generation_history=tuple(self.generation_history), metric_count=len(last.metrics) if last else 0,
            prefix_queries=self.prefix[0] - self.first_prefix[0] if self.prefix else None,
            prefix_hits=self.prefix[1] - self.first_prefix[1] if self.prefix else None,
            cached_tokens=self.cached_tokens, prompt_tokens=self.prompt_tokens, fidelity=self.fidelity,
            kind=self.kind, hit_rate=self.hit_rate, spec=self.spec, spec_exposed=self.spec_exposed,
            **{f"{name}_history": tuple(values) for name, values in self.histories.items()})
