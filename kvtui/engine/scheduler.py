"""Continuous-batching scheduler: admission, batch choice, token budget, chunked prefill.

Pure Python over RequestState; produces a StepPlan (plain data) that batching.py turns into tensors.

Policy, in order, every step:
1. Admission (FIFO): while a slot is free and requests wait, the oldest waiting request takes a slot.
   Requests join between steps and leave as soon as they finish (continuous batching).
2. Batch choice: running requests in admission order, decodes first (one token each), then prefills;
   at most max_batch_size rows and max_tokens_per_step real tokens. A prompt longer than the budget
   left is fed in chunks over several steps (chunked prefill); only its last chunk samples a token.
3. Optional length bucketing: with an anchor (the oldest runnable request), only requests whose
   context length (cache_len + tokens this step) differs from every other member's by at most
   `tolerance` (relative to the longer) join the batch; the others wait for a later step. The 20%
   default keeps the padding of a padded batch small.

With paged KV (admit_paged, plan_paged) admission needs the blocks of the request's whole prefill
instead of a slot, and a running request whose next token needs a block when none is free makes
the newest running request give its blocks back and return to the front of the waiting queue
(preemption by recompute, as vLLM V1's scheduler).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvtui.engine.request import RequestState, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of a step.

    Attributes:
        request: the request (read-only here).
        slot: its KV slot.
        start_pos: cache_len before the step = position of the first fed token (tokens).
        token_ids: tokens fed this step (a prompt chunk, or the last generated token).
        samples: True when this chunk ends the prompt or is a decode, so a token is sampled.
        phase: "prefill" or "decode".
        blocks: paged KV: the request's block table (block ids, covering end_pos); None with slots.
    """

    request: RequestState
    slot: int
    start_pos: int
    token_ids: tuple[int, ...]
    samples: bool
    phase: str
    blocks: tuple[int, ...] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_pos(self) -> int:
        """cache_len after the step (tokens)."""
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class StepPlan:
    """What one step computes: chunks in row order (padded) or segment order (packed)."""

    chunks: tuple[ScheduledChunk, ...]

    @property
    def empty(self) -> bool:
        return not self.chunks


def _next_chunk(request: RequestState, budget: int) -> tuple[tuple[int, ...], bool, str]:
    """Tokens a running request feeds next within `budget` tokens, whether it samples, and its phase."""
    if request.in_prefill:
        remaining = request.prefill_ids[request.prefill_done :]
        chunk = tuple(remaining[:budget])
        return chunk, len(chunk) == len(remaining), "prefill"
    return (request.generated_ids[-1],), True, "decode"


def within_tolerance(lengths: list[int], tolerance: float) -> bool:
    """True when max/min - 1 <= tolerance over `lengths` (tokens), i.e. every pair differs by at most
    `tolerance` relative to the shorter one."""
    return max(lengths) <= (1.0 + tolerance) * min(lengths)


