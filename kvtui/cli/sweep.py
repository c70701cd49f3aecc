"""`kvtui sweep SCENARIO --target URL`: one `--target` run per arrival rate, the table, the knee, the
pictures (kvtui/remote/sweep.py; docs/loadgen.md, Sweeps)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from kvtui.cli.console import EXIT_CONTAMINATION, EXIT_RUNTIME, err, fail, out, say
from kvtui.cli.inputs import load_scenario
from kvtui.cli.options import (
    TARGET,
    MaxConcurrency,
    Timeout,
    Tolerance,
    api_option,
    parse_detectors,
    served_model_option,
)
from kvtui.remote.sweep import SLO_SHARE, SweepPoint, doubling, point, retimed, slo_knee, throughput_knee


def parse_rates(text: str) -> list[float]:
    """A --rates value ("1,2,4,8") as rates in req/s, ascending; exit 2 with one line for a bad one."""
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        fail(f"--rates {text!r}: give rates in req/s, comma-separated, e.g. --rates 1,2,4,8")
    if not rates or any(not 0 < r <= 10_000 for r in rates):
        fail(f"--rates {text!r}: each rate must be above 0 and at most 10000 req/s, e.g. --rates 1,2,4,8")
    return sorted(set(rates))


def sweep(
    scenario: Annotated[Path, typer.Argument(help="Scenario YAML file: its requests, SLO and expect.")],
    target: Annotated[str, typer.Option("--target", help="The OpenAI-compatible server (http://HOST:PORT).")],
    rates: Annotated[Optional[str], typer.Option("--rates", help="Arrival rates to run (req/s), comma-separated, "
                                                 "e.g. 1,2,4,8.")] = None,
    until_slo: Annotated[bool, typer.Option("--until-slo", help="Double the rate from --start-rate until a run "
                                            "breaks the scenario's SLO (without one: until throughput stops "
                                            "rising) or passes --max-rate.")] = False,
    start_rate: Annotated[float, typer.Option("--start-rate", min=0.001, help="--until-slo: the first rate "
                                              "(req/s).")] = 1.0,
    max_rate: Annotated[float, typer.Option("--max-rate", min=0.001, max=10_000, help="--until-slo: the highest "
                                            "rate (req/s).")] = 64.0,
    slo_share: Annotated[float, typer.Option("--slo-share", min=0.0, max=1.0, help="A run holds the SLO when at "
                                             "least this share of its requests met it.")] = SLO_SHARE,
    record_dir: Annotated[Optional[Path], typer.Option("--record-dir", help="Write each run's recording here "
                                                       "(rate-R.jsonl, R the rate).")] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write the pictures to this .svg or .png file "
                                                 "(needs the plot extra: pip install 'kvtui\\[plot]').")] = None,
    terminal_plot: Annotated[bool, typer.Option("--terminal-plot/--no-terminal-plot", help="Draw the pictures "
                                                "in the terminal (needs the plot extra: pip install 'kvtui\\[plot]').")] = True,
    model: Annotated[Optional[str], typer.Option("--model", help="The tokenizer to plan with (default: the "
                                                 "scenario's model).")] = None,
    detectors: Annotated[str, typer.Option(help="Comma-separated: reference, canary, or 'none'.")] = "reference,canary",
    api: api_option("chat or completions endpoint (auto: chat when every prompt has text).") = TARGET.api,
    served_model: served_model_option("The model name to send (default: the first of /v1/models).")
    = TARGET.served_model,
    max_concurrency: MaxConcurrency = TARGET.max_concurrency,
    timeout: Timeout = TARGET.timeout_s,
    tolerance: Tolerance = TARGET.tolerance,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress line per run.")] = False,
    workers: Annotated[int, typer.Option("--workers", min=0, help="Send each run's load from this many Ray "
                                         "workers (pip install 'kvtui\\[ray]'), as kvtui run --target --workers; "
                                         "one Ray runtime for all runs. 0: this process sends.")] = 0,
    ray_address: Annotated[Optional[str], typer.Option("--ray", help="With --workers: the Ray cluster's address "
                                                       "(default: a local Ray runtime).")] = None,
) -> None:
    """Send a scenario's requests to a server at several arrival rates (Poisson, the same seed): one
    `--target` run per rate; print throughput, latency and goodput per rate, name the knee and draw it.

    Exit codes (as kvtui run --target): 0 as expected, 1 unexpected (or missed) contamination, 2 bad input, 3 none done.
    """
    from kvtui.cli import sweep_plot
    from kvtui.cli import target as command

    if (rates is None) == (not until_slo):
        fail("give --rates 1,2,4,8 or --until-slo (with --start-rate and --max-rate), one of the two")
    asked = parse_rates(rates) if rates is not None else doubling(start_rate, max_rate)
    if not asked:
        fail(f"--start-rate {start_rate:g} is above --max-rate {max_rate:g}")
    if plot is not None:
        if plot.suffix.lower() not in sweep_plot.FILE_SUFFIXES:
            fail(f"--plot {plot}: give a .svg or .png file")
        if sweep_plot.missing("matplotlib"):
            fail(f"--plot needs matplotlib: {sweep_plot.PLOT_EXTRA}")
    if workers or ray_address is not None:
        from kvtui.cli.run import _check_workers

        _check_workers(target, None, workers, ray_address)
    spec = load_scenario(scenario)
    chosen = command.target_detectors(parse_detectors(detectors), explicit=True)
    run = command.TargetRun(url=command.check_url(target), api=api, served_model=served_model,
                            max_concurrency=max_concurrency, timeout_s=timeout, tolerance=tolerance, logprobs=True,
                            workers=workers, ray_address=ray_address)
    command.reachable(run)
    if record_dir is not None:
        record_dir.mkdir(parents=True, exist_ok=True)
    has_slo = spec.slo.ttft_s is not None or spec.slo.tpot_s is not None
    if until_slo and not has_slo:
        say("note", f"{scenario} sets no slo: doubling until throughput stops rising (within 5%) instead")
    tokenizer, plan = _plan(spec, scenario, model)
    points, sessions = [], []
    with _ray_runtime(run):
        _runs(spec, scenario, run, tokenizer, plan, asked, record_dir, chosen, points, sessions, until_slo=until_slo,
              has_slo=has_slo, slo_share=slo_share, quiet=quiet)
    knee = slo_knee(points, slo_share) if has_slo else None
    plateau = throughput_knee(points)
    print_table(points, slo_share if has_slo else None)
    _print_knees(spec, points, knee, plateau, has_slo, slo_share)
    _draw(points, knee_to_draw(points, knee, plateau, has_slo), plot, terminal_plot,
          title=f"{spec.name} against {run.url}")
    _exit(spec, sessions, points)


def _runs(spec, scenario: Path, run, tokenizer, plan, asked: list[float], record_dir: Path | None, chosen,
          points: list, sessions: list, *, until_slo: bool, has_slo: bool, slo_share: float, quiet: bool) -> None:
    """One run per rate asked (appended to `points` and `sessions`), until --until-slo's stop; a Ctrl-C or
    SIGTERM prints the table of the runs before it and exits 128 + the signal's number."""
    for k, rate in enumerate(asked):
        record = record_dir / f"rate-{rate:g}.jsonl" if record_dir is not None else None
        p, session, stopped = _one_run(spec, scenario, run, tokenizer, retimed(plan, rate, spec.seed), rate, record,
                                       chosen, label=f"[{k + 1}/{len(asked)}]", quiet=quiet)
        if stopped.signum is not None:  # Ctrl-C / SIGTERM: the runs so far, then 128 + the signal's number
            print_table(points, slo_share if has_slo else None)
            say("error", f"interrupted by {stopped.name} during the {rate:g} req/s run; the table covers the runs "
                         f"before it (exit {stopped.exit_code})")
            raise typer.Exit(stopped.exit_code)
        points.append(p)
        sessions.append(session)
        if until_slo and (not p.holds(slo_share) if has_slo else throughput_knee(points) is not points[-1]):
            break


