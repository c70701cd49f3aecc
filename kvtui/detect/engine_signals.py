"""slot_taint and attention_flow: turn the engine's per-step TaintReport / FlowReport into events,
once per (victim, source) pair so a leak that lasts many steps is one event with its first step."""

from __future__ import annotations

from kvtui.events import Contamination, FlowEvidence, TaintEvidence, TaintExample

FLOW_THRESHOLD = 1e-6  # attention mass on foreign keys; exactly 0.0 with isolation intact


class EngineSignalDetector:
    """Reads StepReport.taint and StepReport.flow (the engine computes them when switched on)."""

    def __init__(self, *, taint: bool = True, flow: bool = True) -> None:
        self.taint = taint
        self.flow = flow
        self._seen: set[tuple] = set()

    def on_step(self, report, t: float) -> list[Contamination]:
        """Events for a StepReport's taint and flow entries (each (detector, victim, source) once)."""
        events = []
        if self.taint:
            for r in report.taint:
                source = r.sources[0]
                # never-written or pad positions, or its own writes where another's belong: self-damage
                kind = "corruption" if source.startswith("<") or source == r.request_id else "cross_request"
                key = ("slot_taint", r.request_id, source)
                if key in self._seen:
                    continue
                self._seen.add(key)
                events.append(Contamination(
                    t=t, step=report.step, detector="slot_taint", kind=kind, victim=r.request_id,
                    source=None if kind == "corruption" else source,
                    evidence=TaintEvidence(positions=r.positions, sources=r.sources,
                                           examples=_examples(r.examples, getattr(report, "kv", "slots")))))
        if self.flow:
            for f in report.flow:
                if f.foreign_mass <= FLOW_THRESHOLD:
                    continue
                key = ("attention_flow", f.request_id, f.top_source)
                if key in self._seen:
                    continue
                self._seen.add(key)
                own = f.top_source == f.request_id  # its own later writes over a block it reads: self-damage
                events.append(Contamination(
                    t=t, step=report.step, detector="attention_flow", kind="corruption" if own else "cross_request",
                    victim=f.request_id, source=None if own else f.top_source,
                    evidence=FlowEvidence(foreign_mass=round(f.foreign_mass, 6), pad_mass=round(f.pad_mass, 6))))
        return events


def _examples(examples, kv: str) -> tuple[TaintExample, ...]:
    """The engine's (slot, position, writer) triples; with paged KV they are (block, offset, writer)."""
    if kv == "paged":
        return tuple(TaintExample(block=b, offset=o, written_by=w) for b, o, w in examples)
    return tuple(TaintExample(slot=s, pos=p, written_by=w) for s, p, w in examples)
