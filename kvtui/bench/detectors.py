"""The in-engine detectors' cost: decode tokens/s with slot_taint and attention_flow on vs off (batch 8),
and the reference detector's own time (it runs off the step path, so its step cost is 0)."""

from __future__ import annotations

import time

from kvtui.bench.common import Spread, engine_for, make_prompts, run_all
from kvtui.detect.reference import PendingCheck, ReferenceDetector
from kvtui.engine import SamplingParams

CONFIGS = {"off": (False, False), "attention_flow": (True, False), "slot_taint": (False, True), "both": (True, True)}


def run(loaded, *, name: str, quick: bool, console, batch: int = 8, new_tokens: int = 32) -> dict:
    prompts = make_prompts(loaded.tokenizer, batch, 0, 40, 60)
    samples: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for _ in range(1 if quick else 3):
        for config, (flow, taint) in CONFIGS.items():
            console.print(f"  detectors: {config}")
            engine = engine_for(loaded.model, prompts, new_tokens)
            engine.measure_flow, engine.detect_taint = flow, taint
            _, _, reports = run_all(engine, prompts, new_tokens)
            decode = [r for r in reports if r.prefill_tokens == 0 and r.decode_tokens]
            samples[config].append(sum(r.decode_tokens for r in decode) / sum(r.wall_s for r in decode))
    ref = ReferenceDetector(loaded, loaded.tokenizer, batch=batch)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        ref.on_finish(PendingCheck(f"r{i}", tuple(p), (0,) * new_tokens, (1.0,) * new_tokens, params))
    t0 = time.perf_counter()
    ref.drain(0.0)
    reference_s = time.perf_counter() - t0
    rates = {c: Spread.of(v).as_dict() for c, v in samples.items()}
    return {"batch": batch, "decode_tokens_per_s": rates, "reference_check_s": reference_s}


def markdown(result: dict) -> list[str]:
    rates = result["decode_tokens_per_s"]
    off = rates["off"]["median"]
    lines = ["| detectors in the step | decode tokens/s | vs off |", "|---|---|---|"]
    lines += [f"| {c} | {r['median']:.1f} | {r['median'] / off - 1:+.1%} |" for c, r in rates.items()]
    lines.append(f"| reference (off the step path) | {result['batch']} requests checked in "
                 f"{result['reference_check_s']:.1f} s | 0 on the step |")
    return lines
