"""Engine knobs side by side on one workload: length bucketing on vs off on a wide length spread
(padding ratio and tokens/s), slot reuse vs a fresh slot per request, padded vs packed.

Workload: 16 prompts of 20-200 tokens, 32 greedy tokens each, all submitted at once to 8 slots (so
slots are handed on). Figures: generated tokens / wall seconds of the whole run (prefill included),
median (min, max) over interleaved repeats; mean padding ratios (query and key side) over the steps;
whether every variant produced the same tokens (batch invariance says it must)."""

from __future__ import annotations

from kvtui.bench.common import Spread, engine_for, make_prompts, pool_bytes, run_all

VARIANTS = {
    "padded, bucketing off": dict(layout="padded"),
    "padded, bucketing on (20%)": dict(layout="padded", bucketing=True, bucket_tolerance=0.2),
    "padded, fresh slot per request": dict(layout="padded", slot_reuse="reallocate"),
    "packed": dict(layout="packed"),
}


def run(loaded, *, name: str, quick: bool, console, requests: int = 16, new_tokens: int = 32) -> dict:
    prompts = make_prompts(loaded.tokenizer, requests, seed=1, min_len=20, max_len=200)
    repeats = 1 if quick else 3
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    padding, outputs, pools = {}, {}, {}
    for _ in range(repeats):
        for variant, knobs in VARIANTS.items():
            console.print(f"  knobs: {variant}")
            engine = engine_for(loaded.model, prompts, new_tokens, num_slots=8, max_batch_size=8, **knobs)
            seconds, outs, reports = run_all(engine, prompts, new_tokens)
            samples[variant].append(requests * new_tokens / seconds)
            busy = [r for r in reports if r.rows]
            padding[variant] = (sum(r.padding_ratio for r in busy) / len(busy),
                                sum(r.key_padding_ratio for r in busy) / len(busy))
            outputs[variant] = outs
            pools[variant] = pool_bytes(engine)
    first = outputs[next(iter(VARIANTS))]
    rows = [{"variant": v, "tokens_per_s": Spread.of(samples[v]).as_dict(), "padding_ratio_query": padding[v][0],
             "padding_ratio_key": padding[v][1], "same_tokens": outputs[v] == first, "kv_pool_bytes": pools[v]}
            for v in VARIANTS]
    return {"requests": requests, "new_tokens": new_tokens, "prompt_lengths": [len(p) for p in prompts], "rows": rows}


def markdown(result: dict) -> list[str]:
    base = result["rows"][0]["tokens_per_s"]["median"]
    lines = ["| variant | tokens/s | x bucketing off | padding q / k | same tokens | KV pool MiB configured / allocated |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        t = r["tokens_per_s"]
        lines.append(f"| {r['variant']} | {t['median']:.1f} ({t['min']:.1f}-{t['max']:.1f}) | "
                     f"{t['median'] / base:.2f} | {r['padding_ratio_query']:.1%} / {r['padding_ratio_key']:.1%} | "
                     f"{'yes' if r['same_tokens'] else 'no'} | {r['kv_pool_bytes']['configured'] / 2**20:.1f} / "
                     f"{r['kv_pool_bytes']['measured'] / 2**20:.1f} |")
    return lines
