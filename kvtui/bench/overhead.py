"""The engine's overhead: one kvtui decode step vs one bare transformers forward of the same shapes.

Both decode one token for each of `batch` rows whose caches already hold `context` tokens. The bare
forward is a separate model instance on transformers' own attention ("sdpa" and "eager") with a
DynamicCache; kvtui's step is Engine.step() (scheduling, batch tables, attention over the pool,
sampling, the report). The caches are filled with random K/V instead of a prefill: the values do not
change the time, and a 16 x 512-token prefill would take a minute on 2 cores. Figures are the median
(min, max) step time over interleaved repeats; ratio = kvtui / bare.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from kvtui.bench.common import Spread, engine_for
from kvtui.engine import SamplingParams
from kvtui.engine.runner import model_geometry


def bare_model(name: str, dtype):
    """A second instance of model `name` (as load_model takes it), for transformers' own attention."""
    from kvtui.models import load_model

    return load_model(name, dtype=dtype, progress=False).model.eval()


@torch.inference_mode()
def bare_steps(model, attn: str, batch: int, context: int, steps: int) -> list[float]:
    """Seconds per decode forward of `model` on `attn`, rows whose DynamicCache holds `context` tokens."""
    model.set_attn_implementation(attn)
    layers, _, kv_heads, head_dim = model_geometry(model)
    dtype = next(model.parameters()).dtype
    cache = DynamicCache()
    for layer in range(layers):
        shape = (batch, kv_heads, context, head_dim)
        cache.update(torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype), layer)
    ids = torch.randint(3, min(model.config.vocab_size, 1000), (batch, 1))
    times = []
    for i in range(steps):
        position = torch.full((batch, 1), context + i)
        t0 = time.perf_counter()
        logits = model(input_ids=ids, cache=cache, use_cache=True, position_ids=position,
                       logits_to_keep=1).logits
        ids = logits[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - t0)
    return times


def kvtui_steps(model, batch: int, context: int, steps: int) -> list[float]:
    """Seconds per Engine.step() decoding `batch` requests whose slots hold `context` tokens."""
    vocab = min(model.config.vocab_size, 1000) - 3
    prompts = [[3 + (i + j) % vocab for j in range(context)] for i in range(batch)]
    engine = engine_for(model, prompts, steps + 2)
    params = SamplingParams(max_new_tokens=steps + 1, ignore_eos=True)
    states = [engine.submit(f"r{i}", p, params) for i, p in enumerate(prompts)]
    for state in engine.scheduler.admit(engine.now()):  # as if prefilled: caches "hold" context tokens
        engine.scheduler.set_progress(state, context, context)
        state.generated_ids.append(7)
    times = [engine.step().wall_s for _ in range(steps)]
    assert all(len(s.generated_ids) == steps + 1 for s in states)
    return times


def run(loaded, *, name: str, quick: bool, console) -> dict:
    """Median decode-step seconds of kvtui vs bare sdpa and eager forwards, and their ratios."""
    bare = bare_model(name, loaded.dtype)
    shapes = [(1, 128), (8, 128), (16, 128), (8, 512)] if quick else \
        [(b, c) for c in (128, 512) for b in (1, 8, 16)]
    repeats, steps = (3, 6) if quick else (5, 10)
    rows = []
    for batch, context in shapes:
        console.print(f"  overhead: batch {batch}, context {context}")
        samples: dict[str, list[float]] = {"kvtui": [], "sdpa": [], "eager": []}
        for _ in range(repeats):  # interleaved
            samples["kvtui"] += kvtui_steps(loaded.model, batch, context, steps)[1:]  # the first step warms up
            for attn in ("sdpa", "eager"):
                samples[attn] += bare_steps(bare, attn, batch, context, steps)[1:]
        spreads = {k: Spread.of(v) for k, v in samples.items()}
        rows.append({"batch": batch, "context": context, **{f"{k}_step_s": s.as_dict() for k, s in spreads.items()},
                     "ratio_vs_sdpa": spreads["kvtui"].median / spreads["sdpa"].median,
                     "ratio_vs_eager": spreads["kvtui"].median / spreads["eager"].median})
    del bare
    return {"rows": rows}


def markdown(result: dict) -> list[str]:
    lines = ["| batch | context | kvtui step ms | bare sdpa ms | bare eager ms | kvtui / sdpa | kvtui / eager |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ms = {k: r[f"{k}_step_s"] for k in ("kvtui", "sdpa", "eager")}
        cells = [f"{ms[k]['median'] * 1e3:.1f} ({ms[k]['min'] * 1e3:.1f}-{ms[k]['max'] * 1e3:.1f})" for k in ms]
        lines.append(f"| {r['batch']} | {r['context']} | {' | '.join(cells)} | {r['ratio_vs_sdpa']:.2f}x | "
                     f"{r['ratio_vs_eager']:.2f}x |")
    return lines