@contextlib.contextmanager
def _ray_runtime(run):
    """With --workers: one Ray runtime (local, or the cluster at --ray) for every run of the sweep, shut down
    after the last (each run's workers are its own); nothing otherwise."""
    if not run.workers:
        yield
        return
    import ray

    from kvtui.remote.reach import TargetError
    from kvtui.remote.workers import init_ray

    if ray.is_initialized():
        yield
        return
    try:
        init_ray(run.ray_address, run.workers)
    except TargetError as e:
        fail(str(e))
    try:
        yield
    finally:
        ray.shutdown()


def sweep_session(spec, run, tokenizer, planned: list, rate: float, record: Path | None, detectors):
    """The session of one sweep run at `rate`: a TargetSession sending `planned` (the plan re-timed to the
    rate), or with --workers a RayTargetSession whose driver and workers re-time the seeded plan alike.

    Raises:
        OSError: the recording cannot be created. ValueError: as TargetSession / RayTargetSession.
    """
    from kvtui.cli import target as command
    from kvtui.remote.session import TargetSession

    if run.workers:
        from kvtui.remote.workers import RayTargetSession

        return RayTargetSession(spec, tokenizer, command.target_options(run), workers=run.workers,
                                address=run.ray_address, rate=rate, record_path=record, detectors=detectors,
                                model=spec.model)
    return TargetSession(spec, tokenizer, command.target_options(run), record_path=record, detectors=detectors,
                         planned=planned, model=spec.model)


