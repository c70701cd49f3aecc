"""What a run tells when it is over, and the verdict the scenario's `expect` gives it."""

from __future__ import annotations

from typing import NamedTuple, Protocol

from kvtui.events import Contamination, Summary
from kvtui.faults import inert_line


class RunOutcome(Protocol):
    """What `verdict` (and the CLI's closing lines) read of a run, a local Session or a TargetSession.

    Attributes:
        contamination: the run's contamination reports, each joined to its victim's finding.
        fault_history: (time in seconds, fault name, on) for every isolation fault switched during the
            run, those on from the start at time 0.
        faults_known: whether this run knows which faults were on (kvtui's own engine); a target
            server's faults are its own, so a target run's history is empty and says nothing.
        summary: the run's summary once it is closed, else None.
    """

    contamination: list[Contamination]
    fault_history: list[tuple[float, str, bool]]
    summary: Summary | None

    @property
    def faults_known(self) -> bool: ...


class Verdict(NamedTuple):
    """`failed`: the run contradicts the scenario's `expect` (the CLI exits 1, or 4 when `inert` says the
    run tested nothing); `reason`: one line saying why, or what held ("" when there is nothing to say)."""

    failed: bool
    reason: str


def verdict(spec, run: RunOutcome, expect_override: str | None = None) -> Verdict:
    """The scenario's `expect.contamination` ("none" or "detected"; `expect_override` replaces it)
    against what the run's detectors found (reports that count: not numeric)."""
    expect = expect_override or spec.expect.contamination
    found = [e for e in run.contamination if e.counts]
    # the summary's "contamination findings" (one per victim, every detector's report a witness), then the reports
    counted = f"{_plural(len({e.victim for e in found}), 'finding')} ({_plural(len(found), 'detector report')})"
    if expect == "none" and found:
        first = found[0]
        return Verdict(True, f"unexpected contamination: {counted}, first: {first.victim} <- "
                             f"{first.source or '?'} ({first.kind}, {first.detector}, step {first.step}); the "
                             "scenario expects none")
    if expect == "detected" and not found:
        acts = _fault_acts(run)
        on = "" if not run.faults_known else " (a fault was on)" if run.fault_history else " but no fault was on"
        if acts:
            on = f" ({', '.join(f'{name} acted in {n} steps' for name, n in acts.items())})"
        return Verdict(True, f"expected contamination to be detected{on}, yet no detector fired")
    if expect == "detected":
        return Verdict(False, f"contamination detected as expected: {counted}")
    return Verdict(False, "")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _fault_acts(run: RunOutcome) -> dict[str, int] | None:
    """The run's fault.acted counts per fault that was on (Summary.fault_acts), None when it has none."""
    return run.summary.fault_acts if run.faults_known and run.summary is not None else None


def inert(spec, run: RunOutcome, expect_override: str | None = None) -> list[str]:
    """When the scenario expects a detection, none came, and no fault that was on ever acted: one line per
    fault saying what it needed (kvtui.faults.inert_line). Such a run tested nothing, which is no detector
    miss (the CLI exits 4, not 1). [] otherwise."""
    acts = _fault_acts(run)
    expect = expect_override or spec.expect.contamination
    if expect != "detected" or not acts or any(acts.values()) or any(e.counts for e in run.contamination):
        return []
    return [inert_line(name) for name in acts]
