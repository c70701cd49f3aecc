"""kvtui command line: run, serve, replay, validate, bench, model."""

from __future__ import annotations

import enum
import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer
from rich.console import Console
from rich.markup import escape

from kvtui.config import Clock, DType, Layout
from kvtui.events import Contamination
from kvtui.faults import DEFAULT_ISOLATION_OFF, FAULT_NAMES, FAULTS, default_isolation_off
from kvtui.run.outcome import verdict
from kvtui.serve import API_KEY_ENV, DEFAULT_MAX_REQUEST_BYTES

Isolation = Literal["on", "off"]
Api = Literal["auto", "chat", "completions"]
CostModel = Literal["auto", "default"]
KvMode = Literal["slots", "paged"]
SaltMode = Literal["per_tenant", "none"]

app = typer.Typer(
    name="kvtui",
    help="Terminal load simulator for LLM batching, with a real PyTorch + transformers engine inside.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console(width=None if sys.stdout.isatty() else 120)
err = Console(stderr=True)

EXIT_OK, EXIT_CONTAMINATION, EXIT_BAD_INPUT, EXIT_RUNTIME = 0, 1, 2, 3


def say(label: str, text: str) -> None:
    """One line on stderr: `error: text`, `warning: text` or `note: text`. User text is shown as
    written: control characters escaped (\\n, \\x1b), rich markup characters taken literally."""
    from kvtui.scenario.errors import printable

    style = {"error": "bold red", "warning": "yellow", "note": "yellow"}.get(label, "bold")
    err.print(f"[{style}]{label}:[/] {escape(printable(text))}", highlight=False, soft_wrap=True)


def fail(message: str, code: int = EXIT_BAD_INPUT) -> None:
    """Print one line to stderr and exit with `code` (2 bad input, 3 runtime error)."""
    say("error", message)
    raise typer.Exit(code)


def _load_scenario(path: Path):
    """The scenario at `path`, its warnings printed; on errors one line each and exit 2."""
    from kvtui.scenario import ScenarioError, load_scenario

    try:
        spec = load_scenario(path)
    except ScenarioError as e:
        for line in e.errors:
            say("error", line)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    for line in spec.warnings:
        say("warning", line)
    return spec


def _load_model(name: str, dtype: str, device: str):
    from kvtui.models import ModelLoadError, load_model

    try:
        return load_model(name, dtype=dtype, device=device, progress=True)
    except ModelLoadError as e:
        fail(str(e))


FaultChoice = enum.Enum("FaultChoice", {name: name for name in FAULT_NAMES}, type=str)
DETECTORS_HELP = "Comma-separated detectors, or 'none'."
DEFAULT_DETECTORS = "reference,canary,attention_flow,slot_taint,prefix_provenance"


def _fault_names(chosen) -> tuple[str, ...]:
    return tuple(f.value for f in chosen or ())


def _detectors(text: str) -> tuple[str, ...]:
    from kvtui.detect import DETECTOR_NAMES

    chosen = () if text.strip() == "none" else tuple(d.strip() for d in text.split(",") if d.strip())
    unknown = [d for d in chosen if d not in DETECTOR_NAMES]
    if unknown:
        fail(f"--detectors: unknown detector {unknown[0]!r}; use some of {', '.join(DETECTOR_NAMES)} or 'none'")
    return chosen


# options `run --target` and `audit --target` share
MaxConcurrency = Annotated[int, typer.Option("--max-concurrency", min=1, help="With --target: requests in flight "
                                             "at most.", rich_help_panel="Target server")]
Timeout = Annotated[float, typer.Option("--timeout", min=0.001, help="With --target: seconds one request may take, "
                                        "no retry.", rich_help_panel="Target server")]
Tolerance = Annotated[float, typer.Option("--tolerance", min=0.0, help="With --target: top-2 logprob gap (nats) "
                                          "under which a changed token is numeric.", rich_help_panel="Target server")]


@app.command()
def run(
    scenario: Annotated[Path, typer.Argument(help="Scenario YAML file, e.g. scenarios/passphrase.yaml")],
    headless: Annotated[bool, typer.Option("--headless", help="No dashboard: run, print a summary, exit.")] = False,
    record: Annotated[Optional[Path], typer.Option("--record", help="Write a JSONL recording here.")] = None,
    model: Annotated[Optional[str], typer.Option("--model", help="Override the scenario's model: default, "
                                                 "tiny-llama, tiny-gpt2, a HF model directory or a .gguf file.")] = None,
    dtype: Annotated[Optional[DType], typer.Option(help="Override the scenario's dtype.")] = None,
    clock: Annotated[Optional[Clock], typer.Option(help="virtual (modeled step times: the same steps and tokens "
                                                   "on any machine; headless default), paced (virtual, held to real "
                                                   "time: a demo on the dashboard) or wall (real time). The "
                                                   "dashboard's default is the scenario's dashboard.clock (wall).")] = None,
    layout: Annotated[Optional[Layout], typer.Option(help="Override the engine layout.")] = None,
    device: Annotated[str, typer.Option(help="torch device, e.g. cpu or cuda.")] = "cpu",
    fault: Annotated[Optional[list[FaultChoice]], typer.Option("--fault", help="Turn an isolation fault on from "
                                                               "the start (repeatable); see `kvtui faults`.")] = None,
    isolation: Annotated[Isolation, typer.Option(help="'off' turns on the default fault set (stale_slot; with "
                                                 "paged KV block_refcount, or shared_position_offset without "
                                                 "prefix caching).")] = "on",
    clear_faults: Annotated[bool, typer.Option("--clear-faults", help="Drop the scenario's faults (engine.faults "
                                               "and timeline switches) and expect no contamination.")] = False,
    detectors: Annotated[str, typer.Option(help=DETECTORS_HELP)] = DEFAULT_DETECTORS,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress line.")] = False,
    prefix_caching: Annotated[Optional[bool], typer.Option("--prefix-caching/--no-prefix-caching",
                                                           help="Override engine.prefix_caching (paged KV; headless "
                                                           "runs), e.g. to compare a scenario with it on and off."
                                                           )] = None,
    cost_model: Annotated[CostModel, typer.Option(help="Virtual clock step costs: auto (this machine's `kvtui "
                                                  "calibrate` fit if there is one) or default (the built-in "
                                                  "fit).")] = "auto",
    target: Annotated[Optional[str], typer.Option("--target", help="Drive an OpenAI-compatible server at this "
                                                  "URL (http://HOST:PORT, with or without /v1) instead of "
                                                  "kvtui's engine.",
                                                  rich_help_panel="Target server")] = None,
    api: Annotated[Api, typer.Option(help="With --target: chat or completions endpoint (auto: chat when every "
                                     "prompt has text).", rich_help_panel="Target server")] = "auto",
    served_model: Annotated[Optional[str], typer.Option("--served-model", help="With --target: the model name "
                                                        "to send (default: the first of /v1/models).",
                                                        rich_help_panel="Target server")] = None,
    max_concurrency: MaxConcurrency = 64,
    timeout: Timeout = 120.0,
    tolerance: Tolerance = 0.5,
    logprobs: Annotated[bool, typer.Option("--logprobs/--no-logprobs", help="With --target: ask for top "
                                           "logprobs (labels reference divergences).",
                                           rich_help_panel="Target server")] = True,
) -> None:
    """Run a scenario on a real model: the dashboard, or --headless for CI. With --target, drive a real
    inference server (vLLM, SGLang, llama.cpp, TGI) over HTTP, black-box.

    Exit codes: 0 as expected; 1 contamination found while the scenario expects none, or a fault on and
    `expect: {contamination: detected}` but nothing detected; 2 bad input (also a scenario in which no
    request fits the engine, or a fault that cannot act in its layout or KV mode); 3 runtime error (the
    recording stopped, or no request completed); 130 / 143 interrupted by SIGINT / SIGTERM.
    """
    spec = _load_scenario(scenario)
    if target is not None:
        from kvtui.target import command

        command.refuse_engine_options(dict(fault=fault, isolation=isolation == "off", layout=layout, dtype=dtype,
                                           clear_faults=clear_faults, device=device != "cpu", clock=clock,
                                           prefix_caching=prefix_caching is not None))
        run_spec = command.TargetRun(url=command.check_url(target), api=api, served_model=served_model,
                                     max_concurrency=max_concurrency, timeout_s=timeout, tolerance=tolerance,
                                     logprobs=logprobs)
        chosen = command.target_detectors(_detectors(detectors), explicit=detectors != DEFAULT_DETECTORS)
        if not headless and not (sys.stdout.isatty() and sys.stderr.isatty()):
            say("note", "not a terminal: running headless (pass --headless to silence this).")
            headless = True
        if not headless:
            command.dashboard_target(spec, scenario, run_spec, model=model, record=record, detectors=chosen)
        else:
            command.run_target(spec, scenario, run_spec, model=model, record=record, detectors=chosen, quiet=quiet)
        return
    off = default_isolation_off(spec.engine.kv, spec.engine.prefix_caching) if isolation == "off" else ()
    faults = _fault_names(fault) + off
    chosen = _detectors(detectors)
    if not headless and not (sys.stdout.isatty() and sys.stderr.isatty()):
        say("note", "not a terminal: running headless (pass --headless to silence this).")
        headless = True
    if prefix_caching is not None:
        spec = _with_prefix_caching(scenario, spec, prefix_caching, headless)
    refuse_idle_faults(scenario, spec, _fault_names(fault), off, layout=layout, clear_faults=clear_faults,
                       prefix_caching=prefix_caching)
    options = dict(clock=clock, record=record, layout=layout, device=device, faults=faults, detectors=chosen,
                   clear_faults=clear_faults, cost_model=cost_model)
    if not headless:
        check_lengths(scenario, spec, _load_tokenizer(model or spec.model))
        _dashboard(scenario, model=model, dtype=dtype, **{**options, "clock": clock or spec.dashboard.clock})
        return
    loaded = _load_model(model or spec.model, dtype or spec.dtype, device)
    planned = check_lengths(scenario, spec, loaded.tokenizer)
    session = _session(spec, scenario, loaded, planned=planned, **{**options, "clock": clock or "virtual"})
    stopped = install_stop_handlers(session)
    summary = _run_headless(session, record, quiet)
    from kvtui.summary import print_contamination, print_summary

    print_summary(summary, session.header(), out)
    print_contamination(session.contamination, out, recording=record)
    if session.unapplied_timeline and stopped.signum is None:
        say("warning", f"{len(session.unapplied_timeline)} timeline event(s) came after the run's end and were not "
                       f"applied (first at {session.unapplied_timeline[0].at_s:g} s)")
    finish_headless(spec, session, record, stopped, expect_override="none" if clear_faults and not faults else None)


def finish_headless(spec, session, record: Path | None, stopped: StopSignal, expect_override: str | None = None,
                    untested: str | None = None) -> None:
    """The last lines and the exit code of a headless run (local or --target), first match wins:
    interrupted by a signal (128 + its number: 130 SIGINT, 143 SIGTERM), the recording stopped (3), no
    request completed (3: each was rejected, or none arrived; `untested` replaces the line that says so),
    then the scenario's `expect` (0 or 1)."""
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
    failed, reason = verdict(spec, session, expect_override=expect_override)
    if failed:
        err.print(f"[bold red]{escape(reason)}[/]", highlight=False)
        raise typer.Exit(EXIT_CONTAMINATION)
    if reason:
        out.print(reason, markup=False, highlight=False)


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


def _load_tokenizer(name: str):
    from kvtui.models import ModelLoadError, load_tokenizer

    try:
        return load_tokenizer(name)
    except ModelLoadError as e:
        fail(str(e))


def check_lengths(path: Path, spec, tokenizer) -> list:
    """Plan the scenario's requests and check that they fit the engine: exit 2 with one line when none
    does (every one would be rejected, so the run would test nothing), a warning line when some do
    not. Returns the planned requests."""
    from kvtui.scenario import plan_requests
    from kvtui.scenario.fit import fit_lines

    planned = plan_requests(spec, tokenizer)
    errors, warnings = fit_lines(spec, planned, str(path))
    for line in warnings:
        say("warning", line)
    if errors:
        fail(errors[0])
    return planned


def refuse_idle_faults(path: Path, spec, faults: tuple[str, ...] = (), off: tuple[str, ...] = (), *,
                       layout: str | None = None, clear_faults: bool = False,
                       prefix_caching: bool | None = None) -> None:
    """Exit 2 with one line for a fault that could not act in this run (so it would never fire and an
    `expect: detected` run would fail for nothing, an `expect: none` one pass for nothing): a --fault or
    --isolation off one outside the engine's layout or KV mode, or the scenario's own once --layout or
    --no-prefix-caching changed the engine. The line names what the fault needs."""
    from kvtui.faults import FAULTS
    from kvtui.scenario.fit import idle_faults

    e = spec.engine
    for name, where, why in idle_faults(spec, faults + off, layout, prefix_caching, scenario_faults=not clear_faults):
        fault = FAULTS[name]
        if e.kv not in fault.kv:
            need = f"a scenario with engine.kv: {fault.kv[0]}"
        elif "prefix_caching" in fault.needs and not e.prefix_caching:
            need = "--prefix-caching (or engine.prefix_caching: true)"
        else:
            need = f"--layout {fault.layouts[0]}"
        if where == "extra":
            flag = f"--isolation off ({name})" if name in off and name not in faults else f"--fault {name}"
            fail(f"{flag}: {why.removeprefix(f'fault {name} ')}, so it would never fire; use {need} "
                 "(`kvtui faults` lists where each fault acts)")
        changed = " and ".join(x for x in (f"--layout {layout}" if layout else "", "--no-prefix-caching"
                                           if prefix_caching is False else "") if x) or "these options"
        fail(f"{path}: {where}: {why} (with {changed}), so it would never fire; drop {changed}, or add "
             "--clear-faults to run without the scenario's faults")


def _with_prefix_caching(path: Path, spec, on: bool, headless: bool):
    """The scenario with engine.prefix_caching set to `on` (one line and exit 2 where it cannot be)."""
    if not headless:
        fail("--prefix-caching / --no-prefix-caching apply to --headless runs; edit engine.prefix_caching "
             "in the scenario for the dashboard")
    if on and spec.engine.kv != "paged":
        fail(f"{path}: --prefix-caching needs paged KV; set engine.kv: paged in the scenario")
    engine = spec.engine.model_copy(update={"prefix_caching": on})
    copy = spec.model_copy(update={"engine": engine})
    copy._base_dir = spec.base_dir
    return copy


def _session(spec, path: Path, loaded, **options):
    """build_session with input errors turned into one line and exit 2."""
    from kvtui.session import build_session

    try:
        return build_session(spec, loaded, **options)
    except OSError as e:
        fail(f"{options.get('record')}: cannot write the recording ({e.strerror}); choose another --record path")
    except ValueError as e:
        fail(f"{path}: {e}")


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


def _run_headless(session, record, quiet: bool):
    """Run to the end with a progress line on a terminal (steps, then the last reference checks,
    which Ctrl-C skips); a runtime failure keeps the recording and exits 3 with one line."""
    total = len(session.pending)
    try:
        if quiet or not err.is_terminal:
            return session.run()
        with err.status("starting") as status:
            def progress(s):
                status.update(f"step {s.metrics.steps}  finished {s.metrics.requests_finished}/{total}  "
                              f"running {s.engine.num_running}  waiting {s.engine.num_waiting}  "
                              f"t={s.engine.now():.1f}s")

            def references(checked: int, of: int):
                status.update(f"reference checks {checked}/{of} (Ctrl-C skips the rest)")
            return session.run(progress, on_reference=references)
    except Exception as e:  # a bug or a runtime failure, not a user mistake: keep the recording, say where
        session.close()
        fail(f"runtime error: {type(e).__name__}: {e} (recording kept{': ' + str(record) if record else ''})",
             EXIT_RUNTIME)


def _dashboard(scenario: Path, **options) -> None:
    """Run the live dashboard; input errors become one line and exit 2 (raised before the screen opens)."""
    from kvtui.models import ModelLoadError
    from kvtui.record import RecordingError
    from kvtui.scenario import ScenarioError
    from kvtui.summary import print_summary
    from kvtui.tui import run_dashboard

    closed: list = []
    try:
        summary, header = run_dashboard(scenario, on_closed=closed.append, **options)
    except ScenarioError as e:
        for line in e.errors:
            say("error", line)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    except (ModelLoadError, RecordingError, ValueError) as e:
        fail(str(e))
    except OSError as e:
        fail(f"{options.get('record')}: cannot write the recording ({e.strerror}); choose another --record path")
    except Exception as e:  # a bug or a runtime failure: one line, the recording kept
        fail(f"runtime error: {type(e).__name__}: {e}", EXIT_RUNTIME)
    if summary is not None:
        print_summary(summary, header, out)
    broken = closed[-1].recording_error if closed else ""
    if broken:
        fail(f"{broken}; the run went on without it (free space, or choose another --record path)", EXIT_RUNTIME)
    if options.get("record"):
        out.print(f"recording: {options['record']}", markup=False, highlight=False)


@app.command()
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
        session_fields = {k: getattr(recorded, k) for k in ("faults_active_at_end", "contamination_by_fault",
                                                            "stopped_early", "requests_not_submitted")}
    return metrics.summary(t=recorded.t if recorded is not None else None, **session_fields)


@app.command()
def validate(
    scenario: Annotated[Path, typer.Argument(help="Scenario YAML file.")],
    fault: Annotated[Optional[list[FaultChoice]], typer.Option("--fault", help="Check this fault too, as `kvtui "
                                                               "run --fault` would turn it on (repeatable).")] = None,
    layout: Annotated[Optional[Layout], typer.Option(help="Check with this engine layout, as `kvtui run --layout`."
                                                     )] = None,
    model: Annotated[Optional[str], typer.Option("--model", help="Plan the prompts with this model's tokenizer, "
                                                 "as `kvtui run --model`.")] = None,
) -> None:
    """Check a scenario and print it normalized (all defaults filled), or its errors (exit 2).

    Besides the fields, it refuses a scenario that would test nothing: one in which no planned request
    fits the engine (prompt + output above max_len: each would be rejected), or a fault that cannot act
    in its layout or KV mode; it warns when only some requests fit. Planning the prompts loads the
    model's tokenizer (not its weights)."""
    import yaml

    spec = _load_scenario(scenario)
    refuse_idle_faults(scenario, spec, _fault_names(fault), layout=layout)
    from kvtui.models import ModelLoadError, load_tokenizer

    try:
        tokenizer = load_tokenizer(model or spec.model)
    except ModelLoadError as e:
        say("note", f"request lengths not checked: {e}")
    else:
        check_lengths(scenario, spec, tokenizer)
    out.print(yaml.safe_dump(spec.normalized(), sort_keys=False), end="", highlight=False, markup=False)


@app.command()
def faults() -> None:
    """List the isolation faults, what each breaks, and the layouts and KV modes (slots, paged) it acts in."""
    from rich.table import Table

    table = Table(title="isolation faults (--fault NAME, timeline {fault: NAME, on: true}, dashboard key f)",
                  title_justify="left")
    for column in ("fault", "what it breaks", "layouts", "kv", "caught by"):
        table.add_column(column)
    for f in FAULTS.values():
        name = f.name + (" *" if f.name in DEFAULT_ISOLATION_OFF else "")
        table.add_row(name, f.breaks, ", ".join(f.layouts), ", ".join(f.kv), ", ".join(f.caught_by))
    table.caption = "* in the default set of --isolation off and the dashboard's i key"
    out.print(table)


@app.command()
def audit(
    scenario: Annotated[Path, typer.Argument(help="Scenario YAML file.")],
    model: Annotated[Optional[str], typer.Option("--model", help="Override the scenario's model.")] = None,
    fault: Annotated[Optional[list[FaultChoice]], typer.Option("--fault", help="Isolation fault on "
                                                               "(repeatable).")] = None,
    timing: Annotated[bool, typer.Option("--timing", help="Instead: the prefix-cache timing side channel (paged "
                                         "KV): how well TTFT tells apart probes whose prefix another tenant has "
                                         "cached, with and without per-tenant salts.")] = False,
    probes: Annotated[int, typer.Option(help="--timing: probes of each class (matching / not).", min=2,
                                        max=1000)] = 16,
    block_size: Annotated[Optional[int], typer.Option("--block-size", min=1, max=4096, help="--timing --target: "
                                                      "tokens per probe block when the server publishes no block "
                                                      "size (vLLM does, in vllm:cache_config_info); default 64.",
                                                      rich_help_panel="Target server")] = None,
    cache_salt: Annotated[SaltMode, typer.Option("--cache-salt", help="--timing --target: per_tenant: kvtui gives "
                                                 "each tenant its own cache_salt (does the server honour it?); "
                                                 "none: the tenants send no salt, as the deployment's clients do "
                                                 "(does something else separate them?).",
                                                 rich_help_panel="Target server")] = "per_tenant",
    target: Annotated[Optional[str], typer.Option("--target", help="Audit an OpenAI-compatible server at this "
                                                  "URL instead of kvtui's engine.",
                                                  rich_help_panel="Target server")] = None,
    api: Annotated[Api, typer.Option(help="With --target: chat or completions (auto: chat when every prompt "
                                     "has text).", rich_help_panel="Target server")] = "auto",
    served_model: Annotated[Optional[str], typer.Option("--served-model", help="With --target: the model name "
                                                        "to send.", rich_help_panel="Target server")] = None,
    max_concurrency: MaxConcurrency = 64,
    timeout: Timeout = 120.0,
    tolerance: Tolerance = 0.5,
) -> None:
    """Noninterference audit: re-run with co-batched neighbours' prompts replaced; a request's tokens
    must not change. Exit 1 when some did. With --timing: the prefix-cache timing side channel; exit 1
    when, with per-tenant salts, a tenant's probe hit another tenant's cached blocks. With --target, the
    neighbour-replacement runs against a server; with --timing --target, the timing side channel of the
    server (exit 1 when one tenant can tell another's cached prefix)."""
    spec = _load_scenario(scenario)
    if target is not None:
        from kvtui.target import command

        command.refuse_engine_options(dict(fault=fault))
        run_spec = command.TargetRun(url=command.check_url(target), api=api, served_model=served_model,
                                     max_concurrency=max_concurrency, timeout_s=timeout, tolerance=tolerance,
                                     logprobs=True)
        if timing:
            command.timing_target(spec, run_spec, model=model, probes=probes, block_size=block_size,
                                  cache_salt=cache_salt)
        else:
            command.audit_target(spec, scenario, run_spec, model=model)
        return
    if block_size is not None or cache_salt != "per_tenant":
        fail(f"{'--block-size' if block_size is not None else '--cache-salt'} applies to --timing --target; "
             "kvtui's own engine takes the scenario's engine.block_size and tenants.cache_salt")
    refuse_idle_faults(scenario, spec, _fault_names(fault))
    loaded = _load_model(model or spec.model, spec.dtype, "cpu")
    if timing:
        _timing_audit(scenario, spec, loaded, _fault_names(fault), probes)
        return
    check_lengths(scenario, spec, loaded.tokenizer)
    from kvtui.audit import run_audit

    try:
        events = run_audit(spec, loaded, faults=_fault_names(fault), console=err)
    except ValueError as e:  # an engine the model or the memory cannot hold
        fail(f"{scenario}: {e}")
    from kvtui.summary import print_contamination

    print_contamination(events, out)
    if events:
        err.print(f"[bold red]noninterference violated: {len(events)} requests changed with their neighbours[/]")
        raise typer.Exit(EXIT_CONTAMINATION)
    out.print("noninterference holds: every request's tokens stayed the same with its neighbours replaced")


@app.command()
def serve(
    model: Annotated[str, typer.Option("--model", help="default, tiny-llama, tiny-gpt2, a HF model directory or a "
                                       ".gguf file.")] = "default",
    dtype: Annotated[DType, typer.Option(help="Weights, KV cache and activations.")] = "float32",
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0: a free one).", min=0, max=65535)] = 8000,
    fault: Annotated[Optional[list[FaultChoice]], typer.Option("--fault", help="Turn an isolation fault on "
                                                               "(repeatable): it acts across clients.")] = None,
    dashboard: Annotated[bool, typer.Option("--dashboard", help="Show the served engine live in the dashboard.")]
    = False,
    record: Annotated[Optional[Path], typer.Option("--record", help="Write a JSONL recording here.")] = None,
    served_model_name: Annotated[Optional[str], typer.Option("--served-model-name", help="The model name clients "
                                                             "send and see (default: the model's id).")] = None,
    slots: Annotated[int, typer.Option(help="KV slots: requests running at once.", min=1, max=4096)] = 8,
    max_len: Annotated[int, typer.Option(help="Tokens per request: prompt + completion.", min=2)] = 512,
    max_batch_size: Annotated[int, typer.Option(help="Most requests in one step.", min=1, max=4096)] = 8,
    max_tokens_per_step: Annotated[int, typer.Option(help="Token budget of one step (chunked prefill past it).",
                                                     min=1)] = 1024,
    max_waiting: Annotated[Optional[int], typer.Option(help="Most requests queued for a slot; more get 429 "
                                                       "(default: no limit).", min=0)] = None,
    layout: Annotated[Layout, typer.Option(help="Batch layout.")] = "padded",
    kv: Annotated[KvMode, typer.Option("--kv", help="KV memory: slots (one region of --max-len per request) or "
                                       "paged (blocks through per-request block tables, as vLLM).")] = "slots",
    block_size: Annotated[Optional[int], typer.Option("--block-size", min=1, max=64, help="With --kv paged: tokens "
                                                      "per KV block (default 16).")] = None,
    prefix_caching: Annotated[bool, typer.Option("--prefix-caching/--no-prefix-caching", help="With --kv paged: "
                                                 "reuse cached blocks of earlier prompts' prefixes; a request's "
                                                 "`cache_salt` keys its blocks, so only requests with the same "
                                                 "salt share them.")] = False,
    detectors: Annotated[str, typer.Option(help=DETECTORS_HELP)] = "reference,canary,attention_flow,slot_taint",
    threads: Annotated[Optional[int], typer.Option(help="torch threads for the engine (default: all cores but "
                                                   "one).", min=1)] = None,
    device: Annotated[str, typer.Option(help="torch device, e.g. cpu or cuda.")] = "cpu",
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar=API_KEY_ENV, show_default=False,
                                                   help="Require `Authorization: Bearer KEY` on /v1/* (401 "
                                                   "otherwise; /health and /metrics stay open), as vLLM's "
                                                   "--api-key.")] = None,
    max_request_bytes: Annotated[int, typer.Option(help="Largest request body taken, in bytes; bigger ones get "
                                                   "413 before they are parsed.", min=1)] = DEFAULT_MAX_REQUEST_BYTES,
) -> None:
    """Serve the engine behind an OpenAI-compatible API (completions, chat, /metrics) until Ctrl-C.

    Any OpenAI client, curl, `vllm bench serve` or GuideLLM can drive it; --dashboard shows inside.
    """
    from kvtui.serve.main import BadInput, run_serve
    from kvtui.serve.server import ServeOptions
    from kvtui.tui.launch import default_torch_threads

    if kv != "paged" and (prefix_caching or block_size is not None):
        fail(f"{'--prefix-caching' if prefix_caching else '--block-size'} needs paged KV: add --kv paged")
    options = ServeOptions(model=model, dtype=dtype, device=device, host=host, port=port,
                           faults=_fault_names(fault), record=record, served_model_name=served_model_name, slots=slots,
                           max_len=max_len, max_batch_size=max_batch_size, max_tokens_per_step=max_tokens_per_step,
                           layout=layout, kv=kv, block_size=block_size or 16, prefix_caching=prefix_caching,
                           max_waiting=max_waiting, detectors=_detectors(detectors),
                           threads=threads or default_torch_threads(), progress=True, api_key=api_key or None,
                           max_request_bytes=max_request_bytes)
    if dashboard and not (sys.stdout.isatty() and sys.stderr.isatty()):
        say("note", "not a terminal: serving without the dashboard.")
        dashboard = False
    try:
        result = run_serve(options, dashboard=dashboard, note=lambda text: say("note", text))
    except BadInput as e:
        fail(str(e))
    from kvtui.summary import print_contamination, print_summary

    if result.summary is not None:
        print_summary(result.summary, result.header, out)
        print_contamination(result.contamination, out, recording=record)
    if record and not result.recording_error:
        out.print(f"recording: {record}", markup=False, highlight=False)
    _quick_exit()
    if result.error is not None:
        fail(f"runtime error: {type(result.error).__name__}: {result.error}", EXIT_RUNTIME)
    if result.recording_error:
        fail(f"{result.recording_error}; serving went on without it (free space, or choose another --record path)",
             EXIT_RUNTIME)


