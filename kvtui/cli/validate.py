"""`kvtui validate SCENARIO`: the scenario checked and printed normalized."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from kvtui.cli.console import out, say
from kvtui.cli.inputs import check_lengths, load_scenario, refuse_idle_faults, refuse_misfit_faults
from kvtui.cli.options import FaultChoice, fault_names
from kvtui.config import Layout


def validate(
    scenario: Annotated[Path, typer.Argument(help="Scenario YAML file.")],
    fault: Annotated[Optional[list[FaultChoice]], typer.Option("--fault", metavar="FAULT", help="Check this fault too, as `kvtui "
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

    spec = load_scenario(scenario)
    refuse_misfit_faults(scenario, spec, fault_names(fault), model)
    refuse_idle_faults(scenario, spec, fault_names(fault), layout=layout)
    from kvtui.models import ModelLoadError, load_tokenizer

    try:
        tokenizer = load_tokenizer(model or spec.model)
    except ModelLoadError as e:
        say("note", f"request lengths not checked: {e}")
    else:
        check_lengths(scenario, spec, tokenizer, model)
    out.print(yaml.safe_dump(spec.normalized(), sort_keys=False), end="", highlight=False, markup=False)