def _plan(spec, scenario: Path, model: str | None):
    """The tokenizer and the scenario's planned requests (one line and exit 2 when they cannot be made)."""
    from kvtui.models import ModelLoadError, load_tokenizer
    from kvtui.scenario import plan_requests

    try:
        tokenizer = load_tokenizer(model or spec.model)
    except ModelLoadError as e:
        fail(str(e))
    plan = plan_requests(spec, tokenizer)
    if not plan:
        fail(f"{scenario}: the scenario plans no request; check max_requests, duration_s and the arrivals")
    return tokenizer, plan


def _one_run(spec, scenario: Path, run, tokenizer, planned, rate: float, record: Path | None, detectors, *,
             label: str, quiet: bool):
    """One --target run at `rate` with `planned`; its SweepPoint, session and StopSignal (a Ctrl-C or
    SIGTERM stops the run as it stops `kvtui run`). A progress line before and one after it on stderr."""
    from kvtui.cli.finish import install_stop_handlers
    from kvtui.remote.session import TargetError
    from kvtui.run.outcome import verdict

    try:
        session = sweep_session(spec, run, tokenizer, planned, rate, record, detectors)
    except OSError as e:
        fail(f"{record}: cannot write the recording ({e.strerror or e}); choose another --record-dir")
    except ValueError as e:
        fail(f"{scenario}: {e}")
    if not quiet:
        err.print(f"{label} {rate:g} req/s: {len(planned)} requests over {planned[-1].arrival_s:.1f} s planned",
                  highlight=False)
    stopped = install_stop_handlers(session)
    try:
        summary = session.run()
    except TargetError as e:
        session.abandon()
        fail(str(e))
    failed, _ = verdict(spec, session)
    p = point(rate, summary, session.contamination, failed, session.load_fidelity)
    if not quiet:
        err.print(f"{label} {rate:g} req/s: achieved {_num(p.achieved)} req/s, {p.output_tok_s:.1f} tok/s, "
                  f"TTFT p50 {_num(_ms(p.ttft_p50_s), 0)} ms, goodput {p.goodput:.2f} req/s, "
                  f"{p.findings} findings" + (f"{'; recording ' + str(record) if record else ''}"), highlight=False)
    if session.recording_error:
        say("error", f"{session.recording_error}; the run went on without it")
    return p, session, stopped


def _ms(value: float | None) -> float | None:
    return value * 1000 if value is not None else None


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


GOODPUT_CAPTION = "achieved = (sent - 1) / span of the sends; goodput = achieved x SLO met / sent"


