"""Per-row sampling state: each running request's logits processors, penalty history and generator,
kept in batch-row order beside the KV cache, as a batched engine keeps them (vLLM's InputBatch).

A `RowState` belongs to one request: its SamplingParams, its own generator, its prompt's token ids
and its own output token counts, and its logits-processing stages (`Stage`: bad words, min_tokens,
logit bias, penalties; a grammar bitmask stage fits beside them). A `RowTable` holds the running
requests' row states in row order: a request joins at the end when it starts running and leaves
when it finishes or is preempted, and the rows behind it move up, ids and states together.

Three isolation faults act here (kvtui/faults.py):
- row_state_misalign: when rows leave, the ids move up but the state arrays are cut at the end, so a
  row behind a departed one uses its neighbour's state (its penalties, bias, bans, temperature,
  generator) and feeds its tokens into that state.
- shared_rng: one generator for all requests, reseeded with each request's seed when it joins (a
  global `manual_seed`), so a seeded request's draws depend on its neighbours'.
- penalty_shared_history: penalties count the tokens of every row in the batch, not the row's own.

Provenance: each token sampled here is tagged (`SampledWith`) with the request whose row state picked it,
the requests whose tokens the penalties counted, and the trail of the generator that drew it (who
seeded it, then every other request that drew from it), as the KV pool tags each position with its
writer. With isolation intact all three name the request itself; the sampling_provenance detector
(kvtui/detect/sampling.py) reports any other name.

Order of the stages, as vLLM's V1 sampler: bad words, min_tokens, logit bias, then the penalties
(repetition, frequency, presence), then temperature / top-k / top-p (sampling.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from kvtui.engine.request import RequestState, SamplingParams
from kvtui.engine.sampling import make_generator


@dataclass
class History:
    """The token history penalties read: `prompt` the set of prompt token ids, `counts` output token
    id -> times generated (tokens)."""

    prompt: frozenset
    counts: Counter


class Stage(Protocol):
    """One logits-processing step of a row: `apply(logits [V] float32, row, history) -> logits [V]`
    (it may change `logits` in place). A stage with state of its own (a grammar matcher behind a
    token bitmask) may also define `accept(token)`, called with each token sampled with the row."""

    def apply(self, logits: torch.Tensor, row: "RowState", history: History) -> torch.Tensor: ...


class BadWords:
    """Ban the last token of each bad-words sequence whose other tokens end the output (a one-token
    sequence always), as vLLM's `bad_words` (over output tokens)."""

    def apply(self, logits, row, history):
        banned = banned_by_bad_words(row.params.bad_words_ids, row.output_ids)
        if banned:
            logits[torch.tensor(banned)] = -torch.inf
        return logits


class MinTokens:
    """Mask the stop token ids (EOS, unless ignore_eos) while the output is shorter than min_tokens."""

    def apply(self, logits, row, history):
        if len(row.output_ids) < row.params.min_tokens and row.stop_ids:
            logits[torch.tensor(sorted(row.stop_ids))] = -torch.inf
        return logits


class LogitBias:
    """Add each (token id, bias) of logit_bias to that token's logit (OpenAI's logit_bias)."""

    def apply(self, logits, row, history):
        ids, biases = zip(*row.params.logit_bias)
        logits[torch.tensor(ids)] += torch.tensor(biases, dtype=logits.dtype)
        return logits


class Penalties:
    """repetition_penalty over prompt and output tokens (HF's RepetitionPenaltyLogitsProcessor, vLLM's
    apply_penalties: a positive logit divided by it, a negative one multiplied), then frequency and
    presence over output tokens (OpenAI: logit - count x frequency - (count > 0) x presence)."""

    def apply(self, logits, row, history):
        p = row.params
        if p.repetition_penalty != 1.0:
            seen = sorted(history.prompt | set(history.counts))
            if seen:
                ids = torch.tensor(seen)
                values = logits[ids]
                logits[ids] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and history.counts:
            ids = torch.tensor(list(history.counts))
            counts = torch.tensor(list(history.counts.values()), dtype=logits.dtype)
            logits[ids] -= counts * p.frequency_penalty
            logits[ids] -= p.presence_penalty
        return logits


