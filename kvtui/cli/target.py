"""The `--target` half of `kvtui run` and `kvtui audit`: option checks, the headless run, its printout
and exit code. kvtui/cli/run.py and kvtui/cli/audit.py hand over here when `--target` is given."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import typer
from rich.markup import escape

from kvtui.cli.console import EXIT_CONTAMINATION, EXIT_RUNTIME, err, fail, fail_unwritable, out, say
from kvtui.cli.finish import exit_if_signalled, finish_headless, install_stop_handlers
from kvtui.models.labels import model_label
from kvtui.remote.session import TARGET_DETECTORS, TargetError, TargetOptions, TargetSession

ENGINE_ONLY = {"--fault": "fault", "--isolation off": "isolation", "--layout": "layout", "--dtype": "dtype",
               "--clear-faults": "clear_faults", "--device": "device", "--prefix-caching": "prefix_caching",
               "--batch-invariant": "batch_invariant"}


@dataclass(frozen=True)
class TargetRun:
    """What `kvtui run --target` was asked for (CLI values, before any check)."""

    url: str
    api: str
    served_model: str | None
    max_concurrency: int
    timeout_s: float
    tolerance: float
    logprobs: bool
    reference_url: str | None = None
    workers: int = 0  # > 0: the load sent from this many Ray workers (kvtui/remote/workers.py)
    ray_address: str | None = None  # a Ray cluster's address; None: a local Ray runtime


def check_url(url: str) -> str:
    """The server's base URL: `url` without a trailing slash or `/v1` (the OpenAI clients' base URL ends
    in /v1, vLLM's `bench serve --base-url` does not; kvtui adds the /v1/... paths itself, so both are
    taken). Exits 2 with one line unless it is http(s)://HOST[:PORT][/PATH]."""
    import httpx


    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as e:
        fail(f"--target {url!r}: not a URL ({e}); give http://HOST:PORT")
    if parsed.scheme not in ("http", "https") or not parsed.host:
        fail(f"--target {url!r}: not an http(s) URL with a host; give http://HOST:PORT")
    base = url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def with_request_ids(path: Path, spec, places: str):
    """The scenario with its request_ids section sending ids in `places` (a --request-ids value: a
    comma-separated list of SEND_AS's places); the section's defaults (pairs of requests sharing
    one id) when it has none. Exits 2 with one line for a place kvtui does not know."""
    from kvtui.scenario.request_ids import SEND_AS, RequestIds

    chosen = [p.strip() for p in places.split(",") if p.strip()]
    unknown = next((p for p in chosen if p not in SEND_AS), None)
    if unknown is not None or not chosen or len(set(chosen)) != len(chosen):
        bad = (f"unknown place {unknown!r}" if unknown is not None else "give at least one place" if not chosen
               else "give each place once")
        fail(f"--request-ids {places!r}: {bad}; use some of {', '.join(SEND_AS)}, comma-separated "
             "(e.g. --request-ids header,user)")
    base = spec.request_ids.model_dump() if spec.request_ids is not None else {}
    section = RequestIds.model_validate({**base, "send_as": chosen})
    copy = spec.model_copy(update={"request_ids": section})
    copy._base_dir = spec.base_dir
    copy._warnings = list(spec.warnings)
    return copy


def refuse_engine_options(given: dict[str, object]) -> None:
    """Exit 2 naming the first engine-only option given with --target (a remote server's engine is its own)."""

    for flag, key in ENGINE_ONLY.items():
        if given.get(key):
            fail(f"{flag} acts on kvtui's own engine and cannot apply to a --target server; drop it "
                 "(the server's configuration is its own)")
    if given.get("clock") in ("virtual", "paced"):
        fail(f"--clock {given['clock']} models kvtui's engine; a --target run is timed on the wall clock: drop --clock")


def target_detectors(chosen: tuple[str, ...], explicit: bool) -> tuple[str, ...]:
    """The black-box detectors among `chosen`; a note for engine-only ones the user named."""

    kept = tuple(d for d in chosen if d in TARGET_DETECTORS)
    dropped = [d for d in chosen if d not in TARGET_DETECTORS]
    if explicit and dropped:
        say("note", f"{', '.join(dropped)} need kvtui's engine internals and do not run against a target")
    return kept


def run_target(spec, scenario_path: Path, run: TargetRun, *, model: str | None, record: Path | None,
               detectors: tuple[str, ...], quiet: bool) -> None:
    """`kvtui run SCENARIO --target URL --headless`: run, print the summary and the contamination table,
    exit as a local run does (kvtui.cli.finish.finish_headless): 130/143 interrupted, 3 when the recording
    stopped or no request could complete, else by the scenario's `expect` (0, 1); 2 for bad input."""
    from kvtui.summary import print_contamination, print_summary

    session = build_target_session(spec, scenario_path, run, model=model, record=record, detectors=detectors)
    stopped = install_stop_handlers(session)
    try:
        summary = _run(session, quiet)  # its first act is the probe every --target command makes (reachable)
    except TargetError as e:
        session.abandon()
        fail(str(e))
    except OSError as e:  # the header could not be written: refused before any request, as a local run
        fail_unwritable(record, e)
    print_summary(summary, session.header(), out)
    print_contamination(session.contamination, out, recording=record)
    untested = None
    if not summary.requests_completed and summary.finish_reasons.get("error"):
        first = next(r for r in session.results.values() if r.finish_reason == "error")
        untested = f"no request completed against {run.url}: first error: {first.error}"
    finish_headless(spec, session, record, stopped, untested=untested)


