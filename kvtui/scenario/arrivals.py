"""Arrival processes: when requests arrive (seconds from the scenario start).

YAML `arrivals:` takes one of
  - `{process: constant, rate_per_s}`: evenly spaced, gap 1/rate.
  - `{process: poisson, rate_per_s}`: exponential gaps, mean 1/rate.
  - `{process: gamma, rate_per_s, burstiness}`: gamma gaps with shape = burstiness and
    scale = 1 / (rate * burstiness), exactly as vLLM's `benchmarks/benchmark_serving.py`
    (`--burstiness`): the mean gap stays 1/rate; burstiness 1 is Poisson, below 1 burstier, above 1
    more regular. The gaps' coefficient of variation is 1/sqrt(burstiness).
  - `{process: burst, size, every_s}`: `size` requests at once every `every_s` seconds.
  - `{process: trace, file, format, hash_block_size, time_scale}`: times (and lengths, and Mooncake's
    shared prefixes) from a trace file: kvtui's CSV, Mooncake JSONL, BurstGPT or Azure CSV (see trace.py);
    arrival = (timestamp - first timestamp) * time_scale, so 0.5 replays twice as fast.
  - `{process: scripted, requests: [{at_s, prompt, max_new_tokens}]}`: an explicit list.
  - `{process: rounds, rounds: [{size, count}]}`: closed-loop rounds: a round's `size` requests arrive
    together once every request of the rounds before has finished (fill a cache one request at a
    time, then send rounds of concurrent ones).
constant/poisson/gamma take `stages: [{rate_per_s, duration_s}]` instead of `rate_per_s` for ramps:
a piecewise rate; arrivals stop when the last stage ends.

As in vLLM's benchmark, the first request arrives at once (t = 0, or the start of the first stage with
a positive rate) and each later one one gap after the previous. At a rate change the pending gap is
dropped and a new one drawn from the change (exact for Poisson, which is memoryless).
The generators here are pure: same inputs and `random.Random` state, same times.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Literal, Union

import pydantic
from pydantic import Field

from kvtui.scenario.base import MAX_PLANNED, MAX_PROMPT_CHARS, MAX_RATE, MAX_SECONDS, Strict
from kvtui.scenario.errors import Problem
from kvtui.scenario.trace import MAX_TRACE_BYTES, MOONCAKE_BLOCK_TOKENS, TraceRow, read_trace

Rate = Annotated[float, Field(ge=0, le=MAX_RATE)]
Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS)]


class Stage(Strict):
    """One stretch of a piecewise-constant rate (a ramp is several stages)."""

    rate_per_s: Rate = Field(description="requests per second during this stage; 0 is a pause")
    duration_s: Annotated[float, Field(gt=0, le=MAX_SECONDS)] = Field(description="length of the stage (seconds)")


class _RateProcess(Strict):
    rate_per_s: Annotated[float, Field(gt=0, le=MAX_RATE)] | None = Field(
        None, description="mean requests per second; give this or `stages`, not both")
    stages: Annotated[list[Stage], Field(min_length=1, max_length=1000)] | None = Field(
        None, description="a piecewise rate, `[{rate_per_s, duration_s}, ...]` (see Stage); arrivals stop when "
                          "the last stage ends")

    @pydantic.model_validator(mode="after")
    def _rate_or_stages(self):
        if (self.rate_per_s is None) == (self.stages is None):
            fix = "give `rate_per_s: 2.0` or `stages: [{rate_per_s: 1.0, duration_s: 10}, ...]`, not both"
            raise Problem("needs exactly one of rate_per_s or stages", fix)
        if self.stages and sum(s.rate_per_s * s.duration_s for s in self.stages) > MAX_PLANNED:
            raise Problem(f"stages plan over {MAX_PLANNED} requests", "lower the rates or durations", ("stages",))
        return self


class Constant(_RateProcess):
    """Evenly spaced arrivals: one every 1 / rate_per_s seconds, the first at 0."""

    process: Literal["constant"]


class Poisson(_RateProcess):
    """A Poisson process: exponentially distributed gaps with mean 1 / rate_per_s, the first arrival at
    0. Arrivals are independent of each other, as from many users who do not coordinate."""

    process: Literal["poisson"]


class Gamma(_RateProcess):
    """Gamma-distributed gaps, as vLLM's serving benchmark draws them (its `--burstiness` option): shape
    = burstiness and scale = 1 / (rate_per_s x burstiness), so the mean gap stays 1 / rate_per_s
    whatever the burstiness. burstiness 1 is exactly Poisson; below 1 the gaps vary more (bursts of
    close arrivals, then lulls); above 1 they are more regular, tending to constant. The gaps'
    coefficient of variation is 1 / sqrt(burstiness). The first arrival is at 0."""

    process: Literal["gamma"]
    burstiness: Annotated[float, Field(gt=0, le=1000)] = Field(
        1.0, description="gamma shape: 1 = Poisson, below 1 burstier, above 1 more regular")


class Burst(Strict):
    """`size` requests at once at 0, every_s, 2 x every_s, ..."""

    process: Literal["burst"]
    size: Annotated[int, Field(ge=1, le=10_000)] = Field(description="requests per burst")
    every_s: Annotated[float, Field(gt=0, le=MAX_SECONDS)] = Field(description="seconds between bursts")


class Trace(Strict):
    """Arrival times and lengths from a trace file. `format: csv` (kvtui's own): rows
    `timestamp,prompt_tokens,output_tokens` (seconds, tokens, tokens); a header naming the three columns (in
    any order) is optional; blank lines and lines starting with `#` are skipped. `format: mooncake`: JSON
    Lines `{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}`, each hash id
    one block of `hash_block_size` prompt tokens (Mooncake's traces: 512), so requests whose hash_ids start
    alike share that prompt prefix. `format: burstgpt`: BurstGPT's CSV (`Timestamp` seconds, `Request
    tokens`, `Response tokens`; rows with 0 response tokens, its failed requests, are left out). `format:
    azure`: the Azure LLM inference trace's CSV (`TIMESTAMP` a UTC date and time, `ContextTokens`,
    `GeneratedTokens`). Timestamps may be absolute or relative and must not decrease; request i arrives at
    (timestamp_i - first timestamp) x time_scale. A row's prompt length sets the length of the prompt
    (synthetic and trace_passphrase prompts), its output length the request's max new tokens."""

    process: Literal["trace"]
    file: Annotated[str, Field(min_length=1, max_length=4096)] = Field(
        description=f"trace path, relative to the scenario file; a csv file at most {MAX_TRACE_BYTES >> 20} MiB "
                    f"and {MAX_PLANNED} rows; of the other formats the first {MAX_PLANNED} rows are read")
    format: Literal["csv", "mooncake", "burstgpt", "azure"] = Field(
        "csv", description="the file's layout: `csv` (timestamp,prompt_tokens,output_tokens), `mooncake` (JSON "
                           "Lines with hash_ids), `burstgpt` or `azure` (their published CSVs)")
    hash_block_size: Annotated[int, Field(ge=1, le=100_000)] = Field(
        MOONCAKE_BLOCK_TOKENS, description="prompt tokens per hash id (mooncake; Mooncake's traces use 512): "
                                           "the block each hash id stands for")
    time_scale: Annotated[float, Field(gt=0, le=1e6)] = Field(
        1.0, description="multiplies the trace's gaps: 0.5 replays it twice as fast")
    _rows: list[TraceRow] = pydantic.PrivateAttr(default_factory=list)

    @pydantic.model_validator(mode="after")
    def _read(self, info: pydantic.ValidationInfo):
        ctx = info.context or {}
        try:
            self._rows = read_trace(self.file, ctx.get("base_dir"), self.format)
        except Problem as e:
            raise Problem(e.problem, e.fix, ("file",)) from None
        return self

    @property
    def rows(self) -> list[TraceRow]:
        return list(self._rows)


class ScriptedRequest(Strict):
    """One request of a scripted arrival list."""

    at_s: Seconds = Field(description="arrival time (seconds from the start)")
    prompt: Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)] | None = Field(
        None, description="the prompt text; null takes the next prompt of the `prompts` section")
    max_new_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = Field(
        None, description="tokens to generate at most; null draws from `output_tokens`")
    chat: bool = Field(True, description="wrap `prompt` in the model's chat template")
    tenant: Annotated[str, Field(min_length=1, max_length=100)] | None = Field(
        None, description="who sends it (see tenants); null: drawn as the `tenants` section says")


class Scripted(Strict):
    """An explicit list of requests, each with its own arrival time (sorted by at_s)."""

    process: Literal["scripted"]
    requests: Annotated[list[ScriptedRequest], Field(min_length=1, max_length=MAX_PLANNED)] = Field(
        description="`[{at_s, prompt, max_new_tokens, chat}, ...]` (see ScriptedRequest)")


class RoundSpec(Strict):
    """`count` rounds of `size` requests each."""

    size: Annotated[int, Field(ge=1, le=10_000)] = Field(description="requests per round, arriving together")
    count: Annotated[int, Field(ge=1, le=MAX_PLANNED)] = Field(1, description="rounds of this size, one after another")
    cancel: Annotated[int, Field(ge=0, le=10_000)] = Field(
        0, description="requests of each round that the client cancels mid-answer (the round's first ones): "
        "a disconnect, as a user closing the tab, which leaves the server a half-finished answer")
    cancel_after: Annotated[int, Field(ge=1, le=100_000)] = Field(
        3, description="generated tokens after which a cancelled request is cut")

    @pydantic.model_validator(mode="after")
    def _cancel_fits(self):
        if self.cancel > self.size:
            raise Problem(f"cancel {self.cancel} is over the round's size {self.size}", "lower cancel", ("cancel",))
        return self


class Rounds(Strict):
    """Closed-loop rounds: the requests of a round arrive together, at the moment the last request of the
    rounds before it finished (the first round at 0); a round never overlaps the one before. Rounds are
    run in the order listed: `[{size: 1, count: 12}, {size: 2, count: 20}]` sends 12 requests one at a
    time, each once the previous one finished, then 20 rounds of 2 at once. Arrival times therefore
    depend on how fast requests finish (on the engine's clock locally, the wall clock against a
    `--target` server), not on the seed alone. With `cancel: k` the first k requests of each round of
    that entry are cancelled by their client once they have `cancel_after` generated tokens (against a
    server the stream is closed; locally the engine aborts them); they finish `abort`."""

    process: Literal["rounds"]
    rounds: Annotated[list[RoundSpec], Field(min_length=1, max_length=1000)] = Field(
        description="`[{size, count}, ...]` (see RoundSpec), in order")

    @pydantic.model_validator(mode="after")
    def _bounded(self):
        if sum(r.size * r.count for r in self.rounds) > MAX_PLANNED:
            raise Problem(f"rounds plan over {MAX_PLANNED} requests", "lower the sizes or counts", ("rounds",))
        return self


ArrivalSpec = Annotated[Union[Constant, Poisson, Gamma, Burst, Trace, Scripted, Rounds], Field(discriminator="process")]
PROCESS_NAMES = ("constant", "poisson", "gamma", "burst", "trace", "scripted", "rounds")
RATE_PROCESSES = (Constant, Poisson, Gamma)


@dataclass(frozen=True)
class Arrival:
    """One arrival; the optional fields override the scenario's generators for this request."""

    at_s: float  # seconds from the scenario start
    prompt_tokens: int | None = None  # trace: prompt length (tokens)
    output_tokens: int | None = None  # trace / scripted: max new tokens
    prompt: str | None = None  # scripted: prompt text
    chat: bool = True
    tenant: str | None = None  # scripted: its tenant
    round: int | None = None  # rounds: its round (0, 1, ...); it arrives once every earlier round finished
    cancel_after: int | None = None  # rounds' cancel: the client cuts it after this many generated tokens
    hash_ids: tuple[int, ...] | None = None  # mooncake trace: its prompt's block hash ids


@dataclass(frozen=True)
class Segment:
    """A stretch of constant rate: [start_s, end_s), rate_per_s, gamma shape."""

    start_s: float
    end_s: float
    rate_per_s: float
    burstiness: float = 1.0


def segments(spec: Constant | Poisson | Gamma, changes: Sequence[tuple[float, dict]] = ()) -> list[Segment]:
    """Piecewise-constant rate from `stages`, or from `rate_per_s` changed at the times in `changes`
    ((at_s, {"rate_per_s": r, "burstiness": b}) pairs, from the timeline)."""
    shape = getattr(spec, "burstiness", 1.0)
    if spec.stages:
        out, t = [], 0.0
        for stage in spec.stages:
            out.append(Segment(t, t + stage.duration_s, stage.rate_per_s, shape))
            t += stage.duration_s
        return out
    rate, out, start = spec.rate_per_s, [], 0.0
    for at_s, change in sorted(changes, key=lambda c: c[0]):
        if at_s > start:
            out.append(Segment(start, at_s, rate, shape))
            start = at_s
        rate, shape = change.get("rate_per_s", rate), change.get("burstiness", shape)
    return out + [Segment(start, math.inf, rate, shape)]


def gap_s(process: str, seg: Segment, rng: random.Random) -> float:
    """One inter-arrival gap (seconds) at the segment's rate."""
    if process == "constant":
        return 1.0 / seg.rate_per_s
    if process == "poisson":
        return -math.log(1.0 - rng.random()) / seg.rate_per_s
    # vLLM benchmark_serving: np.random.gamma(shape=burstiness, scale=1 / (request_rate * burstiness))
    return rng.gammavariate(seg.burstiness, 1.0 / (seg.rate_per_s * seg.burstiness))


def rate_times(process: str, segs: Sequence[Segment], rng: random.Random) -> Iterator[float]:
    """Arrival times of a constant/poisson/gamma process over piecewise-constant rate segments."""
    first, t = True, 0.0
    for seg in segs:
        if seg.rate_per_s <= 0:
            continue
        if first:
            first, t = False, seg.start_s
            yield t
        else:
            t = max(t, seg.start_s)
        while True:
            nxt = t + gap_s(process, seg, rng)
            if nxt >= seg.end_s:
                t = seg.end_s
                break
            t = nxt
            yield t


def burst_times(size: int, every_s: float) -> Iterator[float]:
    """`size` arrivals at 0, every_s, 2 * every_s, ..."""
    k = 0
    while True:
        for _ in range(size):
            yield k * every_s
        k += 1


def arrivals(spec, rng: random.Random, changes: Sequence[tuple[float, dict]] = ()) -> Iterator[Arrival]:
    """All arrivals of `spec` in time order (possibly endless: the caller stops)."""
    if isinstance(spec, RATE_PROCESSES):
        yield from (Arrival(t) for t in rate_times(spec.process, segments(spec, changes), rng))
    elif isinstance(spec, Burst):
        yield from (Arrival(t) for t in burst_times(spec.size, spec.every_s))
    elif isinstance(spec, Trace):
        t0 = spec.rows[0].timestamp
        for row in spec.rows:
            yield Arrival((row.timestamp - t0) * spec.time_scale, row.prompt_tokens, row.output_tokens,
                          hash_ids=row.hash_ids)
    elif isinstance(spec, Scripted):
        for item in sorted(spec.requests, key=lambda r: r.at_s):
            yield Arrival(item.at_s, None, item.max_new_tokens, item.prompt, item.chat, item.tenant)
    elif isinstance(spec, Rounds):
        k = 0
        for block in spec.rounds:
            for _ in range(block.count):
                yield from (Arrival(0.0, round=k, cancel_after=block.cancel_after if j < block.cancel else None)
                            for j in range(block.size))
                k += 1
    else:
        raise TypeError(f"unknown arrival spec {type(spec).__name__}")
