"""state_provenance: a hybrid model's request must start from the recurrent state of its own prefix. A
linear-attention layer keeps no K/V, only a conv and a recurrent state per request, so the state a request
starts from is all it knows of the positions before it: the zero state for a fresh start, the state after
its cached prefix on a prefix hit, its lead's state for a forked sequence.

The engine reports every start (StepEvent.state_starts, a StateStartEntry each; engine/state_side.py): the
request whose forward computed the state the request got (the state slot's last writer for a fresh start,
the checkpoint's writer on a hit), the positions that state covers and a digest of their key items, beside
the digest of the request's own first positions. With isolation intact they are equal. When they differ:

- the state came from another request: `cross_request`, victim <- that request (its writer; for a zero
  state kept under a boundary, the request that published the checkpoint);
- the state is the request's own but covers other positions (a preempted request re-admitted into its own
  unreset slot), or the zero state nobody published: `corruption`, no source.

One event per (victim, source), at the step of the start. A replayed recording holds the entries, so the
detector reports there as in the live run.
"""

from __future__ import annotations

from kvtui.detect.observer import Quiet, StepSeen
from kvtui.events import Contamination, StateEvidence


class StateProvenanceDetector:
    """Reads StepEvent.state_starts (hybrid models)."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, str | None]] = set()

    def on_step(self, report, t: float) -> list[Contamination]:
        """Events for the step's starts whose state does not cover the request's own prefix."""
        events = []
        for start in getattr(report, "state_starts", ()) or ():
            if start.matches:
                continue
            source = state_source(start)
            if (start.request_id, source) in self._seen:
                continue
            self._seen.add((start.request_id, source))
            events.append(Contamination(
                t=t, step=report.step, detector="state_provenance",
                kind="cross_request" if source is not None else "corruption", victim=start.request_id, source=source,
                evidence=StateEvidence(via=start.via, slot=start.slot, tokens=start.tokens, writer=start.writer,
                                       writer_tokens=start.writer_tokens, publisher=start.publisher,
                                       writer_key=start.writer_key, reader_key=start.reader_key)))
        return events

    def on_finish(self, request_id: str) -> None:
        self._seen = {pair for pair in self._seen if pair[0] != request_id}


def state_source(start) -> str | None:
    """The other request a mismatched start's state came from: its writer, else (a zero state kept under a
    boundary) the request that published it; None when neither is another request."""
    for name in (start.writer, start.publisher):
        if name and name != start.request_id:
            return name
    return None


class StateProvenanceObserver(Quiet):
    """`state_provenance` as a run's observer (kvtui/run/observers.py): each step's state starts; a finished
    request is forgotten."""

    name = "state_provenance"

    def __init__(self) -> None:
        self.detector = StateProvenanceDetector()

    def on_step(self, step: StepSeen) -> list[Contamination]:
        return self.detector.on_step(step.report, step.t)

    def on_finish(self, finished) -> list[Contamination]:
        self.detector.on_finish(finished.request_id)
        return []
