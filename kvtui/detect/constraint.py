"""constraint: every emitted token must be one its own request allowed. Recomputed from each
request's own parameters and its own tokens alone, step by step:

- `bad_words`: the token ends one of the request's bad-words sequences (its other tokens end the
  output so far; a one-token sequence always);
- `min_tokens`: the token is an EOS id (the request does not ignore EOS) while its output is still
  shorter than min_tokens;
- `logit_bias`: the request gave the token a bias of -100 (OpenAI: a ban).

A violation means the request was sampled with other state than its own. The engine tags each
sampled token with the request whose per-row state picked it (`RunningEntry.sampled_with`): when
that is another request, the report is `cross_request` with it as the source (the row arrays were
not moved when the batch changed: row_state_misalign); when it is the request's own, the engine broke
its own state (`corruption`); without the tag (a replayed recording) the suspects are the requests
running beside it, the source the only one whose own parameters allow the token. Which penalties
applied to a greedy row is left to `reference` (the engine does not keep the step's logits).

Structured output's bitmask rows carry provenance too, as KV positions carry their writer for
slot_taint: the engine notes which request's grammar last filled each row of its bitmask buffer, and a
step whose row was applied to another request (`StepEvent.stale_masks`: a plain request sampled
through a row another request's grammar filled, the stale_bitmask fault) is `cross_request` with that
request as the source.
One report per victim, at its first violation.
"""

from __future__ import annotations

from kvtui.detect.observer import Arrival, Finished, Quiet, StepSeen
from kvtui.events import ConstraintEvidence, Contamination


class ConstraintDetector:
    """Reads StepEvent.running; `on_arrive` gives it each request's SamplingParams.

    Args:
        eos_token_ids: the ids a min_tokens request may not emit early.
    """

    def __init__(self, eos_token_ids=()) -> None:
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self._params: dict[str, object] = {}
        self._outputs: dict[str, list[int]] = {}
        self._reported: set[str] = set()

    def on_arrive(self, request_id: str, sampling) -> None:
        self._params[request_id] = sampling
        self._outputs[request_id] = []

    def on_finish(self, request_id: str) -> None:
        self._params.pop(request_id, None)
        self._outputs.pop(request_id, None)
        self._reported.discard(request_id)

    def on_step(self, report, t: float) -> list[Contamination]:
        """Reports for the step's tokens that their own request did not allow, and for rows sampled
        through another request's bitmask row."""
        events = self._stale_masks(report, t)
        running = [r.request_id for r in report.running]
        for entry in report.running:
            params = self._params.get(entry.request_id)
            if entry.token_id is None or params is None:
                continue
            output = self._outputs[entry.request_id]
            rule = disallowed(params, output, entry.token_id, self.eos)
            if rule and entry.request_id not in self._reported:
                self._reported.add(entry.request_id)
                events.append(self._event(report, t, entry, rule, len(output), running))
            output.append(entry.token_id)
        return events

    def _stale_masks(self, report, t: float) -> list[Contamination]:
        tokens = {r.request_id: r.token_id for r in report.running}
        events = []
        for victim, source, row in getattr(report, "stale_masks", ()):
            if victim in self._reported:
                continue
            self._reported.add(victim)
            index = len(self._outputs.get(victim, ()))
            events.append(Contamination(
                t=t, step=report.step, detector="constraint", kind="cross_request", victim=victim, source=source,
                evidence=ConstraintEvidence(rule="grammar_bitmask", token_index=index, token_id=tokens.get(victim),
                                            suspects=(source,), bitmask_row=row)))
        return events

    def _event(self, report, t: float, entry, rule: str, index: int, running: list[str]) -> Contamination:
        victim, used = entry.request_id, entry.sampled_with
        suspects = tuple(sorted(r for r in running if r != victim))
        if used is not None and used != victim:
            kind, source = "cross_request", used
        elif used == victim:
            kind, source = "corruption", None
        else:
            allow = [r for r in suspects if r in self._params and
                     not disallowed(self._params[r], self._outputs[victim], entry.token_id, self.eos)]
            kind = "cross_request" if suspects else "corruption"
            source = allow[0] if len(allow) == 1 else None
        return Contamination(t=t, step=report.step, detector="constraint", kind=kind, victim=victim, source=source,
                             evidence=ConstraintEvidence(rule=rule, token_index=index, token_id=entry.token_id,
                                                         sampled_with=used, suspects=suspects))


class ConstraintObserver(Quiet):
    """`constraint` as a run's observer (kvtui/run/observers.py): each arrival's sampling parameters,
    each step's tokens; a finished request is forgotten.

    Args:
        eos_token_ids: the ids a min_tokens request may not emit early.
    """

    name = "constraint"

    def __init__(self, eos_token_ids=()) -> None:
        self.detector = ConstraintDetector(eos_token_ids)

    def on_arrive(self, arrival: Arrival) -> list[Contamination]:
        self.detector.on_arrive(arrival.request_id, arrival.sampling)
        return []

    def on_step(self, step: StepSeen) -> list[Contamination]:
        return self.detector.on_step(step.report, step.t)

    def on_finish(self, finished: Finished) -> list[Contamination]:
        self.detector.on_finish(finished.request_id)
        return []


def disallowed(params, output: list[int], token: int, eos: frozenset) -> str:
    """The rule of `params` that bans `token` after `output` ("bad_words", "min_tokens", "logit_bias"),
    or "" when it is allowed. Written apart from the engine's stages (kvtui/engine/row_state.py)."""
    for seq in getattr(params, "bad_words_ids", ()):
        n = len(seq) - 1
        if seq[-1] == token and len(output) >= n and (n == 0 or tuple(output[-n:]) == tuple(seq[:-1])):
            return "bad_words"
    if len(output) < getattr(params, "min_tokens", 0) and token in eos and not params.ignore_eos:
        return "min_tokens"
    if dict(getattr(params, "logit_bias", ())).get(token, 0.0) <= -100.0:
        return "logit_bias"
    return ""
