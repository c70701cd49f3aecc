"""What per-request penalties, bias and bans cost a decode step: batch 8 decoding 32 tokens each, every
row plain, every row with repetition + frequency + presence penalties, every row with a 50-token
logit_bias, bad words and min_tokens, and every row with all of them. The row-state stages run per row
on the step's logits (kvtui/engine/row_state.py), so their cost grows with the rows and the vocabulary,
not with the context. Figures: the median (min, max) decode-step wall time over repeats, the
difference to plain rows per step, and the stages alone on one row's logits (median of 200 calls, a
60-token prompt and 31 output tokens in its history), which the step's noise does not blur."""

from __future__ import annotations

import time
from collections import Counter

import torch

from kvtui.bench.common import Spread, engine_for, make_prompts
from kvtui.engine import SamplingParams
from kvtui.engine.row_state import RowState, stages_for

PENALTIES = dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5)


def configs(eos: int, vocab: int) -> dict[str, dict]:
    """The SamplingParams fields of each configuration (eos: the id min_tokens holds back; vocab: tokens)."""
    third, half = vocab // 3, vocab // 2
    bans = dict(logit_bias=tuple((t, -100.0 if t % 2 else 2.0) for t in range(third, third + 50)),
                bad_words_ids=((eos,), (half, half + 1), (vocab - 1,)), min_tokens=31)
    return {"plain": {}, "penalties": PENALTIES, "bias_bans_min": bans, "all": {**PENALTIES, **bans}}


def decode_steps(model, prompts, new_tokens: int, fields: dict, eos: int) -> list[float]:
    """Wall seconds of each decode-only step of one run with `fields` on every row."""
    engine = engine_for(model, prompts, new_tokens)
    engine.output.stop_mask_ids = frozenset({eos})  # min_tokens masks it; no request stops on it (no EOS set)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=False, **fields)
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, params)
    reports = engine.run_until_done()
    return [r.wall_s for r in reports if r.prefill_tokens == 0 and r.decode_tokens][1:]  # the first warms up


def run(loaded, *, name: str, quick: bool, console, batch: int = 8, new_tokens: int = 32) -> dict:
    prompts = make_prompts(loaded.tokenizer, batch, 1, 40, 60)
    eos = next(iter(loaded.eos_token_ids), 0)
    vocab = loaded.model.get_input_embeddings().num_embeddings
    samples: dict[str, list[float]] = {c: [] for c in configs(eos, vocab)}
    for _ in range(1 if quick else 3):  # interleaved
        for config, fields in configs(eos, vocab).items():
            console.print(f"  penalties: {config}")
            samples[config] += decode_steps(loaded.model, prompts, new_tokens, fields, eos)
    steps = {c: Spread.of(v).as_dict() for c, v in samples.items()}
    stage = {c: stage_seconds(vocab, fields, eos) for c, fields in configs(eos, vocab).items()}
    return {"batch": batch, "vocab": vocab, "decode_step_s": steps, "stages_per_row_s": stage}


def stage_seconds(vocab: int, fields: dict, eos: int, calls: int = 200) -> float:
    """Median seconds of one row's stages on [vocab] float32 logits (0 for a plain row: no stages)."""
    params = SamplingParams(max_new_tokens=32, **fields)
    output = [(7 * i) % vocab for i in range(31)]
    row = RowState("r", params, None, frozenset((13 * i) % vocab for i in range(60)), frozenset({eos}), stages_for(params),
                   output, Counter(output))
    logits = torch.randn(vocab)
    times = []
    for _ in range(calls if row.stages else 0):
        t0 = time.perf_counter()
        row.process(logits)
        times.append(time.perf_counter() - t0)
    return Spread.of(times).median if times else 0.0


def markdown(result: dict) -> list[str]:
    steps, batch = result["decode_step_s"], result["batch"]
    plain = steps["plain"]["median"]
    lines = [f"| rows ({batch}, vocabulary {result['vocab']}) | decode step ms | extra per step ms | "
             "stages alone, ms per row |", "|---|---|---|---|"]
    for config, s in steps.items():
        extra = s["median"] - plain
        lines.append(f"| {config} | {s['median'] * 1e3:.1f} ({s['min'] * 1e3:.1f}-{s['max'] * 1e3:.1f}) | "
                     f"{extra * 1e3:+.2f} | {result['stages_per_row_s'][config] * 1e3:.3f} |")
    return lines
