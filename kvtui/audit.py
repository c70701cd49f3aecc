"""noninterference audit (`kvtui audit`) on kvtui's own engine: the shared audit (kvtui/run/
noninterference.py) over local runs. Runs on the virtual clock, so arrival times and step pacing are
identical across the three runs, and every kept request must produce exactly the same tokens.
"""

from __future__ import annotations

from kvtui.events import Contamination, Finish, StepEvent
from kvtui.run.noninterference import AuditRun, Change, run_noninterference
from kvtui.session import Session


class LocalSubject:
    """The audit's runs on kvtui's engine (kvtui.run.noninterference.AuditSubject): an answer is the
    request's token ids; who could reach it, the requests co-batched with it in some step; a
    replacement prompt may grow as far as the engine's max_len leaves room beside its output."""

    def __init__(self, spec, loaded, faults: tuple[str, ...]) -> None:
        self.spec, self.loaded, self.faults = spec, loaded, faults
        self.tokenizer = loaded.tokenizer
        self.max_len = 0

    def run(self, planned: list | None) -> AuditRun:
        session = Session(self.spec, self.loaded, clock="virtual", detectors=(), faults=self.faults, planned=planned)
        self.max_len = session.config.max_len
        run = AuditRun(planned=list(session.pending), answers={})
        neighbours: dict[str, set[str]] = {}
        session.listeners.append(lambda e: _note(e, neighbours, run.answers))
        session.run()
        run.neighbours = {rid: tuple(sorted(ids)) for rid, ids in neighbours.items()}
        return run

    def room(self, planned) -> int:
        return self.max_len - len(planned.prompt_ids) - planned.sampling.max_new_tokens

    def compare(self, baseline: list[int], changed: list[int]) -> Change | None:
        if baseline == changed:
            return None
        first = next((i for i, (x, y) in enumerate(zip(baseline, changed)) if x != y), min(len(baseline), len(changed)))
        decode = self.tokenizer.decode
        return Change(index=first, kind="cross_request", baseline_text=decode(baseline, skip_special_tokens=True),
                      changed_text=decode(changed, skip_special_tokens=True))


def _note(event, neighbours: dict[str, set[str]], outputs: dict[str, list[int]]) -> None:
    """Collect each request's co-batched neighbours (step events) and output tokens (finish events)."""
    if isinstance(event, Finish):
        outputs[event.request_id] = list(event.output_ids)
    elif isinstance(event, StepEvent):
        ids = [r.request_id for r in event.running]
        for rid in ids:
            neighbours.setdefault(rid, set()).update(i for i in ids if i != rid)


def run_audit(spec, loaded, *, faults: tuple[str, ...] = (), console=None) -> list[Contamination]:
    """Three virtual-clock runs (baseline, evens replaced, odds replaced); returns contamination
    events (kind cross_request, detector noninterference) for every kept request whose tokens changed.

    Raises:
        ValueError: a bad engine value or fault name (kvtui.session.Session).
    """
    return run_noninterference(LocalSubject(spec, loaded, faults), console=console).events
