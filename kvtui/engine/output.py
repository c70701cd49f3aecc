"""The engine's output side: per-row sampling state, structured output, sampling, log-probabilities,
stop checks (the part of a step after the forward; nano-vllm's postprocess, vLLM's sampler and
update_from_output).

The engine hands it each step's logits; it keeps every running request's row state (engine/row_state.py:
penalties, bias, bans, min_tokens, its generator) in row order, applies structured output's bitmasks
(engine/grammar.py), draws each token, notes it on the request and says whether the request stops. It
never finishes a request itself (the engine does, with the KV and the scheduler), never touches the
model, the KV cache or the scheduler.
"""

from __future__ import annotations

import torch

from kvtui.engine.grammar import GrammarStage
from kvtui.engine.request import FinishCode, FinishReason, RequestState
from kvtui.engine.row_state import RowState, RowTable, SampledWith
from kvtui.engine.sampling import draw_token
from kvtui.engine.stops import StopScan
from kvtui.faults import FaultName


class OutputProcessor:
    """The output side of one engine (see the module docstring).

    Args:
        vocab_size: logits per row; eos_token_ids: tokens that stop a request (unless ignore_eos);
        tokenizer: for stop strings (None: no stop strings); grammar_tokenizer: what structured output
            compiles grammars with (default: tokenizer); adjust_logits: the encoder side's logits rules
            (EncoderSide.adjust_logits: Whisper's suppressed tokens).

    Attributes:
        rows: the running requests' row states, in row order; row_states: each accepted request's.
        grammar: the structured-output stage; stop_mask_ids: what min_tokens masks (EOS by default; a
            reference engine without EOS sets it); record_draws: keep each sampled token's Draw (the
            reference detector's, about 1 KB a token); faults: the faults acting from this step.
    """

    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int], tokenizer=None, grammar_tokenizer=None,
                 adjust_logits=None) -> None:
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.adjust_logits = adjust_logits or (lambda logits, generated: logits)
        self.row_states: dict[str, RowState] = {}
        self.rows = RowTable()
        self.stop_mask_ids = eos_token_ids
        self.grammar = GrammarStage(grammar_tokenizer or tokenizer, vocab_size)
        self.record_draws = True
        self.faults: frozenset[str] = frozenset()

    def grammar_problem(self, request: RequestState) -> tuple[FinishCode, str] | None:
        """Give a constrained request its grammar matcher; (code, detail) when its grammar does not compile."""
        if request.sampling.structured is None:
            return None
        try:
            self.grammar.add(request.request_id, request.sampling.structured)
        except ValueError as e:
            return FinishCode.INVALID_STRUCTURED_OUTPUT, f"structured output: {e}"
        return None

    def track(self, request: RequestState) -> None:
        """An accepted request gets its row state."""
        self.row_states[request.request_id] = RowState.of(request, self.stop_mask_ids)

    def drop(self, request_id: str) -> None:
        """A finished request's row state and grammar go."""
        self.row_states.pop(request_id, None)
        self.grammar.drop(request_id)

    def sync(self, running_ids: list[str]) -> None:
        """The row table follows the running requests (engine/row_state.py), under this step's faults."""
        self.rows.sync(running_ids, self.row_states, misalign=FaultName.ROW_STATE_MISALIGN in self.faults,
                       shared_rng=FaultName.SHARED_RNG in self.faults)

    def apply_grammar(self, sampling: list[tuple[int, str]], logits: dict) -> None:
        """Structured output's bitmasks on the step's logits: (chunk index, request id) per sampling chunk."""
        self.grammar.apply(sampling, logits, self.faults)

    def sample(self, request: RequestState, logits: torch.Tensor, gap: float, end_s: float, max_len: int):
        """Pick `request`'s next token from its logits [V] and note it. Returns (token, logprobs or None,
        SampledWith: whose row state, penalty history and generator picked it, the FinishReason or None);
        `max_len`: the tokens one request may hold. Whatever raises leaves its tokens as they were. A forced
        request (RequestState.forced) draws as usual, notes that choice in chosen_ids, emits the forced
        token (_forced) and stops after the last one."""
        logits = self.adjust_logits(logits, len(request.generated_ids))  # Whisper: suppressed tokens
        state = self.rows.state_of(request.request_id)
        processed, history = self._processed(state, logits)
        shared = FaultName.SHARED_RNG in self.faults and state.generator is not None
        generator = self.rows.shared_rng if shared else state.generator
        token, draw = draw_token(processed, state.params, generator)
        trail = None if draw is None else self.rows.note_draw(request.request_id, state, shared)
        if (processed is not logits or request.sampling.structured is not None) and gap == gap:  # NaN: not finite
            gap = gaps_and_finite({0: processed})[0][0]
        chosen, forced = token, request.forced
        if forced is not None and (token := self._forced(request, processed)) is None:
            return None, None, SampledWith(state.owner, history, trail), FinishReason.STOP
        logprobs = None
        if request.sampling.logprobs is not None:
            logprobs = token_logprobs(logits, token, request.sampling.logprobs)
        request.generated_ids.append(token)
        try:
            if request.sampling.structured is not None:
                self.grammar.accept(request.request_id, token)
            reason = self.stop_reason(request, token, max_len)
        except Exception:
            request.generated_ids.pop()
            raise
        state.accept(token, request.request_id)
        request.top2_gaps.append(gap)
        if forced is not None:
            request.chosen_ids.append(chosen)
            reason = reason or (FinishReason.LENGTH if len(request.generated_ids) >= len(forced) else None)
        if draw is not None and self.record_draws:
            request.draws.append(draw)
        request.token_times_s.append(end_s)
        if request.first_token_s is None:
            request.first_token_s = end_s
        return token, logprobs, SampledWith(self._picked_by(request.request_id, state), history, trail), reason

    @staticmethod
    def _forced(request: RequestState, processed: torch.Tensor) -> int | None:
        """Teacher forcing: the token to emit next, so the row state and grammar advance on the forced
        tokens; None when the row's own processed logits [V] mask it (-inf: its grammar, bad_words,
        min_tokens, suppressed tokens): the request then stops there (finish_detail says why), with
        nothing noted for that position."""
        token = request.forced[len(request.generated_ids)]
        if processed[token] == -torch.inf:
            request.finish_detail = f"forced token {token} is masked by the request's own logits processing"
            return None
        return token

    def _picked_by(self, request_id: str, state: RowState) -> str:
        """Whose row state picked `request_id`'s token: `state`'s owner, unless that state and the
        request's own are both plain (greedy, no stages), when nothing of the owner decides the pick."""
        if state.owner == request_id or not state.plain:
            return state.owner
        own = self.row_states.get(request_id)
        return request_id if own is not None and own.plain else state.owner

    def _processed(self, state: RowState, logits: torch.Tensor) -> tuple[torch.Tensor, tuple[str, ...] | None]:
        """The row's logits [V] after its stages (the logits themselves when it has none), and the
        requests whose tokens its penalties counted (None: no penalties); under penalty_shared_history
        the penalties read the whole batch's history."""
        if not state.stages:
            return logits, None
        if FaultName.PENALTY_SHARED_HISTORY in self.faults:
            owners = self.rows.batch_history_owners(state.params) if state.penalized else None
            return state.process(logits, self.rows.batch_history()), owners
        return state.process(logits), state.history_owners() if state.penalized else None

    def stop_reason(self, request: RequestState, token: int, max_len: int) -> FinishReason | None:
        """Why `request` stops after `token` (vLLM's order: min_tokens, EOS, a complete grammar, a stop
        string, max_new_tokens, the slot's max_len), or None. Stop strings are checked from the
        min_tokens-th token on (that check only notes how much text min_tokens passes over)."""
        params = request.sampling
        if len(request.generated_ids) < params.min_tokens:  # vLLM: no stop before min_tokens
            return FinishReason.LENGTH if request.cache_len + 1 > max_len else None
        if token in self.eos_token_ids and not params.ignore_eos:
            return FinishReason.STOP
        if params.structured is not None and self.grammar.terminated(request.request_id):
            return FinishReason.STOP  # its grammar is complete
        if params.stop and self.tokenizer is not None and self._stop_string(request):
            return FinishReason.STOP
        if len(request.generated_ids) >= params.max_new_tokens:
            return FinishReason.LENGTH
        if request.cache_len + 1 > max_len:  # the last token would not fit its slot
            return FinishReason.LENGTH
        return None

    def _stop_string(self, request: RequestState) -> bool:
        """Whether a stop string completes at the request's newest token, searched as vLLM searches
        (engine/stops.py: only the text this token added plus the overlap, nothing of the first
        min_tokens tokens' text); if so, note which and where the returned text ends (before it, or
        after it with include_stop_str_in_output)."""
        params = request.sampling
        if request.stop_scan is None:
            request.stop_scan = StopScan(params.stop, params.min_tokens, params.include_stop_str_in_output)
        text = self.tokenizer.decode(request.generated_ids, skip_special_tokens=True)
        found = request.stop_scan.update(text, len(request.generated_ids))
        if found is None:
            return False
        request.stop_str, request.text_end = found
        return True


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> tuple[tuple[int, float], ...]:
    """(token id, logprob) of the sampled `token`, then of the `k` most likely tokens (descending).

    Args:
        logits: [V] logits of the sampled position (any float dtype; computed in float32).
        token: the sampled id; k: how many of the most likely to add (0: none).
    Returns natural-log probabilities, log_softmax(logits) (as vLLM's raw logprobs and OpenAI's
    `logprob`): temperature, top-k and top-p do not change them.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    pairs = [(int(token), float(logp[token]))]
    if k:
        values, ids = torch.topk(logp, min(k, logp.shape[-1]))
        pairs += [(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist())]
    return tuple(pairs)


def gaps_and_finite(by_chunk: dict, logits: torch.Tensor | None = None, order=None) -> dict:
    """(top-1 minus top-2 logit, all finite) per chunk, computed for all sampling rows at once.

    Args:
        by_chunk: chunk index -> logits [V]; logits / order: the same rows as one [S, V] tensor and their
            chunk indices, when the caller has it (no stacking then).
    """
    if not by_chunk:
        return {}
    if logits is None:
        order = list(by_chunk)
        logits = torch.stack([by_chunk[c] for c in order])
    top2 = torch.topk(logits, 2, dim=1).values
    gaps = (top2[:, 0] - top2[:, 1]).tolist()
    # a row holding a NaN or an infinity has a non-finite sum; a finite row's float32 sum is finite unless it
    # overflows, so only rows whose sum is not finite are scanned value by value (one pass and no [S, V]
    # boolean temporary for the rest: isfinite + all took about 5 ms of a 16-row SmolLM2 step, the sum 0.2)
    finite = torch.isfinite(logits.sum(dim=1)).tolist()
    for row, ok in enumerate(finite):
        if not ok:
            finite[row] = bool(torch.isfinite(logits[row]).all())
    return {c: (g, f) for c, g, f in zip(order, gaps, finite)}
