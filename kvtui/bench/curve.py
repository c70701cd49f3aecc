"""The batch curve: kvtui decode tokens/s at batch 1, 2, 4, 8, 16, 32 (caches of `context` tokens)
and each batch's ratio to batch 1, beside what is commonly reported for a small model on one consumer
GPU (a rule of thumb, not a measurement of ours): batch 1 -> 8 gives 3-4x, 8 -> 16 about 1.5x more,
beyond 16 little or worse."""

from __future__ import annotations

from kvtui.bench.common import Spread
from kvtui.bench.overhead import kvtui_steps

BATCHES = (1, 2, 4, 8, 16, 32)
SOURCE = {8: "3-4x", 16: "about 1.5x over batch 8", 32: "little or worse"}


def run(loaded, *, name: str, quick: bool, console, context: int = 64) -> dict:
    repeats, steps = (2, 6) if quick else (4, 10)
    rows = []
    for batch in BATCHES:
        console.print(f"  batch curve: batch {batch}")
        times = []
        for _ in range(repeats):
            times += kvtui_steps(loaded.model, batch, context, steps)[1:]
        step = Spread.of(times)
        rows.append({"batch": batch, "step_s": step.as_dict(), "tokens_per_s": batch / step.median})
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["x_batch_1"] = row["tokens_per_s"] / base
    return {"context": context, "rows": rows}


def markdown(result: dict) -> list[str]:
    lines = [f"| batch | decode tokens/s (context {result['context']}) | x batch 1 | on one GPU (rule of thumb) |",
             "|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['batch']} | {r['tokens_per_s']:.1f} | {r['x_batch_1']:.2f} | {SOURCE.get(r['batch'], '')} |")
    return lines
