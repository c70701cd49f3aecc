"""The end of a headless run, local or --target: the stop signals, the last lines and the exit code."""

from __future__ import annotations

import signal
from pathlib import Path

import typer
from rich.markup import escape

from kvtui.cli.console import EXIT_CONTAMINATION, EXIT_INERT, EXIT_RUNTIME, err, out, say
from kvtui.run.outcome import inert, verdict


class StopSignal:
    """The signal that stopped a headless run: `signum` (None while none came), its `name` and the exit
    code a shell gives a process that signal ended, 128 + its number (130 SIGINT, 143 SIGTERM)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or 0)


def install_stop_handlers(session) -> StopSignal:
    """Ctrl-C / SIGTERM: set `session.stop_requested` (the engine stops after its current step, a target
    run stops sending and aborts what is in flight) and write the summary; a second one aborts.
    Returns the StopSignal that says which signal came."""
    stopped = StopSignal()

    def stop(signum, frame):
        if session.stop_requested:
            raise KeyboardInterrupt
        session.stop_requested = True
        stopped.signum = signum
        err.print(f"\n[yellow]{signal.Signals(signum).name}: stopping; writing the summary[/]")

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    return stopped


def finish_headless(spec, session, record: Path | None, stopped: StopSignal, expect_override: str | None = None,
                    untested: str | None = None) -> None:
    """The last lines and the exit code of a headless run (local or --target), first match wins:
    interrupted by a signal (128 + its number: 130 SIGINT, 143 SIGTERM), the recording stopped (3), no
    request completed (3: each was rejected, or none arrived; `untested` replaces the line that says so),
    then the scenario's `expect` (0 or 1; 4 when it expects a detection, none came, and no fault that was
    on ever acted)."""
    broken = session.recording_error
    if record and not broken:
        out.print(f"recording: {record}", markup=False, highlight=False)
    if broken:
        say("error", f"{broken}; the run went on without it (free space, or choose another --record path)")
    if stopped.signum is not None:
        summary = session.summary
        left = summary.requests_not_submitted if summary is not None else 0
        left = f"; {left} planned request{'s' if left != 1 else ''} not submitted" if left else ""
        say("error", f"interrupted by {stopped.name}: the run stopped early{left}; the summary above covers what "
                     f"ran (exit {stopped.exit_code})")
        raise typer.Exit(stopped.exit_code)
    if broken:
        raise typer.Exit(EXIT_RUNTIME)
    untested = nothing_completed(session.summary) if untested is None else untested
    if untested:
        say("error", untested)
        raise typer.Exit(EXIT_RUNTIME)
    lines = inert(spec, session, expect_override=expect_override)
    if lines:  # the fault never acted: the run tested nothing, which is no detector miss
        lines = ["expected contamination to be detected, yet no fault that was on ever acted: the run tested "
                 "nothing (exit 4; a detector miss, where a fault acted, exits 1)", *lines]
        for line in lines:
            err.print(f"[bold yellow]{escape(line)}[/]", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_INERT)
    failed, reason = verdict(spec, session, expect_override=expect_override)
    if failed:
        err.print(f"[bold red]{escape(reason)}[/]", highlight=False)
        raise typer.Exit(EXIT_CONTAMINATION)
    if reason:
        out.print(reason, markup=False, highlight=False)


def exit_if_signalled(signals: list[int]) -> None:
    """After a dashboard closed (its summary printed): when a signal stopped it (`signals`, as run_app
    reported it), the interrupted line and exit 128 + its number, as a headless run ends."""
    if not signals:
        return
    stopped = StopSignal()
    stopped.signum = signals[0]
    say("error", f"interrupted by {stopped.name}: the run stopped early; the summary above covers what ran "
                 f"(exit {stopped.exit_code})")
    raise typer.Exit(stopped.exit_code)


def nothing_completed(summary) -> str:
    """Why a run tested nothing (no request completed: each was rejected, or none arrived), one line
    with the rejections counted by code; "" when some request completed."""
    from kvtui.summary import finish_counts

    if summary is None or summary.requests_completed:
        return ""
    if not summary.requests_finished:
        return "no request arrived, so nothing was tested; check max_requests, duration_s and the arrivals"
    fix = ""
    codes = summary.rejection_reasons or {}
    if codes.get("too_long"):
        fix = "; raise engine.max_len or lower output_tokens (or set engine.on_too_long: cap)"
    elif codes.get("queue_full"):
        fix = "; raise engine.max_waiting or lower the arrival rate"
    if summary.rejections == summary.requests_finished:
        counted = ", ".join(f"{k} {v}" for k, v in sorted(codes.items()))
        return f"no request completed: all {summary.rejections} were rejected ({counted}), so nothing was tested{fix}"
    return f"no request completed ({finish_counts(summary)}), so nothing was tested{fix}"
