"""Findings: one per victim, with every detector report on it as a witness.

Several detectors often see the same leak: a stale slot is seen by slot_taint (the mask let the
victim read the previous owner's positions), attention_flow (it weighed them), canary (its answer
holds the owner's passphrase) and reference (its tokens left its solo run). Counting reports would
call one leak four; a finding is the victim, the kind and the sources its witnesses name.

The kind of a finding is the most specific its witnesses report: cross_tenant over cross_request
over corruption (and the request-id audit's hung, lost, stopped_serving) over unknown (a reference divergence that names no source joins a cross_request
finding when another detector names one for the same victim). Numeric reports are never findings.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvtui.events import Contamination

RANK = {"cross_tenant": 3, "cross_request": 2, "corruption": 1, "hung": 1, "lost": 1, "stopped_serving": 1, "unknown": 0}


@dataclass
class Finding:
    """One victim's finding: its id, kind, the sources its witnesses name, and the witnesses' detectors."""

    id: int
    victim: str
    kind: str
    first_step: int
    sources: list[str] = field(default_factory=list)
    detectors: list[str] = field(default_factory=list)


class Findings:
    """Joins contamination reports into findings (deterministic: replaying the events rebuilds it)."""

    def __init__(self) -> None:
        self._by_victim: dict[str, Finding] = {}

    def add(self, event: Contamination) -> Contamination:
        """Record a report; returns it with its finding id set (numeric reports are returned as they are)."""
        if not event.counts:
            return event
        finding = self._by_victim.get(event.victim)
        if finding is None:
            finding = Finding(len(self._by_victim) + 1, event.victim, event.kind, event.step)
            self._by_victim[event.victim] = finding
        if RANK.get(event.kind, 0) > RANK.get(finding.kind, 0):
            finding.kind = event.kind
        for source in (event.source or "").split(","):
            if source and source not in finding.sources:
                finding.sources.append(source)
        if event.detector not in finding.detectors:
            finding.detectors.append(event.detector)
        return event if event.finding == finding.id else event.model_copy(update={"finding": finding.id})

    def by_kind(self) -> dict[str, int]:
        """Findings per kind."""
        return dict(Counter(f.kind for f in self._by_victim.values()))

    def of(self, victim: str) -> Finding | None:
        return self._by_victim.get(victim)

    def __len__(self) -> int:
        return len(self._by_victim)

    def __iter__(self):
        return iter(self._by_victim.values())
