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

MIX = [  # every sampling parameter the engine has, each as one group of the batch (scenario `sampling.mix`)
    "{{fraction: 0.2, repetition_penalty: {rep}}}",
    "{{fraction: 0.2, frequency_penalty: {freq}, presence_penalty: {pres}}}",
    "{{fraction: 0.15, logit_bias: {{\"13\": -100, \"198\": -100, \"279\": 3}}, bad_words: [\" the\", \" and\"]}}",
    "{{fraction: 0.15, min_tokens: {min_tokens}}}",
]


def random_scenario(rng: random.Random, model: str, dtype: str, every: bool = False,
                    invariant: bool | None = None) -> str:
    """The YAML text of one random sampled scenario with no faults; `every`: a sampling mix with every
    sampling parameter (penalties, logit_bias, bad_words, min_tokens, stop strings, n > 1, structured
    output); `invariant`: engine.batch_invariant (None: the default, on for bfloat16/float16)."""
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
    extra = ""
    if every:
        groups = [g.format(rep=rng.choice([1.1, 1.3]), freq=rng.choice([0.4, 0.8]), pres=rng.choice([0.3, 0.6]),
                           min_tokens=rng.choice([4, 8])) for g in rng.sample(MIX, rng.randint(2, len(MIX)))]
        extra = (f", n: 2, n_fraction: {rng.choice([0.25, 0.5])}, mix: [{', '.join(groups)}]"
                 f", structured: {{fraction: 0.2, regex: '[A-Z]{{2,6}}-[0-9]{{2,4}}'}}"
                 + (", stop: ['. ']" if rng.random() < 0.5 else ""))
    knob = "" if invariant is None else f", batch_invariant: {str(invariant).lower()}"
    return f"""name: sweep
seed: {rng.randint(0, 10_000)}
max_requests: {n}
model: {model}
dtype: {dtype}
engine: {{{pool}, max_len: 256, max_batch_size: {slots}, layout: {layout}, padding_side: {side}{knob}}}
arrivals: {{process: poisson, rate_per_s: {rng.choice([2.0, 8.0, 50.0])}}}
prompts: {prompts}
output_tokens: {out}
sampling: {{temperature: {temperature}, top_k: {top_k}, top_p: {top_p}, ignore_eos: {str(rng.random() < 0.5).lower()}{extra}}}
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
    parser.add_argument("--every", action="store_true", help="a sampling mix with every sampling parameter "
                        "(penalties, logit_bias, bad_words, min_tokens, stop, n > 1, structured output)")
    parser.add_argument("--batch-invariant", choices=["on", "off", "default"], default="default",
                        help="engine.batch_invariant of every run (default: the engine's default, on for "
                        "bfloat16/float16 with the reference detector)")
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
        invariant = {"on": True, "off": False, "default": None}[args.batch_invariant]
        spec = parse_scenario(random_scenario(rng, args.model, args.dtype, args.every, invariant), source=f"sweep-{i}")
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
    print(f"{args.dtype} {args.model} batch-invariant {args.batch_invariant}{' every parameter' if args.every else ''}: "
          f"runs {totals['runs']}, runs with counted reports {totals['bad_runs']}, "
          f"counted reports {totals['counted']}, numeric reports {totals['numeric']}; largest numeric "
          f"draw shift x temperature {largest['shift']:.3g}, logit spread {largest['spread']:.3g} "
          f"({time.perf_counter() - started:.0f} s); {_tolerance(session)}")
    return 1 if totals["counted"] else 0


def fault_sweep(loaded, args) -> int:
    """Each scenarios/faults/*.yaml sampled at args.temperature in args.dtype (its own model: the speech and
    image faults' scenarios name theirs); one line per fault: counted reports, whether one names both
    victim and source, the step of the first counted report; then the median of those steps. 1 if a
    fault is not caught."""
    from pathlib import Path
    from statistics import median

    from kvtui.faults import FAULTS
    from kvtui.models import load_model
    from kvtui.scenario import load_scenario
    from kvtui.session import Session

    models = {args.model: loaded}
    missed, unsourced, firsts, started = [], [], [], time.perf_counter()
    for path in sorted(Path(__file__).resolve().parent.parent.glob("scenarios/faults/*.yaml")):
        spec = load_scenario(str(path))
        sampling = spec.sampling.model_copy(update={"temperature": args.temperature})
        update = {"dtype": args.dtype, "sampling": sampling}
        if args.batch_invariant != "default":
            update["engine"] = spec.engine.model_copy(update={"batch_invariant": args.batch_invariant == "on"})
        spec = spec.model_copy(update=update)
        name = spec.model if spec.model != "default" else args.model
        if name not in models:
            models[name] = load_model(name, dtype=args.dtype, progress=False)
        session = Session(spec, models[name], clock="virtual", progress=print)
        session.run()
        counted = [e for e in session.contamination if e.counts]
        numeric = [e for e in session.contamination if e.kind == "numeric"]
        sourced = any(e.victim and e.source for e in counted)
        first = min((e.step for e in counted), default=None)
        kind = FAULTS[path.stem].kind
        if not counted:  # caught: the run fails as `expect: {contamination: detected}` wants
            missed.append(path.stem)
        elif not sourced:
            unsourced.append(path.stem)
        if first is not None:
            firsts.append(first)
        print(f"{path.stem:24s} counted {len(counted):3d} numeric {len(numeric):3d} findings {len(session.metrics.findings)}"
              f", of kind {kind} {session.summary.findings_by_kind.get(kind, 0)}, source named {'yes' if sourced else 'no'}"
              f", first at step {first} "
              f"({', '.join(f'{k} {v}' for k, v in sorted(Counter(e.detector for e in counted).items()))})", flush=True)
        for e in session.contamination if args.verbose else ():
            if e.detector == "reference":
                ev = e.evidence
                print(f"      {e.victim} {e.kind} token {ev.token_index} draw shift {getattr(ev, 'draw_shift', None)} "
                      f"of {getattr(ev, 'draw_tolerance', None)}, logits moved {getattr(ev, 'logit_spread', None)} "
                      f"of {ev.tolerance}, numeric flips before it {getattr(ev, 'numeric_flips', None)}", flush=True)
    print(f"{args.dtype} {args.model} temperature {args.temperature} batch-invariant {args.batch_invariant}: "
          f"faults missed {len(missed)}{' (' + ', '.join(missed) + ')' if missed else ''}, caught without a "
          f"source {len(unsourced)}{' (' + ', '.join(unsourced) + ')' if unsourced else ''}, median step of the "
          f"first counted report {median(firsts) if firsts else None} ({time.perf_counter() - started:.0f} s); "
          f"{_tolerance(session)}")
    return 1 if missed else 0


def _tolerance(session) -> str:
    """The numeric tolerance the reference detector labelled with, and where it came from."""
    from kvtui.summary import tolerance_text

    return tolerance_text(session.observer("reference").detector.numeric.described)


if __name__ == "__main__":
    sys.exit(main())
