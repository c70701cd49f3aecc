"""`kvtui bench` and `kvtui calibrate`: measure kvtui beside its peers; fit the virtual clock's step costs
to this machine."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvtui.cli.console import err, fail, out
from kvtui.cli.inputs import load_model
from kvtui.cli.options import DTYPE, ENGINE, MODEL
from kvtui.config import DType

BenchPart = enum.Enum("BenchPart", {name: name for name in ("overhead", "batch", "knobs", "peers", "bf16",
                                                            "detectors", "profile", "penalties", "faults",
                                                            "transcribe", "images", "loadgen")}, type=str)


def bench(
    part: Annotated[Optional[list[BenchPart]], typer.Option("--part", metavar="PART", help="Run only this part (repeatable): "
                                                            "overhead, batch, knobs, peers, bf16, detectors, "
                                                            "profile, penalties, faults, transcribe, images, "
                                                            "loadgen.")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="Fewer repeats and shapes: under 10 minutes on 2 cores.")]
    = False,
    output: Annotated[Path, typer.Option("--output", "-o", help="JSON file for the figures (a .md beside it).")] =
    Path("bench-results/bench.json"),
    model: Annotated[str, typer.Option(help="Model to benchmark.")] = MODEL,
    dtype: Annotated[DType, typer.Option(metavar="DTYPE", help="Model dtype: float32, bfloat16 or float16.")] = DTYPE,
    threads: Annotated[Optional[int], typer.Option(help="torch threads (default: all cores).", min=1)] = None,
    rates: Annotated[str, typer.Option("--rates", help="loadgen: requested rates (req/s), comma-separated.")]
    = "100,200,400",
    first_token_ms: Annotated[float, typer.Option("--first-token-ms", min=0.0, help="loadgen: the mock server's "
                                                  "first token after this many ms.")] = 20.0,
    gap_ms: Annotated[float, typer.Option("--gap-ms", min=0.0, help="loadgen: the mock's gap between tokens (ms).")]
    = 5.0,
    tokens: Annotated[int, typer.Option("--tokens", min=1, help="loadgen: tokens per answer.")] = 32,
    seconds: Annotated[Optional[float], typer.Option("--seconds", min=0.1, help="loadgen: each run's planned "
                                                     "length (default 5 s, 3 with --quick).")] = None,
) -> None:
    """Measure kvtui side by side with a bare transformers forward, transformers' generate and continuous
    batching, and llama.cpp's server (when built): medians of repeats with min/max, JSON plus Markdown.
    `--part loadgen` loads no model: kvtui's --target client against `vllm bench serve` on a mock server."""
    import torch

    from kvtui.bench import MODEL_FREE, PARTS, run_suite

    if threads:
        torch.set_num_threads(threads)
    parts = [p.value for p in part] if part else list(PARTS)
    try:
        chosen = tuple(float(r) for r in rates.split(",") if r.strip())
    except ValueError:
        chosen = ()
    if not chosen or min(chosen) <= 0:
        fail(f"--rates {rates!r}: give positive request rates, comma-separated (e.g. 100,200,400)")
    loaded = None if set(parts) <= MODEL_FREE else load_model(model, dtype, ENGINE.device)
    options = {"loadgen": {"rates": chosen, "first_token_ms": first_token_ms, "gap_ms": gap_ms, "tokens": tokens,
                           "seconds": seconds}}
    run_suite(loaded, name=model, parts=parts, quick=quick, output=output, console=out, part_options=options)
    out.print(f"figures written to {output} and {output.with_suffix('.md')}")


def calibrate_cmd(
    model: Annotated[str, typer.Option(help="Model to calibrate for.")] = MODEL,
    dtype: Annotated[Optional[DType], typer.Option(metavar="DTYPE", help=f"Model dtype (default {DTYPE}; with --numeric: "
                                                   "bfloat16 and float16, each in turn).")] = None,
    device: Annotated[str, typer.Option(help="torch device.")] = ENGINE.device,
    numeric: Annotated[bool, typer.Option("--numeric", help="Measure instead how far batching moves the logits "
                                          "in this dtype on this CPU: the reference detector's numeric tolerance.")]
    = False,
) -> None:
    """Fit the virtual clock's step-cost model to this machine (a few seconds of engine steps) and store
    it for the model, dtype and device; virtual-clock runs of that model use it from then on. With
    --numeric, measure the batched-against-solo logit spread instead and store it for the model, dtype,
    CPU, torch version and threads; reference checks of bfloat16 and float16 runs label with it (without
    --dtype both are measured; float32 needs none: one line and exit 2)."""
    if numeric:
        return _calibrate_numeric(model, dtype, device)
    loaded = load_model(model, dtype or DTYPE, device)
    from kvtui.calibrate import calibrate

    data = calibrate(loaded, device=device, console=err)
    c = data["coefficients"]
    out.print(f"step seconds = {c['base_s']:.4f} + {c['per_row_s']:.2e} x rows + {c['per_token_s']:.2e} x tokens "
              f"+ {c['per_key_s']:.2e} x keys  (R^2 {data['r2']:.3f}, {len(data['samples'])} shapes, "
              f"{data['seconds']:.0f} s)")
    out.print(f"stored in {data['file']}; `kvtui run --cost-model default` ignores it")


def _calibrate_numeric(model: str, dtype: str | None, device: str) -> None:
    """`kvtui calibrate --numeric`: measure, store and print the numeric tolerance (kvtui/detect/tolerance.py) of
    `dtype`, or of every dtype that needs one (bfloat16, float16) when None; a dtype that needs none (float32)
    is one line and exit 2 naming what to pass."""
    from kvtui.detect.tolerance import CALIBRATED_DTYPES, FLOAT32, measure, store

    measured = [str(d).replace("torch.", "") for d in CALIBRATED_DTYPES]
    if dtype is not None and dtype not in measured:
        fail(f"--dtype {dtype}: --numeric measures the batch rounding of {' and '.join(measured)}; {dtype} keeps "
             f"the built-in tolerance ({FLOAT32:g} logits, far above its rounding): pass "
             f"{' or '.join(f'--dtype {d}' for d in measured)}, or leave --dtype out to measure both")
    for name in [dtype] if dtype is not None else measured:
        loaded = load_model(model, name, device)
        try:
            record = measure(loaded, progress=lambda line, name=name: err.print(f"  {name} {line}"))
        except ValueError as e:
            fail(str(e))
        path = store(record)
        out.print(f"{name}: numeric tolerance {record['tolerance']:.3g} logits = {record['safety']:g} x largest "
                  f"spread {record['largest']:.3g} ({record['positions']} positions, {record['cpu']}, torch "
                  f"{record['torch']}, {record['threads']} thread{'s' if record['threads'] != 1 else ''}, "
                  f"{record['seconds']:.0f} s)", soft_wrap=True)
        out.print(f"{name}: stored in {path}; reference checks of {record['model']} in {record['dtype']} on this CPU "
                  "use it", soft_wrap=True)
