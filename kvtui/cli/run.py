"""`kvtui run SCENARIO`: the dashboard, or --headless for CI; with --target, a server over HTTP
(kvtui/cli/target.py)."""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvtui.cli.console import EXIT_BAD_INPUT, EXIT_RUNTIME, err, fail, fail_unwritable, out, say
from kvtui.cli.finish import exit_if_signalled, finish_headless, install_stop_handlers
from kvtui.cli.inputs import (
    check_lengths,
    load_model,
    load_scenario,
    load_tokenizer,
    refuse_idle_faults,
    refuse_lora_modes,
    refuse_misfit_faults,
)
from kvtui.cli.options import (
    DEFAULT_DETECTORS,
    DETECTORS_HELP,
    ENGINE,
    TARGET,
    TARGET_PANEL,
    CostModel,
    FaultChoice,
    Isolation,
    MaxConcurrency,
    Timeout,
    Tolerance,
    api_option,
    batch_invariant_option,
    compile_option,
    enforce_eager_option,
    fault_names,
    parse_detectors,
    served_model_option,
    target_option,
)
from kvtui.config import Clock, DType, Layout
from kvtui.faults import default_isolation_off
from kvtui.models.labels import model_label


def run(
    scenario: Annotated[Path, typer.Argument(help="Scenario YAML file, e.g. scenarios/passphrase.yaml")],
    headless: Annotated[bool, typer.Option("--headless", help="No dashboard: run, print a summary, exit.")] = False,
    record: Annotated[Optional[Path], typer.Option("--record", help="Write a JSONL recording here.")] = None,
    model: Annotated[Optional[str], typer.Option("--model", help="Override the scenario's model: default, "
                                                 "tiny-llama, tiny-gpt2, a HF model directory or a .gguf file.")] = None,
    dtype: Annotated[Optional[DType], typer.Option(metavar="DTYPE", help="Override the scenario's dtype: float32, bfloat16 or float16.")] = None,
    clock: Annotated[Optional[Clock], typer.Option(help="virtual (modeled step times: the same steps and tokens "
                                                   "on any machine; headless default), paced (virtual, held to real "
                                                   "time: a demo on the dashboard) or wall (real time). The "
                                                   "dashboard's default is the scenario's dashboard.clock (wall).")] = None,
    layout: Annotated[Optional[Layout], typer.Option(help="Override the engine layout.")] = None,
    device: Annotated[str, typer.Option(help="torch device, e.g. cpu or cuda.")] = ENGINE.device,
    fault: Annotated[Optional[list[FaultChoice]], typer.Option("--fault", metavar="FAULT", help="Turn an isolation fault on from "
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
    enforce_eager: enforce_eager_option() = ENGINE.enforce_eager,
    batch_invariant: batch_invariant_option() = None,
    compile: compile_option() = None,
    cost_model: Annotated[CostModel, typer.Option(help="Virtual clock step costs: auto (this machine's `kvtui "
                                                  "calibrate` fit if there is one) or default (the built-in "
                                                  "fit).")] = "auto",
    target: target_option("Drive an OpenAI-compatible server at this URL (http://HOST:PORT, with or without /v1) "
                       "instead of kvtui's engine.") = None,
    api: api_option("With --target: chat or completions endpoint (auto: chat when every prompt has text; audio prompts always go to /v1/audio/transcriptions).") = TARGET.api,
    served_model: served_model_option("With --target: the model name to send (default: the first of /v1/models).")
    = TARGET.served_model,
    max_concurrency: MaxConcurrency = TARGET.max_concurrency,
    timeout: Timeout = TARGET.timeout_s,
    tolerance: Tolerance = TARGET.tolerance,
    logprobs: Annotated[bool, typer.Option("--logprobs/--no-logprobs", help="With --target: ask for top "
                                           "logprobs (labels reference divergences).",
                                           rich_help_panel=TARGET_PANEL)] = TARGET.logprobs,
    reference_target: Annotated[Optional[str], typer.Option(
        "--reference-target", help="With --target: send the reference (solo) runs to this server instead, e.g. "
        "the same server and model with its prompt cache off.", rich_help_panel=TARGET_PANEL)] = None,
    llama_server: Annotated[Optional[str], typer.Option(
        "--llama-server", help="Start llama.cpp's llama-server (scripts/build-llama-server.sh) with these "
        "arguments, e.g. '-np 2 --cache-reuse 256', on --model (tiny-qwen35moe, default or a .gguf), and a "
        "control with one slot and the prompt cache off for the reference runs; run against them as "
        "--target, then stop both.", rich_help_panel=TARGET_PANEL)] = None,
    request_ids: Annotated[Optional[str], typer.Option(
        "--request-ids", help="With --target: the request-id audit. Each client sends a request id of its own "
        "choosing in these places (comma-separated: header = x-request-id, user, request_id, rid, traceparent = "
        "the W3C header, one trace id per group), grouped as the "
        "scenario's request_ids says or, without that section, in pairs that share one id; after the load, "
        "probes with fresh ids and GET /health.", rich_help_panel=TARGET_PANEL)] = None,
    workers: Annotated[int, typer.Option(
        "--workers", min=0, help="With --target: send the load from this many Ray workers (pip install "
        "'kvtui\\[ray]'), each its shard of the seeded plan against one shared start; detectors, recording and "
        "dashboard stay here. 0: this process sends.", rich_help_panel=TARGET_PANEL)] = 0,
    ray_address: Annotated[Optional[str], typer.Option(
        "--ray", help="With --workers: the Ray cluster's address (default: a local Ray runtime).",
        rich_help_panel=TARGET_PANEL)] = None,
) -> None:
    """Run a scenario on a real model: the dashboard, or --headless for CI. With --target, drive a real
    inference server (vLLM, SGLang, llama.cpp, TGI) over HTTP, black-box.

    Exit codes: 0 as expected; 1 contamination found while the scenario expects none, or a fault on and
    `expect: {contamination: detected}` but nothing detected although the fault acted; 2 bad input (also
    a scenario in which no request fits the engine, or a fault that cannot act in its layout or KV mode); 3
    runtime error (the recording stopped, or no request completed); 4 `expect: {contamination: detected}`,
    nothing detected, and no fault that was on ever acted: the scenario gave it nothing to act on, one line
    per fault says why; 130 / 143 interrupted by SIGINT / SIGTERM.
    """
    spec = load_scenario(scenario)
    if workers or ray_address is not None:
        _check_workers(target, llama_server, workers, ray_address)
    if target is not None or llama_server is not None or reference_target is not None or request_ids is not None:
        from kvtui.cli import target as command

        command.refuse_engine_options(dict(fault=fault, isolation=isolation == "off", layout=layout, dtype=dtype,
                                           clear_faults=clear_faults, device=device != ENGINE.device, clock=clock,
                                           prefix_caching=prefix_caching is not None,
                                           batch_invariant=batch_invariant is not None))
        client = dict(api=api, served_model=served_model, max_concurrency=max_concurrency, timeout_s=timeout,
                      tolerance=tolerance, logprobs=logprobs, workers=workers, ray_address=ray_address)
        _on_target(spec, scenario, target, reference_target, llama_server, client, model=model, record=record,
                   detectors=detectors, headless=headless, quiet=quiet, request_ids=request_ids)
        return
    if spec.request_ids is not None:
        say("note", f"{scenario}: request_ids act over HTTP, in a --target run (e.g. against `kvtui serve`); this "
                    "local run ignores them")
    refuse_lora_modes(scenario, spec, enforce_eager=enforce_eager, batch_invariant=batch_invariant)
    off = default_isolation_off(spec.engine.kv, spec.engine.prefix_caching) if isolation == "off" else ()
    faults = fault_names(fault) + off
    chosen = parse_detectors(detectors)
    if not headless and not (sys.stdout.isatty() and sys.stderr.isatty()):
        say("note", "not a terminal: running headless (pass --headless to silence this).")
        headless = True
    if prefix_caching is not None:
        spec = _with_prefix_caching(scenario, spec, prefix_caching, headless)
    # the dashboard's checks load the tokenizer (seconds) before the screen is taken: a spinner says so at once
    with nullcontext() if headless else err.status(f"checking the scenario with {model_label(model or spec.model)}'s "
                                                   "tokenizer; the dashboard opens next"):
        refuse_misfit_faults(scenario, spec, fault_names(fault), model)
        refuse_idle_faults(scenario, spec, fault_names(fault), off, layout=layout, clear_faults=clear_faults,
                           prefix_caching=prefix_caching)
        if not headless:
            _dashboard_checks(scenario, spec, model, dtype, device)
    options = dict(clock=clock, record=record, layout=layout, device=device, faults=faults, detectors=chosen,
                   clear_faults=clear_faults, cost_model=cost_model, enforce_eager=enforce_eager,
                   batch_invariant=batch_invariant, compile=compile)
    if not headless:
        _dashboard(scenario, model=model, dtype=dtype, **{**options, "clock": clock or spec.dashboard.clock})
        return
    loaded = load_model(model or spec.model, dtype or spec.dtype, device)
    planned = check_lengths(scenario, spec, loaded.tokenizer, model)
    session = _session(spec, scenario, loaded, planned=planned, progress=lambda line: say("note", line),
                       **{**options, "clock": clock or "virtual"})
    if compile is not None:  # asked for one way or the other: say which runs and why
        say("note", f"decode steps: {session.engine.runner.compile_note}")
    stopped = install_stop_handlers(session)
    summary = _run_headless(session, record, quiet)
    from kvtui.summary import print_contamination, print_summary

    print_summary(summary, session.header(), out)
    print_contamination(session.contamination, out, recording=record)
    if session.unapplied_timeline and stopped.signum is None:
        say("warning", f"{len(session.unapplied_timeline)} timeline event(s) came after the run's end and were not "
                       f"applied (first at {session.unapplied_timeline[0].at_s:g} s)")
    finish_headless(spec, session, record, stopped, expect_override="none" if clear_faults and not faults else None)


def _on_target(spec, scenario: Path, target: str | None, reference_target: str | None, llama_server: str | None,
               client: dict, *, model: str | None, record: Path | None, detectors: str, headless: bool,
               quiet: bool, request_ids: str | None = None) -> None:
    """The --target run (the dashboard, or headless), against `target` or the llama-server pair that
    --llama-server starts and stops; the solo runs go to `reference_target` / the pair's control.
    `request_ids`: a --request-ids value (the request-id audit's places)."""
    from kvtui.cli import target as command

    if request_ids is not None and target is None and llama_server is None:
        fail("--request-ids applies to --target runs (request ids travel over HTTP); add --target URL, e.g. a "
             "`kvtui serve` at http://127.0.0.1:8000")
    if request_ids is not None:
        spec = command.with_request_ids(scenario, spec, request_ids)

    if reference_target is not None and target is None:
        fail("--reference-target goes with --target (or --llama-server, which starts its own control)")
    if llama_server is not None and target is not None:
        fail("--llama-server starts the server itself: drop --target (or drop --llama-server)")
    chosen = command.target_detectors(parse_detectors(detectors), explicit=detectors != DEFAULT_DETECTORS)
    if not headless and not (sys.stdout.isatty() and sys.stderr.isatty()):
        say("note", "not a terminal: running headless (pass --headless to silence this).")
        headless = True

    def drive(url: str, reference: str | None) -> None:
        run_spec = command.TargetRun(url=command.check_url(url), **client,
                                     reference_url=reference and command.check_url(reference))
        if not headless:
            command.dashboard_target(spec, scenario, run_spec, model=model, record=record, detectors=chosen)
        else:
            command.run_target(spec, scenario, run_spec, model=model, record=record, detectors=chosen, quiet=quiet)

    if llama_server is None:
        drive(target, reference_target)
        return
    with command.started_llama_server(llama_server, model or spec.model) as (url, reference):
        drive(url, reference)


def _check_workers(target: str | None, llama_server: str | None, workers: int, ray_address: str | None) -> None:
    """--workers / --ray: with --target only, --ray only with --workers, and Ray installed (else one line, exit 2)."""
    from kvtui.remote.workers import RAY_MISSING, ray_available

    flag = "--workers" if workers else "--ray"
    if target is None and llama_server is None:
        fail(f"{flag} sends a --target run's load from Ray workers; add --target URL")
    if ray_address is not None and not workers:
        fail("--ray names the cluster of --workers N; add --workers")
    if ray_address is not None and not ray_address.strip():
        fail("--ray '': give the cluster's address (HOST:6379, as `ray start --head` prints it), or leave --ray out "
             "for a local runtime")
    if not ray_available():
        fail(RAY_MISSING)


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
        fail_unwritable(options.get('record'), e)
    except ValueError as e:
        fail(f"{path}: {e}")


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


def _dashboard_checks(scenario: Path, spec, model: str | None, dtype: str | None, device: str) -> None:
    """What the dashboard checks before it takes the screen: the bfloat16 note, and the planned requests
    against the engine (one line and exit 2 when none fits)."""
    from kvtui.models.hardware import bf16_note

    if note := bf16_note(dtype or spec.dtype, device):
        say("note", note)
    check_lengths(scenario, spec, load_tokenizer(model or spec.model), model)


def _dashboard(scenario: Path, **options) -> None:
    """Run the live dashboard; input errors become one line and exit 2 (raised before the screen opens)."""
    from kvtui.models import ModelLoadError
    from kvtui.record import RecordingError
    from kvtui.scenario import ScenarioError
    from kvtui.summary import print_summary
    from kvtui.tui import run_dashboard

    closed, signals = [], []
    try:
        summary, header = run_dashboard(scenario, on_closed=closed.append, on_signal=signals.append, **options)
    except ScenarioError as e:
        for line in e.errors:
            say("error", line)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    except (ModelLoadError, RecordingError, ValueError) as e:
        fail(str(e))
    except OSError as e:
        fail_unwritable(options.get('record'), e)
    except Exception as e:  # a bug or a runtime failure: one line, the recording kept
        fail(f"runtime error: {type(e).__name__}: {e}", EXIT_RUNTIME)
    if summary is not None:
        print_summary(summary, header, out)
    broken = closed[-1].recording_error if closed else ""
    if broken:
        say("error", f"{broken}; the run went on without it (free space, or choose another --record path)")
    elif options.get("record"):
        out.print(f"recording: {options['record']}", markup=False, highlight=False)
    exit_if_signalled(signals)  # SIGTERM / SIGINT: as a headless run, 128 + the signal's number
    if broken:
        raise typer.Exit(EXIT_RUNTIME)
