"""`kvtui replay RECORDING`: a recording played back in the dashboard, or its summary."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from kvtui.cli.console import fail, out, say
from kvtui.events import Contamination


def replay(
    recording: Annotated[Path, typer.Argument(help="A JSONL recording made with --record.")],
    summary_only: Annotated[bool, typer.Option("--summary", help="Print the summary instead of the dashboard.")] = False,
    speed: Annotated[float, typer.Option(help="Dashboard playback speed (2 = twice as fast).", min=1 / 64,
                                         max=256)] = 1.0,
) -> None:
    """Play a recording back without loading a model: the dashboard (speed, pause, seek), or --summary."""
    from kvtui.record import RecordingError, read_recording
    from kvtui.summary import print_contamination, print_summary

    if not summary_only and sys.stdout.isatty() and sys.stderr.isatty():
        from kvtui.tui import replay_dashboard

        try:
            replay_dashboard(recording, speed=speed)
        except RecordingError as e:
            fail(str(e))
        return
    try:
        header, events, recorded, truncated = read_recording(recording)
    except RecordingError as e:
        fail(str(e))
    summary = replay_summary(header, events, recorded)
    if truncated:
        say("note", f"{recording} ends early (killed run?); replayed {len(events)} events")
    print_summary(summary, header, out)
    print_contamination([e for e in events if isinstance(e, Contamination)], out, recording=recording)


def replay_summary(header, events, recorded):
    """The summary recomputed from a recording's events (what the live run printed), with the fields
    only the live session knew taken from the recorded summary when there is one."""
    from kvtui.metrics import SLO, Metrics

    slo = header.scenario.get("slo") or {}
    metrics = Metrics(SLO(slo.get("ttft_s"), slo.get("tpot_s")))
    for event in events:
        metrics.add_event(event)
    session_fields = {}
    if recorded is not None:
        session_fields = {k: getattr(recorded, k) for k in ("faults_active_at_end", "contamination_by_fault", "fault_acts",
                                                            "stopped_early", "requests_not_submitted",
                                                            "request_id_audit", "load_fidelity")}
    return metrics.summary(t=recorded.t if recorded is not None else None, **session_fields)
