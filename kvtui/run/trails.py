"""What a local run keeps of each running request for the checks that come after it, and which faults
were on at each engine step."""

from __future__ import annotations

import bisect
from collections import deque

from kvtui.faults import FAULTS


class Trails:
    """What a reference check needs of each running request, kept while it runs: the step of each of
    its tokens, the requests co-batched with it at that step, and its slot's earlier owners; and the
    faults on at each step (as spans), so a report is counted for the faults of the step it is about.

    Fed every engine step (`on_step`, a StepEvent); a finished request's trail is taken with `pop`; each
    report is counted with `count`.

    Attributes:
        fault_counts: fault name -> reports that count, counted for the faults on at their step (a
            summary's contamination_by_fault).
        acted: fault name -> the steps it acted in (a StepEvent's `acted`, recorded as fault.acted events).
    """

    last_step = -1

    def __init__(self) -> None:
        self.steps: dict[str, list[int]] = {}
        self.cobatched: dict[str, list[tuple[str, ...]]] = {}
        self.earlier: dict[str, tuple[str, ...]] = {}
        self.slot_owners: dict[int, deque] = {}
        self.fault_spans: list[tuple[int, frozenset]] = []  # (first step, faults on from it), one per change
        self.fault_counts: dict[str, int] = {}
        self.acted: dict[str, int] = {}

    def faults_at(self, step: int | None, now: frozenset) -> frozenset:
        """The faults on during engine step `step` (`now` for a report about no step or a step to come)."""
        spans = self.fault_spans
        if step is None or step < 0 or not spans or step > self.last_step:
            return now
        at = bisect.bisect_right(spans, step, key=lambda span: span[0]) - 1
        return spans[at][1] if at >= 0 else frozenset()

    def count(self, report, now: frozenset) -> None:
        """A contamination report that counts, counted for the faults on at the step it is about (a
        reference check comes later than its step; `now`: the faults on now)."""
        if report.counts:
            for name in self.faults_at(report.step, now):
                self.fault_counts[name] = self.fault_counts.get(name, 0) + 1

    def on_step(self, report) -> None:
        """Note one engine step (a StepEvent): its faults, each running request's slot on its first
        step, and each sampled token's step and co-batched requests."""
        faults = frozenset(report.faults)
        if (self.fault_spans[-1][1] if self.fault_spans else frozenset()) != faults:
            self.fault_spans.append((report.step, faults))
        self.last_step = report.step
        for acted in report.acted:
            self.acted[acted.fault] = self.acted.get(acted.fault, 0) + 1
        ids = [r.request_id for r in report.running]
        for r in report.running:
            if r.request_id not in self.earlier:
                owners = self.slot_owners.setdefault(r.slot, deque(maxlen=4))
                self.earlier[r.request_id] = tuple(owners)
                owners.append(r.request_id)
            if r.token_id is not None:
                self.steps.setdefault(r.request_id, []).append(report.step)
                self.cobatched.setdefault(r.request_id, []).append(tuple(i for i in ids if i != r.request_id))

    def pop(self, request_id: str) -> tuple[tuple[int, ...], tuple[tuple[str, ...], ...], tuple[str, ...]]:
        """A finished request's (steps of its tokens, co-batched requests at each, earlier slot owners),
        forgotten here."""
        return (tuple(self.steps.pop(request_id, ())), tuple(self.cobatched.pop(request_id, ())),
                self.earlier.pop(request_id, ()))

    def fault_acts(self, fault_history) -> dict[str, int] | None:
        """The steps each engine fault that was on acted in (0: it never acted), by name, from the run's
        `fault_history` ((time, name, on) per switch); None when none was on (a summary's fault_acts)."""
        names = sorted({name for _, name, on in fault_history if on and FAULTS[name].scope == "engine"})
        return {name: self.acted.get(name, 0) for name in names} or None
