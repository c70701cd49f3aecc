"""Per-request timelines (key `t`): one lane per request, one column per engine step. Plain Python, no
Textual: DashboardState feeds `Lanes` events, `lane_views` freezes the lanes of the latest steps.

A lane marks, at each step: `·` queued (arrived, not yet running), `P` a prefill chunk, `=` a decode step,
`h` a prefix-cache hit at admission, `T` blocks restored from the KV offload tier, `x` a preemption, `!` a
fault that acted on the request (fault.acted), `*` a detector's finding against it, `|` its finish. Where
two fall on one step the rarer wins (`*` over `!` over `x` over `T` over `h` over `P` over `=` over `·`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtui.events import Contamination, FaultActed, StepEvent

PRIORITY = "·=P|hTx!*"  # later wins
WINDOW = 240  # steps of marks a snapshot carries per lane


@dataclass
class _Lane:
    arrived: int  # the first step it could have run in
    marks: dict[int, str] = field(default_factory=dict)
    started: int | None = None  # the first step it ran in
    ended: int | None = None  # the step it finished in


@dataclass(frozen=True)
class LaneView:
    """One request's lane over the snapshot's window: `marks` (step, character) in step order, the queued
    steps included; `color` its palette index; `ended` the step it finished in, or None."""

    request_id: str
    color: int
    marks: tuple[tuple[int, str], ...]
    ended: int | None


class Lanes:
    """The lanes of every request the dashboard remembers, fed by DashboardState."""

    def __init__(self) -> None:
        self.lanes: dict[str, _Lane] = {}
        self.step = -1

    def _mark(self, request_id: str, step: int, char: str) -> None:
        lane = self.lanes.get(request_id)
        if lane is None:
            lane = self.lanes[request_id] = _Lane(step)
        old = lane.marks.get(step, "·")
        if PRIORITY.index(char) >= PRIORITY.index(old):
            lane.marks[step] = char

    def on_arrive(self, request_id: str) -> None:
        self.lanes.setdefault(request_id, _Lane(self.step + 1))

    def on_step(self, e: StepEvent) -> None:
        """The step's prefill chunks and decode steps, prefix hits and tier restores, preemptions."""
        self.step = e.step
        for r in e.running:
            self._mark(r.request_id, e.step, "P" if r.phase == "prefill" else "=")
            lane = self.lanes[r.request_id]
            lane.started = e.step if lane.started is None else lane.started
        for hit in e.prefix_hits:
            self._mark(hit.request_id, e.step, "T" if any(b.tier for b in hit.blocks) else "h")
        for rid in e.preempted:
            self._mark(rid, e.step, "x")

    def on_acted(self, e: FaultActed) -> None:
        for rid in e.request_ids:
            self._mark(rid, e.step, "!")

    def on_contamination(self, e: Contamination) -> None:
        if e.victim is not None:
            self._mark(e.victim, self.step if e.step is None else e.step, "*")

    def on_finish(self, request_id: str) -> None:
        lane = self.lanes.get(request_id)
        if lane is not None:
            lane.ended = self.step
            self._mark(request_id, self.step, "|")

    def forget(self, request_id: str) -> None:
        self.lanes.pop(request_id, None)


def lane_views(lanes: Lanes, colors: dict[str, int], limit: int) -> tuple[LaneView, ...]:
    """The lanes with a step in the last WINDOW steps, at most `limit`, the latest arrivals kept, in arrival
    order; a lane's queued steps (arrival to first run, `·`) filled in."""
    first = lanes.step - WINDOW + 1
    shown = [(rid, lane) for rid, lane in lanes.lanes.items() if lane.ended is None or lane.ended >= first]
    views = []
    for rid, lane in shown[-limit:]:  # only the lanes a snapshot carries are built (a snapshot per frame)
        queued_to = lane.started if lane.started is not None else lanes.step + 1
        marks = {s: "·" for s in range(max(lane.arrived, first), queued_to)}
        marks.update((s, c) for s, c in lane.marks.items() if s >= first)
        views.append(LaneView(rid, colors.get(rid, -1), tuple(sorted(marks.items())), lane.ended))
    return tuple(views)
