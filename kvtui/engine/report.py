"""Plain-data results of one engine step: copies, never live tensors, safe to hand to any thread.

The step itself is kvtui.events.StepEvent (with RunningEntry, TaintEntry, FlowEntry, NonfiniteEntry,
PrefixHitEntry, ReusedBlockEntry): the engine makes it and the session records it as it is, so a figure
has one name from the engine to the recording, the dashboard and the metrics. events.py imports nothing
of kvtui's but kvtui.faults, so the engine depends on it without an import running back up. Only what
never leaves the process lives here: FinishedRequestReport (it holds SamplingParams and draws; the
session records it as a request.finish event).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtui.events import (
    FlowEntry,
    NonfiniteEntry,
    PrefixHitEntry,
    ReusedBlockEntry,
    RunningEntry,
    StepEvent,
    TaintEntry,
)

__all__ = ["FinishedRequestReport", "FlowEntry", "NonfiniteEntry", "PrefixHitEntry", "ReusedBlockEntry",
           "RunningEntry", "StepEvent", "TaintEntry"]


@dataclass(frozen=True)
class FinishedRequestReport:
    """A request that left the engine during the step (finished, aborted, rejected or failed), in
    StepEvent.finished; the engine forgets it once this report is out. Its fields carry the names of
    the request.finish event the session makes of it.

    Attributes (besides the timestamps of RequestState, seconds on the engine clock):
        finish_reason, detail: a FinishReason value and one line on why; code: a FinishCode value for a
            rejection or an error, else "".
        stop_str, text_end: the stop string that ended it and how many characters of the decoded
            output to return (None: all).
        top2_gaps: top-1 minus top-2 logit at each generated token.
        sampling: its SamplingParams.
        faults: the faults active in any step it took part in.
        draws: sampling requests: the Draw of each generated token (uniform and the CDF around it);
            empty when greedy.
        input: the RequestInput it ran on (kvtui/engine/inputs.py), for a replay of the same input.
    """

    request_id: str
    finish_reason: str
    detail: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    slot: int | None
    arrival_s: float | None
    scheduled_s: float | None
    first_token_s: float | None
    finish_s: float | None
    token_times_s: tuple[float, ...]
    stop_str: str | None = None
    text_end: int | None = None
    top2_gaps: tuple[float, ...] = ()
    sampling: object = None
    faults: frozenset = frozenset()
    tenant: str | None = None
    code: str = ""
    draws: tuple = ()
    input: object = None
