"""slot_taint and attention_flow: turn the engine's per-step TaintEntry / FlowEntry / NonfiniteEntry
into events, once per (detector, victim, source) so a leak that lasts many steps is one event with its
first step.

Non-finite values do not blind them: when a request's logits are not finite, the engine names the
writers of the NaN/inf K/V the request was allowed to read (NonfiniteEntry). Another request's
positions make it a `cross_request` event naming that request, from both detectors; its own or
never-written positions make it `corruption`. A NaN attention mass is never compared with the
threshold: the non-finite report stands for it.
"""

from __future__ import annotations

import math

from kvtui.detect.observer import Quiet, StepSeen
from kvtui.events import Contamination, EngineErrorEvidence, FlowEvidence, TaintEvidence, TaintExample

FLOW_THRESHOLD = 1e-6  # attention mass on foreign keys; exactly 0.0 with isolation intact


class EngineSignalDetector:
    """Reads StepEvent.taint, .flow and .nonfinite (the engine computes them when switched on)."""

    def __init__(self, *, taint: bool = True, flow: bool = True) -> None:
        self.taint = taint
        self.flow = flow
        self.kv = "slots"
        self._seen: set[tuple] = set()

    def on_step(self, report, t: float) -> list[Contamination]:
        """Events for a StepEvent's taint, flow and non-finite entries."""
        self.kv = getattr(report, "kv", "slots")  # paged KV: examples are (block, offset, writer)
        events = []
        if self.taint:
            events += [self._taint(r, report.step, t) for r in report.taint]
        if self.flow:
            events += [self._flow(f, report.step, t) for f in report.flow
                       if math.isfinite(f.foreign_mass) and f.foreign_mass > FLOW_THRESHOLD]
        for read in report.nonfinite:
            events += self._nonfinite(read, report.step, t)
        return [e for e in events if e is not None]

    def _once(self, *key) -> bool:
        if key in self._seen:
            return False
        self._seen.add(key)
        return True

    def _taint(self, r, step: int, t: float) -> Contamination | None:
        source = r.sources[0]
        # never-written or pad positions, or its own writes where another's belong: self-damage
        kind = "corruption" if source.startswith("<") or source == r.request_id else "cross_request"
        if not self._once("slot_taint", r.request_id, source):
            return None
        return Contamination(t=t, step=step, detector="slot_taint", kind=kind, victim=r.request_id,
                             source=None if kind == "corruption" else source,
                             evidence=TaintEvidence(positions=r.positions, sources=r.sources,
                                                    examples=_examples(r, self.kv)))

    def _flow(self, f, step: int, t: float) -> Contamination | None:
        if not self._once("attention_flow", f.request_id, f.top_source):
            return None
        own = f.top_source == f.request_id  # its own later writes over a block it reads: self-damage
        return Contamination(t=t, step=step, detector="attention_flow", kind="corruption" if own else "cross_request",
                             victim=f.request_id, source=None if own else f.top_source,
                             evidence=FlowEvidence(foreign_mass=round(f.foreign_mass, 6), pad_mass=round(f.pad_mass, 6)))

    def _nonfinite(self, read, step: int, t: float) -> list[Contamination]:
        foreign = [s for s in read.sources if s != read.request_id and not s.startswith("<")]
        source = foreign[0] if foreign else None
        kind = "cross_request" if foreign else "corruption"
        events = []
        if self.taint and self._once("slot_taint", read.request_id, source, "nonfinite"):
            events.append(Contamination(
                t=t, step=step, detector="slot_taint", kind=kind, victim=read.request_id, source=source,
                evidence=TaintEvidence(positions=read.positions, sources=read.sources,
                                       examples=_examples(read, self.kv), nonfinite=True)))
        if self.flow and self._once("attention_flow", read.request_id, source, "nonfinite"):
            events.append(Contamination(
                t=t, step=step, detector="attention_flow", kind=kind, victim=read.request_id, source=source,
                evidence=FlowEvidence(foreign_mass=None, pad_mass=None, nonfinite=True)))
        return events


class EngineObserver(Quiet):
    """The engine's own signals as a local run's observer (kvtui/run/observers.py), always on: a step's
    errors (a `corruption` report from detector "engine" per failed request), then `slot_taint` and
    `attention_flow` when named (one EngineSignalDetector: their non-finite reports stay interleaved).

    Args:
        taint, flow: slot_taint, attention_flow on.
    """

    name = "engine"

    def __init__(self, *, taint: bool, flow: bool) -> None:
        self.detector = EngineSignalDetector(taint=taint, flow=flow)

    def on_step(self, step: StepSeen) -> list[Contamination]:
        report = step.report
        events = [Contamination(t=step.t, step=report.step, detector="engine", kind="corruption", victim=request_id,
                                evidence=EngineErrorEvidence(error=text)) for request_id, text in report.errors]
        return events + self.detector.on_step(report, step.t)


def _examples(r, kv: str) -> tuple[TaintExample, ...]:
    """The engine's (slot, position, writer) triples; with paged KV they are (block, offset, writer)."""
    if kv == "paged":
        return tuple(TaintExample(block=b, offset=o, written_by=w) for b, o, w in r.examples)
    return tuple(TaintExample(slot=s, pos=p, written_by=w) for s, p, w in r.examples)