def dashboard_target(spec, scenario_path: Path, run: TargetRun, *, model: str | None, record: Path | None,
                     detectors: tuple[str, ...]) -> None:
    """`kvtui run SCENARIO --target URL` in a terminal: the dashboard, then the summary. The quick input
    checks (recording path, the server answering) exit 2 before the dashboard takes the terminal. The
    tokenizer (importing torch and transformers takes 5-15 s on 2 busy cores) is loaded and the requests
    planned with the dashboard up; a bad model is said there and exits 2 once it closes."""
    from kvtui.remote.session import timeline_warnings
    from kvtui.tui.launch import check_writable
    from kvtui.tui.target_source import run_target_dashboard

    name = model or spec.model
    try:
        if record is not None:
            check_writable(record)
    except OSError as e:
        fail_unwritable(record, e)
    reachable(run)
    for line in timeline_warnings(spec):
        say("warning", line)

    def make_session(listener) -> TargetSession:
        return new_target_session(spec, run, model=model, record=record, detectors=detectors, listeners=(listener,))

    signals: list[int] = []
    try:
        summary, header, session = run_target_dashboard(
            make_session, loading_text=f"loading the tokenizer of {model_label(name)} and planning the requests…",
            on_signal=signals.append)
    except OSError as e:
        fail_unwritable(record, e)
    except ValueError as e:
        fail(f"{scenario_path}: {e}")
    except Exception as e:
        from kvtui.models import ModelLoadError  # imported only now: it pulls in torch

        if not isinstance(e, ModelLoadError):
            raise
        fail(str(e))
    _print_dashboard_result(summary, header, session, record, stopped=bool(signals))
    exit_if_signalled(signals)


def _print_dashboard_result(summary, header, session: TargetSession, record: Path | None,
                            stopped: bool = False) -> None:
    """After the target dashboard closes: the summary, the contamination table, and the recording's
    fate (exit 3 when its writes failed, unless a signal `stopped` the run: its exit code comes next)."""
    from kvtui.summary import print_contamination, print_summary

    if summary is not None:
        print_summary(summary, header, out)
        print_contamination(session.contamination, out, recording=record)
    if session.recording_error:
        message = f"{session.recording_error}; the run went on without it (free space, or choose another --record path)"
        if stopped:
            say("error", message)
            return
        fail(message, EXIT_RUNTIME)
    if record:
        out.print(f"recording: {record}", markup=False, highlight=False)


def audit_target(spec, scenario_path: Path, run: TargetRun, *, model: str | None) -> None:
    """`kvtui audit SCENARIO --target URL`: three runs, the changed answers, exit 1 when one counts."""
    from kvtui.models import ModelLoadError, load_tokenizer
    from kvtui.remote.audit import run_target_audit
    from kvtui.summary import print_contamination

    reachable(run)
    try:
        tokenizer = load_tokenizer(model or spec.model)
    except ModelLoadError as e:
        fail(str(e))
    options = TargetOptions(url=run.url, api=run.api, served_model=run.served_model,
                            max_concurrency=run.max_concurrency, timeout_s=run.timeout_s, tolerance=run.tolerance)
    try:
        audit = run_target_audit(spec, tokenizer, options, console=err)
    except TargetError as e:
        fail(str(e))
    except ValueError as e:
        fail(f"{scenario_path}: {e}")
    events = audit.events
    print_contamination(events, out)
    if audit.cached:
        say("warning", f"{audit.cached} requests were not compared: the server reported prompt tokens from its "
            "prefix cache although each request carried a fresh cache_salt (or cache_prompt: false)")
    counted = [e for e in events if e.counts]
    if counted:
        err.print(f"[bold red]noninterference violated: {len(counted)} requests changed with their neighbours[/]")
        raise typer.Exit(EXIT_CONTAMINATION)
    numeric = len(events) - len(counted)
    out.print("noninterference holds: no request's answer moved with its neighbours' prompts beyond numeric "
              f"noise ({numeric} near-tie or unlabelled changes)" if numeric else
              "noninterference holds: every request's answer stayed the same with its neighbours replaced")


