"""Sweep random sampled (temperature > 0) scenarios with isolation intact and count the reports.

With isolation intact every counted report (cross_request, cross_tenant, corruption) is a false
alarm. Low-precision runs (bfloat16, float16) differ from their solo references by rounding, so
their reference divergences must come out `numeric`. Each scenario is small (3-6 requests, 8-16
output tokens) and random in layout, padding side, KV mode, slots, prompts, arrival rate and
sampling (temperature, top_k, top_p); scenario i of a sweep depends only on (--seed, i, dtype).

    OMP_NUM_THREADS=1 python scripts/sweep_sampled.py --dtype bfloat16 --runs 30
    OMP_NUM_THREADS=1 python scripts/sweep_sampled.py --dtype float16 --runs 20 --model default

Prints one line per scenario (its reports, counted and numeric) and a total line:
`runs N, runs with counted reports R, counted reports C, numeric reports M`. Exit 1 if C > 0.

    OMP_NUM_THREADS=1 python scripts/sweep_sampled.py --faults --dtype bfloat16 --temperature 0.8

runs each fault scenario of scenarios/faults/ instead, sampled at --temperature in --dtype: one line per
fault (counted reports, by detector, and the fault's kind found or not; a fault that does not act on the
model's kind is skipped); exit 1 if a fault went uncaught.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter

import torch


def random_scenario(rng: random.Random, model: str, dtype: str) -> str:
    """The YAML text of one random sampled scenario with no faults."""
    kv = rng.choice(["slots", "slots", "paged"])
    layout = rng.choice(["padded", "packed"])
    side = rng.choice(["left", "right"])
    slots = rng.randint(2, 4)
    n = rng.randint(3, 6)
    out = rng.choice([8, 12, 16])
    prompts = rng.choice([
        "{kind: passphrase}",
        f"{{kind: synthetic, prompt_tokens: {{dist: uniform, min: 4, max: {rng.choice([16, 32, 48])}}}}}",
        "{kind: system_prompt, count: 2, system_tokens: 16, user_tokens: {dist: uniform, min: 2, max: 8}}",
    ])
    pool = f"kv: paged, block_size: 16, prefix_caching: {str(rng.random() < 0.5).lower()}" if kv == "paged" \
        else f"slots: {slots}"
    temperature = rng.choice([0.5, 0.7, 0.8, 1.0, 1.2])
    top_k = rng.choice([0, 0, 20, 50])
    top_p = rng.choice([1.0, 1.0, 0.9, 0.95])
    return f"""name: sweep
seed: {rng.randint(0, 10_000)}
max_requests: {n}
model: {model}
dtype: {dtype}
engine: {{{pool}, max_len: 256, max_batch_size: {slots}, layout: {layout}, padding_side: {side}}}
arrivals: {{process: poisson, rate_per_s: {rng.choice([2.0, 8.0, 50.0])}}}
prompts: {prompts}
output_tokens: {out}
sampling: {{temperature: {temperature}, top_k: {top_k}, top_p: {top_p}, ignore_eos: {str(rng.random() < 0.5).lower()}}}
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0, help="sweep seed (scenario i is fixed by seed, i, dtype)")
    parser.add_argument("--model", default="default", help="default (SmolLM2), tiny-llama, ...")
    parser.add_argument("--verbose", action="store_true", help="print each counted report")
    parser.add_argument("--faults", action="store_true", help="run the fault scenarios of scenarios/faults/")
    parser.add_argument("--temperature", type=float, default=0.8, help="with --faults: the sampling temperature")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from kvtui.models import load_model
    from kvtui.scenario import parse_scenario
    from kvtui.session import Session

    loaded = load_model(args.model, dtype=args.dtype, progress=False)
    if args.faults:
        return fault_sweep(loaded, args)
    totals, started, largest = Counter(), time.perf_counter(), {"shift": 0.0, "spread": 0.0}
    for i in range(args.runs):
        rng = random.Random(f"{args.seed}-{i}-{args.dtype}")
        spec = parse_scenario(random_scenario(rng, args.model, args.dtype), source=f"sweep-{i}")
        session = Session(spec, loaded, clock="virtual", progress=print)
        session.run()
        reports = session.contamination
        counted = [e for e in reports if e.counts]
        numeric = [e for e in reports if e.kind == "numeric"]
        totals.update(runs=1, counted=len(counted), numeric=len(numeric), bad_runs=bool(counted))
        for e in numeric:  # the largest moves labelled numeric (sampled tokens: log-odds x temperature, logits)
            shift, spread = getattr(e.evidence, "draw_shift", None), getattr(e.evidence, "logit_spread", None)
            if shift is not None:
                largest["shift"] = max(largest["shift"], shift * spec.sampling.temperature)
                largest["spread"] = max(largest["spread"], spread)
        print(f"{i:3d} requests {spec.max_requests} counted {len(counted)} numeric {len(numeric)} "
              f"({', '.join(f'{k} {v}' for k, v in Counter(e.kind + '/' + e.detector for e in reports).items())})",
              flush=True)
        for e in counted if args.verbose else ():
            print(f"      {e.victim} {e.kind} {e.detector} {e.evidence}", flush=True)
    print(f"{args.dtype} {args.model}: runs {totals['runs']}, runs with counted reports {totals['bad_runs']}, "
          f"counted reports {totals['counted']}, numeric reports {totals['numeric']}; largest numeric "
          f"draw shift x temperature {largest['shift']:.3g}, logit spread {largest['spread']:.3g} "
          f"({time.perf_counter() - started:.0f} s); {_tolerance(session)}")
    return 1 if totals["counted"] else 0


