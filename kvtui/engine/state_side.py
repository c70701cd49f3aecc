"""The engine's state side: what a request keeps besides its KV cache, a hybrid model's recurrent state.

Attention-only models keep nothing besides K/V (NoState: every verb a no-op). A hybrid (gated-delta "linear
attention" layers beside attention layers: tiny-qwen35moe) keeps, per request, a conv and a recurrent state
per linear layer in a StatePool slot (state_pool.py): RecurrentState. The engine picks one at build time from
the model (`make_state_side`, from its ModelKind); the Scheduler owns it and calls it; it never calls back.

| verb | who calls | does |
|---|---|---|
| configure(faults) | Engine (start, set_faults) | takes the faults it acts on |
| has_room() | Scheduler.admit, Scheduler.fork | whether one more request can have a state slot |
| admit(request, hit_tokens, checkpoint) | Scheduler.admit | a zeroed slot; on a prefix hit the slot takes the hit's checkpoint |
| fork(lead, child) | Scheduler.fork | parallel sampling: the child's slot takes a copy of the lead's state |
| release(request) | Scheduler.finish, Scheduler._preempt | the slot goes back (preemption by recompute starts from zero) |
| bind(chunks) | Scheduler.plan | each planned chunk with its state slot |
| update_from_output(plan, failed) | Scheduler.update_from_output | the checkpoints the forward took at block boundaries, to keep with their blocks |
| report() | Engine, step report | the StepEvent's state fields (with each start's provenance and the slot map) |

Chunked prefill carries the state: chunk N reads the slot chunk N - 1 wrote. With paged KV and prefix caching
(`checkpoints`), the forward copies every request's state out at each block boundary it crosses (the linear
layers run each request's tokens in block-aligned pieces: vLLM's "align" mode at block granularity, without
changing the token budget's chunks), and the scheduler keeps each checkpoint with the block it ends
(KVCache.keep_checkpoint); a prefix hit is cut back to its longest block that keeps one, and the request's
slot restores it. Attributes every implementation has: `checkpoints` (whether hits need a checkpoint) and
`pool` (the StatePool, or None).

Provenance: every start (admission, fork) is reported as a StateStartEntry (the state's writer, the positions
it covers and their digest, against the request's own), and after each forward the pool notes what each slot
now holds; the state_provenance detector reads the entries. Faults acting here: `state_slot_not_reset`
(admission takes its slot without zeroing it: StatePool.allocate) and `state_index_units` (the checkpoint a
hit's wrongly computed index finds is restored whatever it covers; none found restores the zero state).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from kvtui.engine.state_pool import EMPTY_PREFIX, StateCheckpoint, StateOrigin, StatePool, prefix_digest, state_shape
from kvtui.events import StateStartEntry
from kvtui.faults import FaultName
from kvtui.model_kinds import ModelKind, model_kind

if TYPE_CHECKING:
    from kvtui.config import EngineConfig
    from kvtui.engine.request import RequestState


class StateSide(Protocol):
    """The verbs every state side offers (see the module docstring for who calls each)."""

    checkpoints: bool
    pool: StatePool | None

    def configure(self, faults: frozenset[str]) -> None:
        """Take the faults this side acts on from the next step."""

    def has_room(self) -> bool:
        """Whether one more request can run (a state slot is free)."""

    def admit(self, request: RequestState, hit_tokens: int, checkpoint: StateCheckpoint | None) -> None:
        """Give an admitted request its state: a zeroed slot, then `checkpoint` (the state after its
        `hit_tokens` cached positions) restored into it when it starts on a prefix hit.

        Raises:
            RuntimeError: a hit without a checkpoint (the KV cache cuts hits back to checkpoints: a bug)."""

    def fork(self, lead: RequestState, child: RequestState) -> None:
        """Parallel sampling: `child` starts from `lead`'s state (the lead's prefill just ended)."""

    def release(self, request: RequestState) -> None:
        """The request finished, was aborted or preempted: its state goes back (no-op without one)."""

    def bind(self, chunks: tuple) -> tuple:
        """The planned chunks (scheduler.ScheduledChunk) with their state slots set."""

    def update_from_output(self, plan, failed=()) -> list[tuple[RequestState, StateCheckpoint]]:
        """After the forward: (request, checkpoint) for each block boundary a chunk that ran (not in
        `failed`, chunk indices) crossed, for the KV cache to keep with that block."""

    def report(self) -> dict:
        """StepEvent fields (state slots, checkpoints published and restored this step); {} without state."""


class NoState:
    """Attention-only models: nothing besides the KV cache."""

    checkpoints = False
    pool = None

    def configure(self, faults: frozenset[str]) -> None:
        return None

    def has_room(self) -> bool:
        return True

    def admit(self, request, hit_tokens: int, checkpoint) -> None:
        return None

    def fork(self, lead, child) -> None:
        return None

    def release(self, request) -> None:
        return None

    def bind(self, chunks: tuple) -> tuple:
        return chunks

    def update_from_output(self, plan, failed=()) -> list:
        return []

    def report(self) -> dict:
        return {}


class RecurrentState:
    """A hybrid's per-request conv and recurrent states in a StatePool (see the module docstring).

    Args:
        pool: the StatePool (one slot per request that may run at once).
        checkpoints: keep checkpoints at block boundaries and restore them on prefix hits (paged KV with
            prefix caching).
    """

    def __init__(self, pool: StatePool, *, checkpoints: bool = False) -> None:
        self.pool = pool
        self.checkpoints = checkpoints
        self.faults: frozenset[str] = frozenset()
        self.slots: dict[str, int] = {}  # running request -> its state slot
        self.last_checkpoint: dict[str, int] = {}  # running request -> positions of its last checkpoint
        self._published = self._restores = self._hit_tokens = 0  # since the last report
        self._starts: list[StateStartEntry] = []

    def configure(self, faults: frozenset[str]) -> None:
        self.faults = faults

    def has_room(self) -> bool:
        return self.pool.num_free > 0

    def admit(self, request: RequestState, hit_tokens: int, checkpoint: StateCheckpoint | None) -> None:
        slot = self.slots[request.request_id] = self.pool.allocate(
            request.request_id, zero=FaultName.STATE_SLOT_NOT_RESET not in self.faults)  # zeroed
        if hit_tokens == 0:
            self._note_start(request, slot, "slot", 0, self.pool.held[slot])
            return
        if FaultName.STATE_INDEX_UNITS in self.faults:  # the engine trusts the index it computed
            checkpoint = checkpoint or self.pool.zero_checkpoint(hit_tokens)
        elif checkpoint is None or checkpoint.num_tokens != hit_tokens:
            raise RuntimeError(f"{request.request_id} starts on {hit_tokens} cached tokens without their state "
                               f"checkpoint ({checkpoint and checkpoint.num_tokens})")
        self.restore(slot, checkpoint)
        self._hit_tokens += hit_tokens
        self.last_checkpoint[request.request_id] = hit_tokens
        self._note_start(request, slot, "checkpoint", hit_tokens, checkpoint.origin, checkpoint.publisher)

    def restore(self, slot: int, checkpoint: StateCheckpoint) -> None:
        """Copy a prefix hit's checkpoint into the request's freshly zeroed `slot`: the one place a state is
        restored from a checkpoint."""
        self.pool.restore(slot, checkpoint)
        self._restores += 1

    def fork(self, lead: RequestState, child: RequestState) -> None:
        slot = self.slots[child.request_id] = self.pool.allocate(child.request_id)
        held = self.pool.held[self.slots[lead.request_id]]
        self.pool.restore(slot, self.pool.snapshot(self.slots[lead.request_id], lead.cache_len))
        self.pool.held[slot] = held
        self._note_start(child, slot, "fork", lead.cache_len, held)

    def _note_start(self, request: RequestState, slot: int, via: str, tokens: int, origin: StateOrigin,
                    publisher: str = "") -> None:
        """Report the state `request` starts from (StepEvent.state_starts) against its own first `tokens`."""
        reader = prefix_digest(request.cache_keys(tokens)) if tokens else EMPTY_PREFIX
        self._starts.append(StateStartEntry(
            request_id=request.request_id, slot=slot, via=via, tokens=tokens, writer=origin.writer or None,
            writer_tokens=origin.covered, publisher=publisher if publisher and publisher != origin.writer else None,
            writer_key=origin.prefix, reader_key=reader))

    def release(self, request: RequestState) -> None:
        slot = self.slots.pop(request.request_id, None)
        self.last_checkpoint.pop(request.request_id, None)
        if slot is not None:
            self.pool.free(slot)

    def bind(self, chunks: tuple) -> tuple:
        return tuple(replace(c, state_slot=self.slots[c.request.request_id]) for c in chunks)

    def update_from_output(self, plan, failed=()) -> list[tuple[RequestState, StateCheckpoint]]:
        """The checkpoints the forward staged (StatePool.take_staged) of the chunks that ran, each with the
        digest of the positions it covers: the one place a checkpoint is published (the scheduler hands each
        to KVCache.keep_checkpoint). The pool notes what each chunk's slot now holds."""
        staged = self.pool.take_staged()
        out = []
        for index, chunk in enumerate(plan.chunks):
            if index in failed:
                continue
            request, slot = chunk.request, chunk.state_slot
            keys = request.cache_keys(chunk.end_pos)
            self.pool.held[slot] = StateOrigin(request.request_id, chunk.end_pos, prefix_digest(keys))
            for (at, n), checkpoint in staged.items():
                if at == slot and chunk.start_pos < n <= chunk.end_pos:
                    out.append((request, replace(checkpoint, covered=n, prefix=prefix_digest(keys[:n]))))
                    self.last_checkpoint[request.request_id] = n
        self._published += len(out)
        return out

    def report(self) -> dict:
        owner = self.pool.owner
        fields = dict(state_slots_used=self.pool.num_used, num_state_slots=self.pool.num_slots,
                      state_checkpoints=self._published, state_checkpoint_hits=self._hit_tokens,
                      state_restores=self._restores, state_starts=tuple(self._starts),
                      state_slot_map=tuple((s, o, self.last_checkpoint.get(o) if o else None) for s, o in enumerate(owner)))
        self._published = self._restores = self._hit_tokens = 0
        self._starts = []
        return fields


def state_slots(config: EngineConfig) -> int:
    """State slots a hybrid's pool holds: one per request that may run at once (num_slots with slot KV,
    max_batch_size with paged KV, whose running requests it bounds)."""
    return config.num_slots if config.kv == "slots" else config.max_batch_size


def make_state_side(model, config: EngineConfig) -> StateSide:
    """The state side `model` needs: RecurrentState over a StatePool for a model with linear-attention layers
    (ModelKind.HYBRID), checkpointing with paged KV and prefix caching; NoState otherwise."""
    if model_kind(model.config) is not ModelKind.HYBRID:
        return NoState()
    shape = state_shape(model.config)
    pool = StatePool(shape, state_slots(config), config.device)
    return RecurrentState(pool, checkpoints=config.kv == "paged" and config.prefix_caching)