def timing_target(spec, run: TargetRun, *, model: str | None, probes: int, block_size: int | None,
                  cache_salt: str) -> None:
    """`kvtui audit SCENARIO --timing --target URL`: the three configurations, the table, the verdict;
    exit 1 when one tenant can tell another's prefix (kvtui/remote/timing.py)."""
    from kvtui.models import ModelLoadError, load_tokenizer
    from kvtui.remote.timing import CONFIG_TEXT, print_target_timing, run_target_timing, verdict

    reachable(run)
    try:
        tokenizer = load_tokenizer(model or spec.model)
    except ModelLoadError as e:
        fail(str(e))
    options = TargetOptions(url=run.url, served_model=run.served_model, timeout_s=run.timeout_s)
    try:
        cache, rows = run_target_timing(options, tokenizer, probes=probes, block_size=block_size, console=err)
    except TargetError as e:
        fail(str(e))
    print_target_timing(cache, rows, out)
    v = verdict(rows, cache_salt)
    judged = CONFIG_TEXT[v.judged]
    if v.leak:
        err.print(f"[bold red]prefix-cache side channel: with {escape(judged)}, one tenant can tell another's "
                  "cached prefix[/]", highlight=False)
        raise typer.Exit(EXIT_CONTAMINATION)
    if v.inconclusive:
        off = " (the server says enable_prefix_caching=False)" if cache.prefix_caching is False else ""
        say("warning", f"cannot judge: even with the same salt no probe reused the victim's blocks{off}; "
            "prefix caching looks off, so a clean result proves nothing about salts")
        return
    out.print(f"tenants kept apart with {judged}: no probe read another tenant's cached blocks, and TTFT does not "
              "tell a matching guess apart; the same salt does share (the control)", markup=False, highlight=False)


def reachable(run: TargetRun) -> None:
    """The first contact every --target command makes before anything slow (kvtui.remote.reach.probe: the
    server, and the reference server when named, answer /v1/models with JSON); else one line and exit 2."""
    from kvtui.remote.session import check_reachable

    try:
        check_reachable(target_options(run))
    except TargetError as e:
        fail(str(e))


def target_options(run: TargetRun) -> TargetOptions:
    """The session options of a `--target` run."""
    return TargetOptions(url=run.url, api=run.api, served_model=run.served_model, max_concurrency=run.max_concurrency,
                         timeout_s=run.timeout_s, tolerance=run.tolerance, logprobs=run.logprobs,
                         reference_url=run.reference_url)


@contextlib.contextmanager
def started_llama_server(args_text: str, model: str) -> Iterator[tuple[str, str]]:
    """`kvtui run --llama-server ARGS`: llama-server on `model`'s GGUF with ARGS and its cache-off control
    (kvtui.remote.llama_server.LlamaServerPair); yields (server URL, control URL) and stops both after.
    Bad ARGS or model: one line, exit 2; a server that does not start: one line and its log tail, exit 3."""
    from kvtui.models import ModelLoadError
    from kvtui.remote.llama_server import LlamaServerError, LlamaServerPair, model_gguf

    try:
        gguf = model_gguf(model)
        pair = LlamaServerPair(gguf, args_text)
    except (ModelLoadError, ValueError) as e:
        fail(f"--llama-server: {e}")
    say("note", f"starting llama-server {' '.join(pair.args)} on {gguf} and its control "
                "(-np 1 --cache-ram 0) for the reference runs")
    try:
        pair.__enter__()
    except LlamaServerError as e:
        fail(f"--llama-server: {e}", EXIT_RUNTIME)
    try:
        yield pair.server.url, pair.control.url
    finally:
        pair.__exit__(None, None, None)


def new_target_session(spec, run: TargetRun, *, model: str | None, record: Path | None,
                       detectors: tuple[str, ...], listeners=(), planned=None) -> TargetSession:
    """The tokenizer of the scenario's model (or `model`) and a TargetSession.

    Raises:
        ModelLoadError: the tokenizer cannot be loaded. OSError: the recording cannot be created.
        ValueError: a bad detector or option (see TargetSession).
    """
    from kvtui.models import load_tokenizer

    tokenizer = load_tokenizer(model or spec.model)
    if run.workers:
        from kvtui.remote.workers import RayTargetSession

        return RayTargetSession(spec, tokenizer, target_options(run), workers=run.workers, address=run.ray_address,
                                record_path=record, detectors=detectors, listeners=tuple(listeners),
                                planned=planned, model=model or spec.model)
    return TargetSession(spec, tokenizer, target_options(run), record_path=record, detectors=detectors,
                         listeners=tuple(listeners), planned=planned, model=model or spec.model)


def build_target_session(spec, scenario_path: Path, run: TargetRun, *, model: str | None, record: Path | None,
                         detectors: tuple[str, ...], listeners=(), planned=None) -> TargetSession:
    """new_target_session, input errors as one line and exit 2, the scenario's warnings printed."""
    from kvtui.models import ModelLoadError

    try:
        session = new_target_session(spec, run, model=model, record=record, detectors=detectors,
                                     listeners=listeners, planned=planned)
    except ModelLoadError as e:
        fail(str(e))
    except OSError as e:
        fail_unwritable(record, e)
    except ValueError as e:
        fail(f"{scenario_path}: {e}")
    for line in session.warnings:
        say("warning", line)
    return session


def _run(session: TargetSession, quiet: bool):

    total = len(session.pending)
    if quiet or not err.is_terminal:
        return session.run()
    with err.status("connecting") as status:
        def progress(s: TargetSession) -> None:
            status.update(f"sent {total - len(s.pending)}/{total}  in flight {len(s.in_flight)}  "
                          f"finished {s.metrics.requests_finished}  t={s.now():.1f}s")
        return session.run(progress)


