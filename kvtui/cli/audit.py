"""`kvtui audit SCENARIO`: the noninterference audit, or --timing the prefix-cache side channel; with
--target, of a server over HTTP (kvtui/cli/target.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from kvtui.audit_timing import DEFAULT_PROBES, DEFAULT_TARGET_BLOCK_SIZE
from kvtui.cli.console import EXIT_CONTAMINATION, err, fail, out
from kvtui.cli.inputs import check_lengths, load_model, load_scenario, refuse_idle_faults
from kvtui.cli.options import (
    ENGINE,
    TARGET,
    TARGET_PANEL,
    FaultChoice,
    MaxConcurrency,
    SaltMode,
    Timeout,
    Tolerance,
    api_option,
    fault_names,
    served_model_option,
    target_option,
)


def audit(
    scenario: Annotated[Path, typer.Argument(help="Scenario YAML file.")],
    model: Annotated[Optional[str], typer.Option("--model", help="Override the scenario's model.")] = None,
    fault: Annotated[Optional[list[FaultChoice]], typer.Option("--fault", metavar="FAULT", help="Isolation fault on "
                                                               "(repeatable).")] = None,
    timing: Annotated[bool, typer.Option("--timing", help="Instead: the prefix-cache timing side channel (paged "
                                         "KV): how well TTFT tells apart probes whose prefix another tenant has "
                                         "cached, with and without per-tenant salts.")] = False,
    probes: Annotated[int, typer.Option(help="--timing: probes of each class (matching / not).", min=2,
                                        max=1000)] = DEFAULT_PROBES,
    block_size: Annotated[Optional[int], typer.Option("--block-size", min=1, max=4096, help="--timing --target: "
                                                      "tokens per probe block when the server publishes no block "
                                                      f"size (vLLM does, in vllm:cache_config_info); default {DEFAULT_TARGET_BLOCK_SIZE}.",
                                                      rich_help_panel=TARGET_PANEL)] = None,
    cache_salt: Annotated[SaltMode, typer.Option("--cache-salt", help="--timing --target: per_tenant: kvtui gives "
                                                 "each tenant its own cache_salt (does the server honour it?); "
                                                 "none: the tenants send no salt, as the deployment's clients do "
                                                 "(does something else separate them?).",
                                                 rich_help_panel=TARGET_PANEL)] = "per_tenant",
    target: target_option("Audit an OpenAI-compatible server at this URL instead of kvtui's engine.") = None,
    api: api_option("With --target: chat or completions (auto: chat when every prompt has text; audio prompts always go to /v1/audio/transcriptions).") = TARGET.api,
    served_model: served_model_option("With --target: the model name to send.") = TARGET.served_model,
    max_concurrency: MaxConcurrency = TARGET.max_concurrency,
    timeout: Timeout = TARGET.timeout_s,
    tolerance: Tolerance = TARGET.tolerance,
) -> None:
    """Noninterference audit: re-run with co-batched neighbours' prompts replaced; a request's tokens
    must not change. Exit 1 when some did. With --timing: the prefix-cache timing side channel; exit 1
    when, with per-tenant salts, a tenant's probe hit another tenant's cached blocks. With --target, the
    neighbour-replacement runs against a server; with --timing --target, the timing side channel of the
    server (exit 1 when one tenant can tell another's cached prefix)."""
    spec = load_scenario(scenario)
    if target is not None:
        from kvtui.cli import target as command

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
    refuse_idle_faults(scenario, spec, fault_names(fault))
    loaded = load_model(model or spec.model, spec.dtype, ENGINE.device)
    if timing:
        _timing_audit(scenario, spec, loaded, fault_names(fault), probes)
        return
    check_lengths(scenario, spec, loaded.tokenizer)
    from kvtui.audit import run_audit

    try:
        events = run_audit(spec, loaded, faults=fault_names(fault), console=err)
    except ValueError as e:  # an engine the model or the memory cannot hold
        fail(f"{scenario}: {e}")
    from kvtui.summary import print_contamination

    print_contamination(events, out)
    if events:
        err.print(f"[bold red]noninterference violated: {len(events)} requests changed with their neighbours[/]")
        raise typer.Exit(EXIT_CONTAMINATION)
    out.print("noninterference holds: every request's tokens stayed the same with its neighbours replaced")


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