def _quick_exit() -> None:
    """Everything is written: spare the interpreter's final garbage collection over the model's and
    torch's objects, which took 2-4 s of a `kvtui serve` exit on a loaded 2-core machine (0.4 s
    without it). gc.freeze moves every object out of the collector's reach; memory goes back to the
    system with the process."""
    import gc

    gc.freeze()


def _timing_audit(path: Path, spec, loaded, faults: tuple[str, ...], probes: int) -> None:
    from kvtui.audit_timing import print_timing, run_timing_audit

    try:
        rows = run_timing_audit(spec, loaded, faults=faults, probes=probes, console=err)
    except ValueError as e:  # a fault the paged engine refuses, a pool the memory cannot hold
        fail(f"{path}: {e}")
    print_timing(rows, out)
    leaked = max((r.cross_tenant_hit_tokens for r in rows if r.salts == "per_tenant"), default=0)
    if leaked:
        err.print(f"[bold red]with per-tenant salts the attacker's probes hit {leaked} tokens of the victim's cached "
                  "blocks: the salt does not separate tenants[/]")
        raise typer.Exit(EXIT_CONTAMINATION)
    out.print("per-tenant salts hold: no probe hit another tenant's cached blocks")


@app.command("model")
def model_cmd(
    name: Annotated[str, typer.Argument(help="default, tiny-llama, tiny-gpt2, a HF directory or a .gguf file")] = "default",
) -> None:
    """Load a model once (converting the default GGUF into the cache) and print what it is."""
    import time

    t0 = time.perf_counter()
    loaded = _load_model(name, "float32", "cpu")
    cfg = loaded.model.config
    out.print(f"{loaded.model_id}: {type(loaded.model).__name__}, "
              f"{sum(p.numel() for p in loaded.model.parameters()) / 1e6:.1f}M parameters, "
              f"{loaded.num_layers} layers, {loaded.num_heads} heads, {loaded.num_kv_heads} KV heads, "
              f"head_dim {loaded.head_dim}, vocab {cfg.vocab_size}; loaded in {time.perf_counter() - t0:.1f} s",
              markup=False, highlight=False)
    if loaded.source_path:
        out.print(f"source: {loaded.source_path}" + (f" (sha256 {loaded.source_sha256})" if loaded.source_sha256 else ""),
                  markup=False, highlight=False)