class Scheduler:
    """FIFO continuous-batching scheduler over a KV pool's free slots.

    Args:
        max_batch_size: rows per step.
        max_tokens_per_step: real tokens per step (prefill + decode).
        bucketing, bucket_tolerance: see module docstring.
    """

    def __init__(self, *, max_batch_size: int, max_tokens_per_step: int, bucketing: bool = False,
                 bucket_tolerance: float = 0.2) -> None:
        self.max_batch_size = max_batch_size
        self.max_tokens_per_step = max_tokens_per_step
        self.bucketing = bucketing
        self.bucket_tolerance = bucket_tolerance
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []

    def add(self, request: RequestState) -> None:
        self.waiting.append(request)

    def remove(self, request: RequestState) -> None:
        """Drop a request that finished or was aborted (from whichever queue holds it)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def admit(self, num_free_slots: int) -> list[RequestState]:
        """Pop up to `num_free_slots` waiting requests (FIFO) and mark them running; the caller gives
        each a slot."""
        admitted = []
        while self.waiting and len(admitted) < num_free_slots:
            request = self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            admitted.append(request)
        return admitted

    def _ordered(self) -> list[RequestState]:
        """Running requests in batch order: decodes, then prefills (bucketed when on)."""
        decodes = [r for r in self.running if not r.in_prefill]
        prefills = [r for r in self.running if r.in_prefill]
        ordered = decodes + prefills
        if self.bucketing and ordered:
            ordered = self._bucket(ordered)
        return ordered

    def plan(self) -> StepPlan:
        """Choose this step's chunks from the running requests (see module docstring)."""
        ordered = self._ordered()
        chunks: list[ScheduledChunk] = []
        budget = self.max_tokens_per_step
        for request in ordered:
            if len(chunks) >= self.max_batch_size or budget <= 0:
                break
            token_ids, samples, phase = _next_chunk(request, budget)
            assert request.slot is not None, f"{request.request_id = } runs without a slot"
            chunks.append(ScheduledChunk(request, request.slot, request.cache_len, token_ids, samples, phase))
            budget -= len(token_ids)
        return StepPlan(tuple(chunks))

    # -- paged KV ---------------------------------------------------------------------------------
    def admit_paged(self, try_admit, max_running: int) -> list[RequestState]:
        """Paged KV: admit waiting requests in order (FIFO, the head blocks the rest) while fewer than
        `max_running` run and `try_admit(request)` gives the head its blocks (True)."""
        admitted = []
        while self.waiting and len(self.running) < max_running and try_admit(self.waiting[0]):
            request = self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            admitted.append(request)
        return admitted

    def preempt(self, request: RequestState) -> None:
        """Send a running request back to the FRONT of the waiting queue (preemption by recompute)."""
        self.running.remove(request)
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def plan_paged(self, ensure, preempt) -> StepPlan:
        """As plan(), over paged KV: `ensure(request, end_pos)` grows the request's block table to hold
        its new tokens and returns it (None when no block is free). Then, as vLLM V1's scheduler does,
        the newest running request is preempted (`preempt(request)`: blocks back, front of the waiting
        queue; its chunk leaves the plan if it had one), until the blocks come or the request being
        planned was the one preempted."""
        chunks: list[ScheduledChunk] = []
        budget = self.max_tokens_per_step
        for request in self._ordered():
            if len(chunks) >= self.max_batch_size or budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            token_ids, samples, phase = _next_chunk(request, budget)
            table = ensure(request, request.cache_len + len(token_ids))
            while table is None and request.status == RequestStatus.RUNNING:
                victim = self.running[-1]
                preempt(victim)
                budget += sum(c.num_tokens for c in chunks if c.request is victim)
                chunks = [c for c in chunks if c.request is not victim]
                if victim is not request:
                    table = ensure(request, request.cache_len + len(token_ids))
            if table is not None:
                chunks.append(ScheduledChunk(request, -1, request.cache_len, token_ids, samples, phase, table))
                budget -= len(token_ids)
        return StepPlan(tuple(chunks))

    def _bucket(self, ordered: list[RequestState]) -> list[RequestState]:
        """Keep the oldest runnable request and those whose context length stays within tolerance."""
        def context_len(r: RequestState) -> int:
            fed = min(r.prefill_len - r.prefill_done, self.max_tokens_per_step) if r.in_prefill else 1
            return r.cache_len + fed

        anchor = min(ordered, key=lambda r: self.running.index(r))
        members = [anchor]
        lengths = [context_len(anchor)]
        for request in sorted(ordered, key=lambda r: abs(context_len(r) - lengths[0])):
            if request is anchor:
                continue
            if within_tolerance(lengths + [context_len(request)], self.bucket_tolerance):
                members.append(request)
                lengths.append(context_len(request))
        keep = set(map(id, members))
        return [r for r in ordered if id(r) in keep]
