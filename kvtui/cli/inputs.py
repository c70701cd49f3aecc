"""Loading a command's inputs (scenario, model, tokenizer) and the checks before a run, each failure one
line on stderr and exit 2."""

from __future__ import annotations

from pathlib import Path

import typer

from kvtui.cli.console import EXIT_BAD_INPUT, fail, say
from kvtui.model_kinds import ModelKind


def load_scenario(path: Path):
    """The scenario at `path`, its warnings printed; on errors one line each and exit 2."""
    from kvtui.scenario import ScenarioError
    from kvtui.scenario import load_scenario as read

    try:
        spec = read(path)
    except ScenarioError as e:
        for line in e.errors:
            say("error", line)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    for line in spec.warnings:
        say("warning", line)
    return spec


def load_model(name: str, dtype: str, device: str):
    """The model `name` (kvtui.models.load_model, with progress); exit 2 with one line when it cannot load."""
    from kvtui.models import ModelLoadError
    from kvtui.models import load_model as load
    from kvtui.models.hardware import bf16_note

    note = bf16_note(dtype, device)
    if note:
        say("note", note)
    try:
        loaded = load(name, dtype=dtype, device=device, progress=True)
    except ModelLoadError as e:
        fail(str(e))
    from kvtui.engine.fused import choose_kernels_at_load

    try:
        choose_kernels_at_load(loaded.model, lambda line: say("note", line))
    except ValueError as e:  # a bad KVTUI_LINEAR_KERNEL
        fail(str(e))
    if loaded.kind is ModelKind.HYBRID:
        from kvtui.engine.hybrid import FORWARD_NOTE

        say("note", f"{loaded.model_id} {FORWARD_NOTE}")
    return loaded


def load_tokenizer(name: str):
    """The tokenizer of model `name`; exit 2 with one line when it cannot load."""
    from kvtui.models import ModelLoadError
    from kvtui.models import load_tokenizer as load

    try:
        return load(name)
    except ModelLoadError as e:
        fail(str(e))


def check_lengths(path: Path, spec, tokenizer, model: str | None = None) -> list:
    """Plan the scenario's requests and check that they fit the engine: exit 2 with one line when a
    logit_bias token id is outside the tokenizer's vocabulary, when no request fits (every one would be
    rejected, so the run would test nothing) or when the prompts and the model (`model`, else the
    scenario's) do not go together (audio prompts need a speech model and the other way round), or when
    sampling.structured does not compile (every constrained request would be rejected), a warning line
    when some do not fit. Returns the planned requests."""
    from kvtui.scenario import plan_requests
    from kvtui.scenario.fit import fit_lines
    from kvtui.scenario.plan import audio_mismatch
    from kvtui.scenario.sampling import vocabulary_problem

    mismatch = audio_mismatch(spec, tokenizer, model or spec.model)
    if mismatch:
        fail(f"{path}: {mismatch}")
    problem = vocabulary_problem(spec.sampling, len(tokenizer)) if hasattr(tokenizer, "__len__") else None
    if problem:
        fail(f"{path}: {problem}")
    problem = _structured_problem(spec, tokenizer)
    if problem:
        fail(f"{path}: sampling.structured: {problem}; fix the constraint or remove it")
    planned = plan_requests(spec, tokenizer)
    errors, warnings = fit_lines(spec, planned, str(path))
    for line in warnings:
        say("warning", line)
    if errors:
        fail(errors[0])
    return planned


def _structured_problem(spec, tokenizer) -> str | None:
    """Why the scenario's structured-output constraint cannot be compiled for this tokenizer (the
    grammar library's reason, or that xgrammar is not installed), None when it compiles or is absent."""
    if spec.sampling.structured is None or not hasattr(tokenizer, "__len__"):
        return None
    from kvtui.engine.grammar import GrammarStage

    try:
        GrammarStage(tokenizer, len(tokenizer)).compile(spec.sampling.structured.spec())
    except ValueError as e:
        return str(e)
    return None


# faults that need a kind of request (kvtui.scenario.fit._request_misfit): what a scenario must have
REQUEST_NEEDS = {"cow_missing": "a scenario with sampling.n of 2 or more",
                 "stale_bitmask": "a scenario with sampling.structured"}


def refuse_misfit_faults(path: Path, spec, faults: tuple[str, ...], model: str | None) -> None:
    """Exit 2 with one line for a --fault that does not act on the run's kind of model (an image fault on a
    text model, a cross-attention fault on a text model), named with the fix; checked before the engine
    settings, since no setting makes such a fault act. Models known by name only (a path is checked
    when it is loaded)."""
    from kvtui.faults import kind_refusal, server_faults
    from kvtui.models.registry import kind_of

    for served in server_faults(faults):
        fail(f"{path}: --fault {served} acts in kvtui serve's HTTP layer, not in kvtui's engine, so a local run "
             f"cannot show it; serve with `kvtui serve --fault {served}` and audit that server with `kvtui run "
             "scenarios/request_ids.yaml --target http://127.0.0.1:8000 --headless`")
    name = model or spec.model
    kind = kind_of(name)
    problem = kind_refusal(faults, kind, name)
    if problem:
        fail(f"{path}: {problem}")


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
        if fault.scope == "server":
            need = f"`kvtui serve --fault {name}` and a --target run against it"
        elif e.kv not in fault.kv:
            need = f"a scenario with engine.kv: {fault.kv[0]}"
        elif "prefix_caching" in fault.needs and not e.prefix_caching:
            need = "--prefix-caching (or engine.prefix_caching: true)"
        elif name in REQUEST_NEEDS and "acts on" in why:
            need = REQUEST_NEEDS[name]
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


def refuse_lora_modes(path: Path, spec, *, enforce_eager: bool, batch_invariant: bool | None) -> None:
    """Exit 2 with one line, before any model loads, when the scenario loads LoRA adapters and
    --enforce-eager or --batch-invariant puts the engine in a mode that cannot run them: the check
    (config.lora_mode_problem) `kvtui serve` asks of its flags and the scenario schema of
    engine.batch_invariant."""
    from kvtui.config import lora_mode_problem

    loaded = spec.lora.loaded if spec.lora is not None else ()
    problem = loaded and lora_mode_problem(enforce_eager=enforce_eager, batch_invariant=bool(batch_invariant))
    if problem:
        flag = "--enforce-eager" if enforce_eager else "--batch-invariant"
        fail(f"{path}: {problem}, and the scenario's lora section loads {', '.join(loaded)}: drop {flag}, or the "
             "lora section")