BenchPart = enum.Enum("BenchPart", {name: name for name in ("overhead", "batch", "knobs", "peers", "bf16",
                                                            "detectors")}, type=str)


@app.command()
def bench(
    part: Annotated[Optional[list[BenchPart]], typer.Option("--part", help="Run only this part (repeatable): "
                                                            "overhead, batch, knobs, peers, bf16, detectors.")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="Fewer repeats and shapes: under 10 minutes on 2 cores.")]
    = False,
    output: Annotated[Path, typer.Option("--output", "-o", help="JSON file for the figures (a .md beside it).")] =
    Path("bench-results/bench.json"),
    model: Annotated[str, typer.Option(help="Model to benchmark.")] = "default",
    dtype: Annotated[DType, typer.Option(help="Model dtype.")] = "float32",
    threads: Annotated[Optional[int], typer.Option(help="torch threads (default: all cores).", min=1)] = None,
) -> None:
    """Measure kvtui side by side with a bare transformers forward, transformers' generate and continuous
    batching, and llama.cpp's server (when built): medians of repeats with min/max, JSON plus Markdown."""
    import torch

    from kvtui.bench import PARTS, run_suite

    if threads:
        torch.set_num_threads(threads)
    parts = [p.value for p in part] if part else list(PARTS)
    loaded = _load_model(model, dtype, "cpu")
    run_suite(loaded, name=model, parts=parts, quick=quick, output=output, console=out)
    out.print(f"figures written to {output} and {output.with_suffix('.md')}")


