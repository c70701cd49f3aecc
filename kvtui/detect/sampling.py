"""sampling_provenance: every token must be sampled with its own request's sampling state alone. The
engine tags each sampled token, as it tags each KV position with its writer (kvtui.engine.row_state,
`SampledWith`, in `RunningEntry`):

- `sampled_with`: the request whose row state (params, bias, bans, min_tokens, temperature, stages)
  picked it; another request under row_state_misalign (the row arrays were cut at their end when a
  row left, so a row behind it reads its neighbour's state), unless both states are greedy with no
  stages (argmax either way: nothing of the other request decides the pick);
- `penalized_with`: the requests whose tokens the penalties counted; others besides the request under
  penalty_shared_history (every row's history) and row_state_misalign (the neighbour's history, which
  the victim's tokens then feed);
- `drawn_with`: the trail of the generator that drew a sampled token: who seeded it, then who else
  drew from it since; others under shared_rng (one generator, reseeded by each sampled request that
  joins) and row_state_misalign (the neighbour's own generator). A greedy token draws nothing.

With isolation intact each tag names only the request itself, and this detector reports nothing. A
token whose tags name another request is a `cross_request` report, victim <- source, the source being
the most direct cause (the row state's owner, else who seeded or first drew from the generator, else
the first other history in row order); the evidence keeps all three tags, and `via` says which of
them name the source. As slot_taint does, one report per (victim, source), at the first token it
reached. The reports join the victim's finding with the reference detector's (kvtui/detect/findings.py),
which sees the changed answer but not who changed it. A penalty history report may have no reference
witness: other rows' tokens moved the victim's logits without changing its pick.

Unlike `constraint`, which catches only a token the victim's own rules ban, this reads the engine's
tags: it names the source whatever the victim's parameters (a plain request under a neighbour's bans, a
penalized one counting its neighbours' words, a seeded one drawing from another's stream). Without the
tags (a replayed recording: they are in memory only) it has nothing to read.
"""

from __future__ import annotations

from kvtui.detect.observer import Finished, Quiet, StepSeen
from kvtui.events import Contamination, SamplingEvidence

VIA = ("row_state", "penalty_history", "generator")


class SamplingProvenanceDetector:
    """Reads StepEvent.running (each entry's sampled_with, penalized_with and drawn_with)."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()
        self._tokens: dict[str, int] = {}  # request id -> tokens sampled so far

    def on_finish(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)
        self._seen = {pair for pair in self._seen if pair[0] != request_id}

    def on_step(self, report, t: float) -> list[Contamination]:
        """Reports for the step's tokens sampled with another request's row state, penalty history or
        generator: once per (victim, source), the source being the first other request its tags name
        (foreign_sources' order); the evidence keeps every tag."""
        events = []
        for entry in report.running:
            if entry.token_id is None:
                continue
            index = self._tokens.get(entry.request_id, 0)
            self._tokens[entry.request_id] = index + 1
            if own_only(entry):
                continue
            foreign = foreign_sources(entry)
            source = next(iter(foreign), None)
            if source is None or (entry.request_id, source) in self._seen:
                continue
            self._seen.add((entry.request_id, source))
            events.append(Contamination(
                t=t, step=report.step, detector="sampling_provenance", kind="cross_request",
                victim=entry.request_id, source=source, evidence=SamplingEvidence(
                    via=foreign[source], token_index=index, token_id=entry.token_id, row_state=entry.sampled_with,
                    penalty_history=entry.penalized_with or (), generator=entry.drawn_with or ())))
        return events


class SamplingObserver(Quiet):
    """`sampling_provenance` as a run's observer (kvtui/run/observers.py): each step's sampling tags; a
    finished request is forgotten."""

    name = "sampling_provenance"

    def __init__(self) -> None:
        self.detector = SamplingProvenanceDetector()

    def on_step(self, step: StepSeen) -> list[Contamination]:
        return self.detector.on_step(step.report, step.t)

    def on_finish(self, finished: Finished) -> list[Contamination]:
        self.detector.on_finish(finished.request_id)
        return []


def own_only(entry) -> bool:
    """Whether a RunningEntry's sampling tags name no request but its own (the common case, checked
    without building anything)."""
    own = entry.request_id
    history, trail = entry.penalized_with, entry.drawn_with
    return (entry.sampled_with in (None, own) and (not history or history == (own,))
            and (trail is None or trail == (own,)))


def foreign_sources(entry) -> dict[str, tuple[str, ...]]:
    """Other requests in a RunningEntry's sampling tags -> the tags (VIA names) they appear in. Ordered
    by the most direct cause first: the row state's owner, then the generator's trail (who seeded it,
    then who drew from it, in order), then the penalty history (row order). Names in <angle brackets>
    are not requests."""
    victim = entry.request_id
    found: dict[str, list[str]] = {}
    tags = (("row_state", (entry.sampled_with,) if entry.sampled_with else ()),
            ("generator", entry.drawn_with or ()), ("penalty_history", entry.penalized_with or ()))
    for via, names in tags:
        for name in names:
            if name != victim and not name.startswith("<"):
                found.setdefault(name, []).append(via)
    return {source: tuple(v for v in VIA if v in vias) for source, vias in found.items()}