def banned_by_bad_words(sequences, output_ids: list[int]) -> list[int]:
    """Token ids banned next: the last token of each sequence whose earlier tokens end `output_ids`."""
    banned = []
    for seq in sequences:
        prefix = list(seq[:-1])
        if not prefix or (len(output_ids) >= len(prefix) and output_ids[-len(prefix):] == prefix):
            banned.append(seq[-1])
    return banned


def stages_for(params: SamplingParams) -> tuple[Stage, ...]:
    """The stages a request's params need, in vLLM's order (none for plain requests)."""
    stages: list[Stage] = []
    if params.bad_words_ids:
        stages.append(BadWords())
    if params.min_tokens:
        stages.append(MinTokens())
    if params.logit_bias:
        stages.append(LogitBias())
    if params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty:
        stages.append(Penalties())
    return tuple(stages)


UNSEEDED = "<unseeded>"  # the shared generator's trail before any request seeded it (not a request id)


class SampledWith(NamedTuple):
    """Where one sampled token's sampling state came from (RunningEntry.sampled_with, penalized_with,
    drawn_with). With isolation intact each names only the request itself.

    Attributes:
        row_state: the request whose row state (params, stages, temperature) picked the token; the
            request itself when the state it used and its own are both plain (RowState.plain: the
            pick is argmax either way, nothing of the other request reaches it).
        history: the requests whose tokens the penalties counted: a history's owner when
            repetition_penalty reads its prompt, and each request whose sampled tokens it holds; None
            when no penalty applied (the row state has none).
        generator: the trail of the generator that drew the token, as it was before this draw: the
            request that seeded it (UNSEEDED for a shared generator nobody seeded yet), then each
            other request that drew from it since, in order of their first draw; None for a greedy token.
    """

    row_state: str | None
    history: tuple[str, ...] | None
    generator: tuple[str, ...] | None


NOT_SAMPLED = SampledWith(None, None, None)


@dataclass
class RowState:
    """One request's sampling state (see the module docstring).

    Attributes:
        owner: the request it belongs to; params: its SamplingParams; generator: its own (None: greedy).
        prompt: its prompt's token ids (a set); output_ids: the tokens fed into this state (its own
            output, unless a fault put another row's tokens here); counts: output token counts.
        stop_ids: the ids min_tokens masks (EOS unless ignore_eos); stages: its logits processors.
        fed_by: the requests whose sampled tokens this state counted, in order of their first ((owner,)
            unless a fault fed another row's tokens here); drawn_by: its generator's trail (the owner,
            who seeded it, then each other request that drew from it; () when greedy).
    """

    owner: str
    params: SamplingParams
    generator: torch.Generator | None
    prompt: frozenset
    stop_ids: frozenset
    stages: tuple = ()
    output_ids: list[int] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    seeded_shared: bool = False
    fed_by: tuple[str, ...] = ()
    drawn_by: tuple[str, ...] = ()

    @classmethod
    def of(cls, request: RequestState, eos_ids: frozenset) -> "RowState":
        p, own = request.sampling, (request.request_id,)
        generator = make_generator(p)
        return cls(request.request_id, p, generator, frozenset(request.prompt_ids),
                   frozenset() if p.ignore_eos else eos_ids, stages_for(p),
                   list(request.generated_ids), Counter(request.generated_ids),
                   fed_by=own if request.generated_ids else (), drawn_by=() if generator is None else own)

    @property
    def plain(self) -> bool:
        """Greedy with no stages: the state picks argmax(logits) and holds nothing of its request."""
        return self.generator is None and not self.stages

    @property
    def penalized(self) -> bool:
        """Whether penalties apply to this state's rows (repetition, frequency or presence)."""
        p = self.params
        return p.repetition_penalty != 1.0 or bool(p.frequency_penalty or p.presence_penalty)

    def history_owners(self) -> tuple[str, ...]:
        """The requests whose tokens this state's own history gives the penalties: its owner when
        repetition_penalty reads the prompt, and fed_by (fed_by itself, no new tuple, when they agree)."""
        prompt_read = self.params.repetition_penalty != 1.0 and bool(self.prompt)
        return (self.owner, *self.fed_by) if prompt_read and self.owner not in self.fed_by else self.fed_by

    @property
    def history(self) -> History:
        return History(self.prompt, self.counts)

    def process(self, logits: torch.Tensor, history: History | None = None) -> torch.Tensor:
        """Logits [V] after every stage (a float32 copy; the input is untouched)."""
        out = logits.float().clone()
        for stage in self.stages:
            out = stage.apply(out, self, history or self.history)
        return out

    def accept(self, token: int, by: str | None = None) -> None:
        """Note a token sampled with this state by request `by` (default: its owner), and tell the
        stages that keep state of their own."""
        by = self.owner if by is None else by
        if by not in self.fed_by:
            self.fed_by = (*self.fed_by, by)
        self.output_ids.append(token)
        self.counts[token] += 1
        for stage in self.stages:
            accept = getattr(stage, "accept", None)
            if accept is not None:
                accept(token)