@app.command("calibrate")
def calibrate_cmd(
    model: Annotated[str, typer.Option(help="Model to calibrate for.")] = "default",
    dtype: Annotated[DType, typer.Option(help="Model dtype.")] = "float32",
    device: Annotated[str, typer.Option(help="torch device.")] = "cpu",
) -> None:
    """Fit the virtual clock's step-cost model to this machine (a few seconds of engine steps) and store
    it for the model, dtype and device; virtual-clock runs of that model use it from then on."""
    from kvtui.calibrate import calibrate

    loaded = _load_model(model, dtype, device)
    data = calibrate(loaded, device=device, console=err)
    c = data["coefficients"]
    out.print(f"step seconds = {c['base_s']:.4f} + {c['per_row_s']:.2e} x rows + {c['per_token_s']:.2e} x tokens "
              f"+ {c['per_key_s']:.2e} x keys  (R^2 {data['r2']:.3f}, {len(data['samples'])} shapes, "
              f"{data['seconds']:.0f} s)")
    out.print(f"stored in {data['file']}; `kvtui run --cost-model default` ignores it")


def main() -> int:
    """Console entry point. A rejected option or argument is one line on stderr and exit 2."""
    try:  # typer vendors click since 0.24
        from typer._click import exceptions as click_errors
    except ImportError:  # pragma: no cover - older typer on the real click
        from click import exceptions as click_errors

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        code = app(standalone_mode=False)
    except click_errors.NoArgsIsHelpError as e:
        typer.echo(e.ctx.get_help() if e.ctx else "", err=True)
        return EXIT_BAD_INPUT
    except click_errors.UsageError as e:
        command = f"kvtui {e.ctx.info_name}" if e.ctx and e.ctx.parent else "kvtui"
        message = e.format_message().replace("Value error, ", "")
        say("error", f"{message} (see `{command} --help`)")
        return EXIT_BAD_INPUT
    except (typer.Abort, KeyboardInterrupt):  # a second Ctrl-C while a run was stopping
        say("error", "interrupted")
        return 130
    return code if isinstance(code, int) else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
