"""The events a local run makes of one engine step (kvtui.engine's StepEvent), pure functions of the step.

- `token_pieces`: each sampled token's text, decoded alone (the step event carries it, so a replay needs
  no tokenizer, and the observers read it);
- `step_events`: the step event with those texts, then a fault.acted per fault that acted in the step, a
  marker per stale start (stale_slot) and per stale bitmask row (stale_bitmask), then a
  request.first_token per request that got its first token;
- `finish_of`: the request.finish event of a finished request's report.

The Session (kvtui/session.py) emits them in that order; kvtui/run/build.py builds the events both kinds
of run share.
"""

from __future__ import annotations

from kvtui.events import Finish, FirstToken, Marker, StepEvent
from kvtui.run.build import finish_event


def token_pieces(report: StepEvent, tokenizer) -> list[tuple[str, str]]:
    """(request id, the text of its sampled token) for each request that sampled one in `report`, in
    the step's running order."""
    return [(r.request_id, tokenizer.decode([r.token_id], skip_special_tokens=True))
            for r in report.running if r.token_id is not None]


def step_with_pieces(report: StepEvent, pieces: dict[str, str]) -> StepEvent:
    """The engine's step with each sampled token's text (`piece`, by request id) filled in: the event the
    session records (its finished requests get their own request.finish events)."""
    if not pieces:
        return report
    running = tuple(r.model_copy(update={"piece": pieces[r.request_id]}) if r.request_id in pieces else r
                    for r in report.running)
    return report.model_copy(update={"running": running})


def step_events(report: StepEvent, pieces: dict[str, str]) -> list:
    """The events of one step, in the order they are emitted: the step (with `pieces`), where the faults
    acted (fault.acted), the stale-start and stale-bitmask markers, the first tokens."""
    events: list = [step_with_pieces(report, pieces), *report.acted]
    for request_id, slot, previous, kept in report.stale_starts:
        events.append(Marker(t=report.t, text=f"{request_id} took slot {slot} stale: {kept} tokens of "
                                              f"{previous} kept (stale_slot)"))
    for request_id, previous, row in report.stale_masks:
        events.append(Marker(t=report.t, text=f"{request_id} sampled through bitmask row {row} as {previous}'s "
                                              "grammar left it (stale_bitmask)"))
    events += [FirstToken(t=report.t, request_id=r.request_id, ttft_s=r.ttft_s)
               for r in report.running if r.ttft_s is not None]
    return events


def finish_of(planned, f, tokenizer) -> Finish:
    """The request.finish event of the engine's finished report `f` (FinishedRequestReport): its canary
    and tenant from `planned`, the PlannedRequest it was submitted as (or `f` itself when there is none),
    its text decoded and cut where a stop string ended it (`f.text_end`)."""
    text = tokenizer.decode(list(f.output_ids), skip_special_tokens=True)[: f.text_end]
    return finish_event(planned, text=text, t=f.finish_s, finish_reason=f.finish_reason, detail=f.detail,
                        code=f.code or None, slot=f.slot, prompt_ids=f.prompt_ids, output_ids=f.output_ids,
                        arrival_s=f.arrival_s, scheduled_s=f.scheduled_s, first_token_s=f.first_token_s,
                        finish_s=f.finish_s, token_times_s=f.token_times_s)
