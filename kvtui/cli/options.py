"""Option types and declarations more than one command shares, with the defaults of the options'
owners: the engine's knobs from kvtui.config.EngineConfig, `kvtui serve`'s from ServeOptions, the
`--target` options from TargetOptions. Each default is written once, by its owner.
"""

from __future__ import annotations

import enum
from typing import Annotated, Literal, Optional

import typer

from kvtui.cli.console import fail
from kvtui.config import EngineConfig
from kvtui.detect import DETECTOR_NAMES
from kvtui.faults import FAULT_NAMES
from kvtui.names import did_you_mean
from kvtui.remote.options import TargetOptions
from kvtui.serve.options import ServeOptions

ENGINE = EngineConfig()  # the engine's defaults
SERVE = ServeOptions()  # `kvtui serve`'s defaults
TARGET = TargetOptions(url="")  # a --target run's defaults (the URL is always given)
MODEL, DTYPE = SERVE.model, SERVE.dtype  # the model commands load when none is named, and its dtype

Isolation = Literal["on", "off"]
Api = Literal["auto", "chat", "completions"]
CostModel = Literal["auto", "default"]
SaltMode = Literal["per_tenant", "none"]

FaultChoice = enum.Enum("FaultChoice", {name: name for name in FAULT_NAMES}, type=str)
DETECTORS_HELP = "Comma-separated detectors, or 'none'."
DEFAULT_DETECTORS = ",".join(DETECTOR_NAMES)


def fault_names(chosen) -> tuple[str, ...]:
    """The names of the --fault choices given (none: ())."""
    return tuple(f.value for f in chosen or ())


def parse_detectors(text: str) -> tuple[str, ...]:
    """The detectors a --detectors value names ('none': none); exit 2 naming an unknown one."""
    chosen = () if text.strip() == "none" else tuple(d.strip() for d in text.split(",") if d.strip())
    unknown = [d for d in chosen if d not in DETECTOR_NAMES]
    if unknown:
        fail(f"--detectors: unknown detector {unknown[0]!r}{did_you_mean(unknown[0], DETECTOR_NAMES)}; use some of "
             f"{', '.join(DETECTOR_NAMES)} or 'none'")
    return chosen


# -- options `run --target` and `audit --target` share ----------------------------------------------
TARGET_PANEL = "Target server"


def enforce_eager_option():
    """--enforce-eager (vLLM's name): transformers' own modules instead of kvtui's fused forward."""
    return Annotated[bool, typer.Option("--enforce-eager", help="Run the model through transformers' own modules "
                                        "instead of kvtui's fused forward (same answers, slower; Llama-family "
                                        "models run fused by default, others always run the modules).")]


def compile_option():
    """--compile/--no-compile: the compiled decode step (EngineConfig.compile); default: where it can run."""
    return Annotated[Optional[bool], typer.Option(
        "--compile/--no-compile", help="Run decode steps as one compiled inductor graph (kvtui/engine/compiled.py; "
        "Llama-family models on kvtui's fused forward, a C++ compiler needed; the first decode steps compile, a "
        "minute or more per shape, once per machine: later runs load the code from kvtui's cache in seconds). "
        "Default: eager, since the compiled step measured no faster "
        "(docs/performance.md); a note says which runs and why.")]


def batch_invariant_option():
    """--batch-invariant/--no-batch-invariant: override the scenario's engine.batch_invariant."""
    return Annotated[Optional[bool], typer.Option(
        "--batch-invariant/--no-batch-invariant", help="Every row's logits bitwise independent of the batch "
        "(fixed row tiles, attention per query position), so the reference check counts any differing token "
        "with no tolerance: exact verdicts in bfloat16 and float16. Slower; Llama-family models. Default: the "
        "scenario's engine.batch_invariant.")]


def target_option(help: str):
    """--target URL (default: none, kvtui's own engine)."""
    return Annotated[Optional[str], typer.Option("--target", help=help, rich_help_panel=TARGET_PANEL)]


def api_option(help: str):
    """--api: the endpoint a target run sends to (default TARGET.api)."""
    return Annotated[Api, typer.Option(help=help, rich_help_panel=TARGET_PANEL)]


def served_model_option(help: str):
    """--served-model: the model name a target run sends (default TARGET.served_model)."""
    return Annotated[Optional[str], typer.Option("--served-model", help=help, rich_help_panel=TARGET_PANEL)]


MaxConcurrency = Annotated[int, typer.Option("--max-concurrency", min=1, help="With --target: requests in flight "
                                             "at most.", rich_help_panel=TARGET_PANEL)]
Timeout = Annotated[float, typer.Option("--timeout", min=0.001, help="With --target: seconds one request may take, "
                                        "no retry.", rich_help_panel=TARGET_PANEL)]
Tolerance = Annotated[float, typer.Option("--tolerance", min=0.0, help="With --target: top-2 logprob gap (nats) "
                                          "under which a changed token is numeric.", rich_help_panel=TARGET_PANEL)]