def fault_sweep(loaded, args) -> int:
    """Each scenarios/faults/*.yaml sampled at args.temperature in args.dtype; 1 if one is not caught."""
    from pathlib import Path

    from kvtui.faults import FAULTS, acts_on
    from kvtui.scenario import load_scenario
    from kvtui.session import Session

    missed, started = [], time.perf_counter()
    for path in sorted(Path(__file__).resolve().parent.parent.glob("scenarios/faults/*.yaml")):
        if not acts_on(path.stem, loaded.kind):  # a Whisper or image fault: the engine refuses it on this model
            print(f"{path.stem:24s} skipped: it acts on {', '.join(FAULTS[path.stem].models)} models", flush=True)
            continue
        spec = load_scenario(str(path))
        sampling = spec.sampling.model_copy(update={"temperature": args.temperature})
        spec = spec.model_copy(update={"dtype": args.dtype, "sampling": sampling})
        session = Session(spec, loaded, clock="virtual", progress=print)
        session.run()
        counted = [e for e in session.contamination if e.counts]
        numeric = [e for e in session.contamination if e.kind == "numeric"]
        kind = FAULTS[path.stem].kind
        if not counted:  # caught: the run fails as `expect: {contamination: detected}` wants
            missed.append(path.stem)
        print(f"{path.stem:24s} counted {len(counted):3d} numeric {len(numeric):3d} findings {len(session.metrics.findings)}"
              f", of kind {kind} {session.summary.findings_by_kind.get(kind, 0)} "
              f"({', '.join(f'{k} {v}' for k, v in sorted(Counter(e.detector for e in counted).items()))})", flush=True)
        for e in session.contamination if args.verbose else ():
            if e.detector == "reference":
                ev = e.evidence
                print(f"      {e.victim} {e.kind} token {ev.token_index} draw shift {getattr(ev, 'draw_shift', None)} "
                      f"of {getattr(ev, 'draw_tolerance', None)}, logits moved {getattr(ev, 'logit_spread', None)} "
                      f"of {ev.tolerance}, numeric flips before it {getattr(ev, 'numeric_flips', None)}", flush=True)
    print(f"{args.dtype} {args.model} temperature {args.temperature}: faults missed {len(missed)}"
          f"{' (' + ', '.join(missed) + ')' if missed else ''} ({time.perf_counter() - started:.0f} s); "
          f"{_tolerance(session)}")
    return 1 if missed else 0


def _tolerance(session) -> str:
    """The numeric tolerance the reference detector labelled with, and where it came from."""
    from kvtui.summary import tolerance_text

    return tolerance_text(session.reference.numeric.described)


if __name__ == "__main__":
    sys.exit(main())
