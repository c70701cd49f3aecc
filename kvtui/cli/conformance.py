"""`kvtui conformance`: every black-box isolation check against one server (kvtui/conformance/), as one
table. With --target, the server at that URL; without, a `kvtui serve` of kvtui's own engine started in
this process (with --fault, a mutant). Exit 0 every applicable check passed, 1 one failed, 2 bad input (a
--target that cannot be reached or does not answer /v1/models with JSON included: kvtui.remote.reach), 3 the
server failed a request outright during the checks."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from kvtui.cli.console import EXIT_BAD_INPUT, EXIT_CONTAMINATION, EXIT_RUNTIME, err, fail, out, say
from kvtui.cli.options import (
    TARGET,
    TARGET_PANEL,
    FaultChoice,
    Timeout,
    fault_names,
    served_model_option,
    target_option,
)
from kvtui.names import did_you_mean


def _checks_asked(check: list[str] | None) -> list[str] | None:
    """The --check names, each known (exit 2 naming an unknown one); None: all."""
    from kvtui.conformance import CHECKS

    for name in check or ():
        if name not in CHECKS:
            fail(f"--check {name!r}: no such check{did_you_mean(name, list(CHECKS))}; `kvtui conformance --list` "
                 "names them")
    return list(dict.fromkeys(check)) if check else None


def _check_writable(path: Path, flag: str) -> None:
    """Exit 2 with one line now, before the server is reached or any check runs, when `path` (--json or
    --markdown) cannot be written: its folder does not exist, or the file cannot be opened for writing. A file
    this check creates is removed again (the results are written at the end)."""
    if not path.parent.is_dir():
        fail(f"{flag} {path}: its folder does not exist; choose a path in an existing folder")
    existed = path.exists()
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as e:
        fail(f"{flag} {path}: cannot write it ({e.strerror or e}); choose another {flag} path")
    if not existed:
        path.unlink(missing_ok=True)


def _list() -> None:
    from kvtui.conformance import CHECKS

    for c in CHECKS.values():
        model = f" --model {c.model}" if c.model != "default" else ""
        mutant = (f" (kvtui serve mutant{'s' if len(c.mutants) > 1 else ''}{model}: "
                  f"{', '.join(f'--fault {m}' for m in c.mutants)})" if c.mutants else "")
        out.print(f"{c.name:<18} {c.summary}{mutant}", markup=False, highlight=False, soft_wrap=True)


def conformance(
    target: target_option("Check the OpenAI-compatible server at this URL (default: start a kvtui serve of "
                          "kvtui's own engine in this process).") = None,
    check: Annotated[Optional[list[str]], typer.Option("--check", help="Run only this check (repeatable); "
                                                       "--list names them.")] = None,
    list_checks: Annotated[bool, typer.Option("--list", help="Name the checks, one line each, and exit.")] = False,
    fault: Annotated[Optional[list[FaultChoice]], typer.Option("--fault", metavar="FAULT", help="Without --target: start kvtui "
                                                               "serve with this isolation fault on (a mutant; "
                                                               "repeatable).")] = None,
    model: Annotated[str, typer.Option("--model", help="kvtui's name of the served model: its tokenizer plans "
                                       "the prompts (and without --target kvtui serve loads it).")] = "default",
    served_model: served_model_option("With --target: the model name to send (default: the first of "
                                      "/v1/models).") = TARGET.served_model,
    quick: Annotated[bool, typer.Option("--quick", help="Fewer requests per check (about half the time).")] = False,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Also write the results as JSON here.")] = None,
    markdown_path: Annotated[Optional[Path], typer.Option("--markdown", help="Also write the table as Markdown "
                                                          "here.")] = None,
    timeout: Timeout = TARGET.timeout_s,
    threads: Annotated[Optional[int], typer.Option("--threads", min=1, help="Without --target: torch threads for "
                                                   "the engine (default: all cores but one).",
                                                   rich_help_panel=TARGET_PANEL)] = None,
    tolerance: Annotated[Optional[float], typer.Option(
        "--tolerance", min=0.0, help="The server's numeric noise (nats): a top-2 logprob gap under which a changed "
        "greedy token is a numeric flip, and the most a same-token answer's logprobs may move against its solo "
        "run (prompt_cache). Default: 0.5 with --target, 1e-3 for kvtui's own float32 server.",
        rich_help_panel=TARGET_PANEL)] = None,
    server_release: Annotated[Optional[str], typer.Option(
        "--server-release", help="With --target: 'NAME VERSION' of a server that does not say its release itself "
        "(e.g. 'transformers-serve 5.25.0', the release its venv installed): recorded in --json and --markdown as "
        "the server's name and version, with what the server says (GET /version, /props, its server header, "
        "/v1/models owned_by) noted where it differs.",
        rich_help_panel=TARGET_PANEL)] = None,
) -> None:
    """Run every black-box isolation check (tenant salts, solo parity under load, n > 1, structured output,
    prompt embeddings, images, the prompt cache, recurrent state, request ids, LoRA adapters) against one server and
    print one table: pass, fail, or n/a with the reason. Exit 1 when a check fails."""
    if list_checks:
        _list()
        return
    names = _checks_asked(check)
    faults = fault_names(fault)
    if target is not None and faults:
        fail("--fault starts kvtui's own server with a fault and cannot apply to a --target server; drop --fault "
             "or --target")
    if target is not None and threads is not None:
        fail("--threads sets kvtui's own engine and cannot apply to a --target server; drop it")
    release = None
    if server_release is not None:
        if target is None:
            fail("--server-release names a --target server's release (kvtui's own server records kvtui's); drop it "
                 "or add --target")
        parts = server_release.strip().rsplit(" ", 1)
        if len(parts) != 2 or not all(parts) or not any(c.isdigit() for c in parts[1]):  # a version has a digit
            fail(f"--server-release {server_release!r}: give 'NAME VERSION', e.g. --server-release "
                 "'transformers-serve 5.25.0'")
        release = (parts[0].strip(), parts[1])
    for path, flag in ((json_path, "--json"), (markdown_path, "--markdown")):
        if path is not None:
            _check_writable(path, flag)
    if target is not None:
        from kvtui.cli.target import check_url

        _run(check_url(target), model, served_model, names, quick, timeout, json_path, markdown_path,
             tolerance=TARGET.tolerance if tolerance is None else tolerance, release=release)
        return
    _run_local(model, faults, threads, names, quick, timeout, json_path, markdown_path, tolerance)


def _run_local(model: str, faults: tuple[str, ...], threads: int | None, names, quick: bool, timeout: float,
               json_path: Path | None, markdown_path: Path | None, tolerance: float | None) -> None:
    from kvtui import __version__
    from kvtui.conformance.local import TOLERANCE, local_server
    from kvtui.models import ModelLoadError
    from kvtui.serve.main import BadInput

    label = "kvtui serve" + "".join(f" --fault {f}" for f in faults)
    from kvtui.conformance.local import describe

    say("note", f"starting {label} ({describe(model)}) on a free port")
    try:
        with local_server(model, faults, threads) as url:
            _run(url, model, None, names, quick, timeout, json_path, markdown_path, label=label,
                 tolerance=TOLERANCE if tolerance is None else tolerance, known=("kvtui", __version__))
    except (BadInput, ValueError, ModelLoadError) as e:
        fail(str(e))
    except OSError as e:
        fail(f"cannot start kvtui serve: {e}", EXIT_RUNTIME)


def _run(url: str, model: str, served_model: str | None, names, quick: bool, timeout: float,
         json_path: Path | None, markdown_path: Path | None, label: str | None = None, *, tolerance: float,
         known: tuple[str, str] | None = None, release: tuple[str, str] | None = None) -> None:
    """Connect, run the checks with progress lines, print the table, write the files, exit by the verdicts.
    `known`: (name, version) of the server where it does not say them; `release`: the user's --server-release,
    taken over what the server says (kvtui.remote.identity.identify)."""
    import httpx

    from kvtui.conformance import CHECKS, Server, run_checks
    from kvtui.conformance.report import print_table, write_json, write_markdown
    from kvtui.models import ModelLoadError, load_tokenizer
    from kvtui.remote.identity import identify
    from kvtui.remote.reach import TargetError, probe
    from kvtui.remote.session import SERVER_KINDS

    try:  # the one first contact every --target command makes, before the tokenizer's seconds
        first = probe(url, served_model)
    except TargetError as e:
        fail(str(e), EXIT_BAD_INPUT if label is None else EXIT_RUNTIME)  # a --target URL, or kvtui's own server
    try:
        tokenizer = load_tokenizer(model)
    except ModelLoadError as e:
        fail(f"--model: {e}")
    kind = SERVER_KINDS.get(first.get("owned_by"))
    identity = identify(url, first.get("owned_by"), known, release=release)
    server = Server(url=url, model=model, tokenizer=tokenizer, served_model=served_model or first.get("id"),
                    server_kind=kind, timeout_s=timeout, tolerance=tolerance, quick=quick,
                    say=lambda text: err.print(f"  {text}", markup=False, highlight=False))
    total = len(names) if names else len(CHECKS)
    done = []

    def progress(result) -> None:
        done.append(result)
        err.print(f"[{len(done)}/{total}] {result.check}: {result.verdict} ({result.seconds:.0f} s)", markup=False,
                  highlight=False)

    err.print(f"conformance of {url} ({identity.line}, model {server.served_model}): "
              f"{total} check{'s' if total != 1 else ''}", markup=False, highlight=False)
    try:
        results = run_checks(server, names, on_result=progress)
    except TargetError as e:  # its line names the URL
        fail(str(e), EXIT_RUNTIME)
    except httpx.HTTPError as e:
        fail(f"{url}: {e}", EXIT_RUNTIME)
    title = label or url
    print_table(results, title, out)
    try:
        if json_path is not None:
            write_json(json_path, results, url, label, identity.as_dict())
        if markdown_path is not None:
            write_markdown(markdown_path, results, title, identity.as_dict())
    except OSError as e:
        fail(f"cannot write the results ({e.strerror or e}); choose another --json / --markdown path")
    if any(r.verdict == "fail" for r in results):
        raise typer.Exit(EXIT_CONTAMINATION)
