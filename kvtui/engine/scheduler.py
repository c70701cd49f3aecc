"""Continuous-batching scheduler: admission, batch choice, token budget, chunked prefill.

Pure Python over RequestState; produces a StepPlan (plain data) that batching.py turns into tensors.

The scheduler owns the engine's KV cache (kv_cache.KVCache: SlotCache or PagedCache) and calls it
one way: admit, ensure, preempt, fork, finish; the cache never calls back. It is the one writer of
each request's progress (cache_len, prefill_done: set_progress): at admission from the cache's hit
count, after each step (update_from_output), on preemption and when a parallel-sampling sibling
forks. It owns the encoder side (encoder_side.EncoderSide) too: it calls its admit after admission,
bind on the planned chunks, and finish when a request ends; the encoder side never calls back either.
And it owns the state side (state_side.StateSide: a hybrid model's recurrent state, nothing for
attention-only models): a request is admitted only while the state side has room, takes its state
slot (and a prefix hit's checkpoint, KVCache.checkpoint) at admission, gives it back on finish and
preemption, and the checkpoints a forward took go to the KV cache (KVCache.keep_checkpoint).

Policy, in order, every step:
1. Admission (FIFO): while requests wait and the KV cache admits the oldest (a free slot; with
   paged KV the blocks of its whole prefill, and fewer than max_batch_size running), it runs.
   Requests join between steps and leave as soon as they finish (continuous batching).
2. Batch choice: running requests in admission order, decodes first (one token each), then prefills;
   at most max_batch_size rows and max_tokens_per_step real tokens. A prompt longer than the budget
   left is fed in chunks over several steps (chunked prefill); only its last chunk samples a token.
3. Optional length bucketing: with an anchor (the oldest runnable request), only requests whose
   context length (cache_len + tokens this step) differs from every other member's by at most
   `tolerance` (relative to the longer) join the batch; the others wait for a later step. The 20%
   default keeps the padding of a padded batch small.

Each planned chunk asks the cache for room (`ensure`). When it has none (paged KV: no free block),
the newest running request gives its KV back and returns to the front of the waiting queue
(preemption by recompute, as vLLM V1's scheduler), until the room comes or the request being planned
was the one preempted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvtui.config import EngineConfig
from kvtui.engine.encoder_side import EncoderSide, TokenInputs
from kvtui.engine.kv_cache import KVCache, KVPlace
from kvtui.engine.request import RequestState, RequestStatus
from kvtui.engine.state_side import NoState, StateSide


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of a step.

    Attributes:
        request: the request (read-only here).
        slot: its KV slot; None with paged KV.
        start_pos: cache_len before the step = position of the first fed token (tokens).
        token_ids: tokens fed this step (a prompt chunk, or the last generated token).
        samples: True when this chunk ends the prompt or is a decode, so a token is sampled.
        phase: "prefill" or "decode".
        blocks: paged KV: the request's block table (block ids, covering end_pos); None with slots.
        spliced: rows spliced into the model's input embeddings at some of the fed positions (prompt
            embeddings, image features), as (offsets into token_ids, rows [m, hidden]); None: none.
        state_slot: a hybrid model's recurrent-state slot (state_side.RecurrentState.bind); None without one.
    """

    request: RequestState
    slot: int | None
    start_pos: int
    token_ids: tuple[int, ...]
    samples: bool
    phase: str
    blocks: tuple[int, ...] | None = None
    spliced: tuple | None = None
    state_slot: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_pos(self) -> int:
        """cache_len after the step (tokens)."""
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class StepPlan:
    """What one step computes: chunks in row order (padded) or segment order (packed), and the encoder
    side's reports on the inputs it bound to them (TaintEntry per chunk that reads another input's
    encoder output: cross-attention K/V or spliced rows)."""

    chunks: tuple[ScheduledChunk, ...]
    taint: tuple = ()

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
    """FIFO continuous-batching scheduler over one KV cache.

    Args:
        kv: the KV cache it admits into and plans over (it owns it; see kv_cache.py).
        config: the knobs it reads (configure).
        encoder: the encoder side (it owns it; see encoder_side.py); default TokenInputs() (token ids and
            supplied embedding rows).
        state: the state side (it owns it; see state_side.py); default NoState() (attention-only models).
    """

    def __init__(self, kv: KVCache, config: EngineConfig, encoder: EncoderSide | None = None,
                 state: StateSide | None = None) -> None:
        self.kv = kv
        self.encoder = encoder if encoder is not None else TokenInputs()
        self.state = state if state is not None else NoState()
        self.encoder_cost_s = 0.0  # modeled seconds of the last admission's encoder work (virtual clock)
        self.configure(config)
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []

    def configure(self, config: EngineConfig) -> None:
        """Take config's max_batch_size (rows per step), max_tokens_per_step (real tokens per step, prefill +
        decode), bucketing and bucket_tolerance (see module docstring) from the next step."""
        self.max_batch_size = config.max_batch_size
        self.max_tokens_per_step = config.max_tokens_per_step
        self.bucketing = config.bucketing
        self.bucket_tolerance = config.bucket_tolerance

    def add(self, request: RequestState) -> None:
        self.waiting.append(request)

    @staticmethod
    def set_progress(request: RequestState, cache_len: int, prefill_done: int) -> None:
        """The one writer of a request's progress: positions 0 .. cache_len - 1 of its KV hold K/V and the
        first `prefill_done` tokens of its prefill (RequestState.prefill_ids) are fed (tokens). Admission,
        update_from_output, preemption and fork go through here, and so do benchmarks that start requests
        on a synthetic cached prefix."""
        request.cache_len = cache_len
        request.prefill_done = prefill_done

    def fork(self, lead: RequestState, siblings) -> list[tuple[RequestState, KVPlace]]:
        """Parallel sampling: `lead`'s prefill is done; each of its waiting `siblings` takes a copy of its KV
        (kv.fork) and runs from this step on, as the newest running request, with the lead's positions and
        prompt fed. A sibling the KV cache has no room for queues at the front and prefills the prompt
        itself (its tokens are the same either way). Returns the forked (sibling, KVPlace)."""
        forked, queued = [], []
        for sibling in siblings:
            place = self.kv.fork(lead, sibling, len(self.running)) if self.state.has_room() else None
            if place is None:
                queued.append(sibling)
                continue
            self.state.fork(lead, sibling)
            self.set_progress(sibling, lead.cache_len, sibling.prompt_len)
            sibling.scheduled_s, sibling.status = lead.scheduled_s, RequestStatus.RUNNING
            self.running.append(sibling)
            forked.append((sibling, place))
        self.requeue(queued)
        return forked

    def requeue(self, requests: list[RequestState]) -> None:
        """Siblings that could not fork (no room, or their lead ended first) wait at the front of the
        queue, in order, and prefill the prompt themselves."""
        for request in reversed(requests):
            self.waiting.appendleft(request)

    def finish(self, request: RequestState) -> None:
        """Drop a request that finished, was aborted or rejected (from whichever queue holds it) and free
        its KV."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif any(r is request for r in self.waiting):  # aborted while waiting (a rejected one never queued)
            self.waiting.remove(request)
        self.kv.finish(request)
        self.state.release(request)
        self.encoder.finish(request.request_id)

    def admit(self, start_s: float) -> list[RequestState]:
        """Admit waiting requests in order (FIFO: the head blocks the rest) while the KV cache gives the
        head its KV; mark them running, first scheduled at `start_s` (seconds). A request starts on the
        positions its KV already holds (kv.admit's hit count) and feeds the rest of its prefill, and at
        least its last token (which samples), at the position after them; a stale slot (stale_slot
        fault) may hold more positions than the prompt has tokens."""
        admitted = []
        while (self.waiting and self.state.has_room()
               and (hit := self.kv.admit(self.waiting[0], len(self.running))) is not None):
            request = self.waiting.popleft()
            self.state.admit(request, hit, self.kv.checkpoint(request, hit) if hit else None)
            self.set_progress(request, hit, min(hit, request.prefill_len - 1))
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.scheduled_s is None:  # a preempted request keeps its first
                request.scheduled_s = start_s
            admitted.append(request)
        self.encoder_cost_s = self.encoder.admit(admitted)
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
        """Choose this step's chunks from the running requests (see module docstring), each with its KV
        place and the encoder side's inputs bound (encoder_side.EncoderSide.bind); preempts when the
        cache has no room."""
        chunks: list[ScheduledChunk] = []
        budget = self.max_tokens_per_step
        for request in self._ordered():
            if len(chunks) >= self.max_batch_size or budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            token_ids, samples, phase = _next_chunk(request, budget)
            place, chunks, budget = self._room(request, request.cache_len + len(token_ids), chunks, budget)
            if place is not None:
                chunks.append(ScheduledChunk(request, place.slot, request.cache_len, token_ids, samples, phase,
                                             place.blocks))
                budget -= len(token_ids)
        bound, taint = self.encoder.bind(tuple(chunks))
        return StepPlan(self.state.bind(bound), taint)

    def update_from_output(self, plan: StepPlan, failed=()) -> None:
        """Apply a step's outcome to its requests' progress: each chunk that ran wrote its positions
        (cache_len = end_pos) and, in prefill, fed its tokens; the chunks at indices in `failed` (a fault
        broke them; their requests are aborted) are left as they were. The recurrent-state checkpoints the
        forward took (state side) are kept with the blocks they end (KVCache.keep_checkpoint)."""
        for index, chunk in enumerate(plan.chunks):
            if index not in failed:
                fed = chunk.num_tokens if chunk.phase == "prefill" else 0
                self.set_progress(chunk.request, chunk.end_pos, chunk.request.prefill_done + fed)
        for request, checkpoint in self.state.update_from_output(plan, failed):
            self.kv.keep_checkpoint(request, checkpoint)

    def _room(self, request: RequestState, num_tokens: int, chunks: list[ScheduledChunk], budget: int):
        """Ask the cache for room for `request`'s positions 0 .. num_tokens - 1; while it has none, preempt
        the newest running request (its chunk leaves the plan, its tokens go back to the budget). Returns
        (KVPlace or None when `request` itself was preempted, chunks, budget)."""
        place = self.kv.ensure(request, num_tokens)
        while place is None and request.status == RequestStatus.RUNNING:
            victim = self.running[-1]
            self._preempt(victim)
            budget += sum(c.num_tokens for c in chunks if c.request is victim)
            chunks = [c for c in chunks if c.request is not victim]
            if victim is not request:
                place = self.kv.ensure(request, num_tokens)
        return place, chunks, budget

    def _preempt(self, request: RequestState) -> None:
        """Preemption by recompute: its KV back, the FRONT of the waiting queue, and when admitted again
        it feeds its prompt and the tokens it had generated as one prefill."""
        self.kv.preempt(request)
        self.state.release(request)
        self.running.remove(request)
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.set_progress(request, 0, 0)
        request.recompute_tokens = len(request.generated_ids)
        request.num_preemptions += 1

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