class RowTable:
    """The running requests' row states in row order (see the module docstring)."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.joined: list[RowState] = []  # each row's own state: the bookkeeping, always moved right
        self.states: list[RowState] = []  # the state array the sampler reads by row
        self.shared_rng = torch.Generator(device="cpu")
        self.shared_trail: tuple[str, ...] = (UNSEEDED,)  # who seeded shared_rng last, then who drew since

    def sync(self, running: list[str], states: dict[str, RowState], *, misalign: bool, shared_rng: bool) -> None:
        """Make the rows the `running` requests (in order of joining): departed rows leave (a request id
        may come back as a new request: its row is new), new ones join at the end with their state from
        `states`. misalign: a departure cuts the state array at its end instead of at the departed row.
        shared_rng: a joining request reseeds the shared generator."""
        keep = set(running)
        left = {i for i, (r, own) in enumerate(zip(self.ids, self.joined)) if r not in keep or states.get(r) is not own}
        if left:
            self.ids = [r for i, r in enumerate(self.ids) if i not in left]
            self.joined = [s for i, s in enumerate(self.joined) if i not in left]
            if misalign:
                del self.states[len(self.states) - len(left):]
            else:
                self.states = [s for i, s in enumerate(self.states) if i not in left]
        present = set(self.ids)
        for request_id in running:
            if request_id not in present:
                state = states[request_id]
                self.ids.append(request_id)
                self.joined.append(state)
                self.states.append(state)
                if shared_rng and not state.seeded_shared and state.generator is not None:
                    self.shared_rng.manual_seed(state.params.seed)
                    self.shared_trail = (request_id,)
                    state.seeded_shared = True

    def state_of(self, request_id: str) -> RowState:
        """The state at `request_id`'s row (its own unless row_state_misalign moved the arrays)."""
        return self.states[self.ids.index(request_id)]

    def batch_history(self) -> History:
        """penalty_shared_history: every row's prompt and output tokens as one history."""
        prompt: set = set()
        counts: Counter = Counter()
        for state in self.states:
            prompt |= state.prompt
            counts.update(state.counts)
        return History(frozenset(prompt), counts)

    def batch_history_owners(self, params: SamplingParams) -> tuple[str, ...]:
        """penalty_shared_history: the requests whose tokens batch_history gives penalties under
        `params`: each row's owner when repetition_penalty reads prompts, and each request whose sampled
        tokens a row's state holds (in row order, each once)."""
        prompts = params.repetition_penalty != 1.0
        owners: dict[str, None] = {}
        for state in self.states:
            if prompts and state.prompt:
                owners[state.owner] = None
            owners.update(dict.fromkeys(state.fed_by))
        return tuple(owners)

    def note_draw(self, request_id: str, state: RowState, shared: bool) -> tuple[str, ...]:
        """`request_id` drew a token with `state`'s generator (shared: with shared_rng). Returns the
        generator's trail as it was before the draw (SampledWith.generator) and adds `request_id` to it
        when it is not there yet (no new tuple once it is)."""
        trail = self.shared_trail if shared else state.drawn_by
        if request_id not in trail:
            if shared:
                self.shared_trail = (*trail, request_id)
            else:
                state.drawn_by = (*trail, request_id)
        return trail
