"""What the dashboard shows of a target server, folded from a target run's events (live or replayed).

The engine panels of a local run (slot map, KV usage, tokens/s from steps) need engine internals a
server does not show. For a target they show what the server exposes instead (ServerSample events):
llama.cpp's `/slots` for the slot map, `vllm:kv_cache_usage_perc` (or SGLang's `sglang:token_usage`) for
KV usage, the server's running/waiting gauges, and prompt/generation tokens per second from its token
counters. Plain Python, no Textual: kvtui.tui's state holds a ServerTrack, its snapshots a ServerView.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvtui.events import ServerSample, SlotState

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


def _counter(sample: ServerSample, names: tuple[str, ...]) -> float | None:
    return next((sample.metrics[n] for n in names if n in sample.metrics), None)


class ServerTrack:
    """Folds ServerSample events (any others are ignored) into the latest ServerView."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.last: ServerSample | None = None
        self.samples = 0
        self.kv_history: deque = deque(maxlen=HISTORY_LEN)
        self.generation_history: deque = deque(maxlen=HISTORY_LEN)
        self.rates: tuple[float | None, float | None] = (None, None)

    def apply(self, event) -> None:
        if not isinstance(event, ServerSample):
            return
        previous, self.last = self.last, event
        self.samples += 1
        if event.kv_usage is not None:
            self.kv_history.append(event.kv_usage)
        if previous is not None and event.t > previous.t:
            self.rates = tuple(self._rate(previous, event, names) for names in (PROMPT_COUNTERS, GENERATION_COUNTERS))
            if self.rates[1] is not None:
                self.generation_history.append(self.rates[1])

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
            kv_usage=last.kv_usage if last else None, kv_history=tuple(self.kv_history),
            prompt_rate=self.rates[0], generation_rate=self.rates[1],
            generation_history=tuple(self.generation_history), metric_count=len(last.metrics) if last else 0)