def print_table(points: list[SweepPoint], slo_share: float | None) -> None:
    """The sweep's table on stdout: one row per rate. `slo_share` None: the scenario has no SLO (the
    goodput column counts every completed request)."""
    table = Table(title="sweep (achieved and goodput: req/s over one time, the span of the client's sends)",
                  title_justify="left", caption=GOODPUT_CAPTION, caption_justify="left")
    for name in ("rate asked", "achieved", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "goodput",
                 "SLO met", "findings", "fidelity"):
        table.add_column(name, justify="left" if name == "fidelity" else "right")
    for p in points:
        met = f"{p.good}/{p.sent}" + ("" if slo_share is None else " ok" if p.holds(slo_share) else " broken")
        table.add_row(f"{p.rate:g}", _num(p.achieved), f"{p.output_tok_s:.1f}", _num(_ms(p.ttft_p50_s), 1),
                      _num(_ms(p.ttft_p99_s), 1), _num(_ms(p.tpot_p50_s), 1), f"{p.goodput:.2f}", met,
                      str(p.findings), "warned" if p.warning else "ok")
    out.print(table)
    for p in points:
        if p.warning:
            out.print(f"{p.rate:g} req/s: {p.warning}", markup=False, highlight=False, soft_wrap=True)


def knee_to_draw(points, knee, plateau, has_slo: bool):
    """The point the pictures mark as the knee: the SLO's knee with an slo, else where throughput stopped
    rising; None when throughput still rose at the highest rate run (the table says "no plateau yet", so the
    picture marks none: it marked the highest rate as if it were the knee)."""
    if has_slo:
        return knee
    return None if plateau is None or plateau is max(points, key=lambda p: p.rate) else plateau


def _print_knees(spec, points, knee, plateau, has_slo: bool, share: float) -> None:
    limits = ", ".join(f"{name} <= {value:g} s" for name, value in (("TTFT", spec.slo.ttft_s),
                                                                    ("TPOT", spec.slo.tpot_s)) if value is not None)
    if has_slo and knee is None:
        out.print(f"knee: none: the lowest rate, {points[0].rate:g} req/s, already broke the SLO ({limits} for "
                  f"{share:.0%} of requests)", markup=False, highlight=False, soft_wrap=True)
    elif has_slo:
        broke = next((p for p in sorted(points, key=lambda p: p.rate) if not p.holds(share)), None)
        after = f"; {broke.rate:g} req/s broke it" if broke is not None else "; no rate run broke it"
        out.print(f"knee: {knee.rate:g} req/s, the highest rate that held the SLO ({limits} for {share:.0%} of "
                  f"requests; goodput {knee.goodput:.2f} req/s){after}", markup=False, highlight=False, soft_wrap=True)
    if plateau is not None:
        last = plateau is max(points, key=lambda p: p.rate)
        said = ("throughput still rose at every rate run: no plateau yet" if last else
                f"throughput stopped rising after {plateau.rate:g} req/s ({plateau.output_tok_s:.1f} tok/s; the next "
                "rate added 5% or less)")
        out.print(("" if has_slo else "knee (no slo in the scenario): ") + said, markup=False, highlight=False, soft_wrap=True)


def _draw(points, knee, plot: Path | None, terminal: bool, title: str) -> None:
    from kvtui.cli import sweep_plot

    if terminal:
        if sweep_plot.missing("plotext"):
            say("note", f"the terminal plot needs plotext: {sweep_plot.PLOT_EXTRA}")
        else:
            import shutil

            width = min(shutil.get_terminal_size((120, 24)).columns, 160)
            print(sweep_plot.terminal_plot(points, knee, width=width, color=out.is_terminal))
    if plot is not None:
        try:
            sweep_plot.write_plot(points, knee, plot, title=title)
        except OSError as e:
            fail(f"--plot {plot}: cannot write it ({e.strerror or e})", EXIT_RUNTIME)
        out.print(f"plot: {plot}", markup=False, highlight=False, soft_wrap=True)


def _exit(spec, sessions, points) -> None:
    """Exit as `kvtui run --target` does, over all runs: 3 when no request completed in any, 1 when some
    run's findings went against the scenario's `expect` (the first such run's reason), else 0."""
    from kvtui.run.outcome import verdict

    if not any(p.completed for p in points):
        fail("no request completed in any run, so nothing was tested", EXIT_RUNTIME)
    for p, session in zip(points, sessions):
        failed, reason = verdict(spec, session)
        if failed:
            err.print(f"[bold red]{p.rate:g} req/s: {escape(reason)}[/]", highlight=False)
            raise typer.Exit(EXIT_CONTAMINATION)
