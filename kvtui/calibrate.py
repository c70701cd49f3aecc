"""`kvtui calibrate`: fit the virtual clock's step-cost model to this machine.

The virtual clock charges each engine step a modeled duration (seconds):

    base_s + per_row_s * rows + per_token_s * query positions (pads included) + per_key_s * key positions

The built-in coefficients are a rough fit for SmolLM2-135M in float32 on 2 CPU cores. Calibration
runs steps of the loaded model over a grid of shapes (rows x query tokens x context), measures their
wall time, and fits the four coefficients by non-negative least squares, so modeled runs pace like
this machine. The fit is stored per model, dtype and device under the cache directory and used by
virtual-clock runs on that model (the recording header names the fit); `--cost-model default`
ignores it (what the README's example output and the tests use, so they match on any machine).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from kvtui.config import EngineConfig
from kvtui.engine import Engine, SamplingParams, StepCostModel

GRID_QUICK = [(rows, q, ctx) for rows in (1, 4, 8) for q in (1, 32) for ctx in (32, 256)]


def calibration_path(model_id: str, dtype: str, device: str) -> Path:
    """Where the fit for (model, dtype, device) lives."""
    from kvtui.models import cache_dir

    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{model_id}-{dtype}-{device}")
    return cache_dir() / "calibration" / f"{safe}.json"


def load_cost_model(model_id: str, dtype: str, device: str) -> tuple[StepCostModel, dict]:
    """The stored fit for (model, dtype, device), or the built-in default. Returns (model, description
    for the recording header: source "calibrated" with its file, date and fit quality, or "default")."""
    path = calibration_path(model_id, dtype, device)
    try:
        data = json.loads(path.read_text())
        model = StepCostModel(**data["coefficients"])
        return model, {"source": "calibrated", "file": str(path), "created": data.get("created"),
                       "r2": data.get("r2"), **asdict(model)}
    except (OSError, ValueError, KeyError, TypeError):
        return StepCostModel(), {"source": "default", **asdict(StepCostModel())}


def measure(model, rows: int, query: int, context: int, repeats: int = 3) -> tuple[tuple[int, int, int], float]:
    """Median wall seconds of one engine step with `rows` requests each feeding `query` tokens on top of a
    cache of `context` tokens; returns ((rows, query positions, key positions), seconds)."""
    times, shape = [], None
    vocab = min(model.config.vocab_size, 1000) - 3
    for _ in range(repeats):
        config = EngineConfig(num_slots=rows, max_batch_size=rows, max_len=context + query + 2,
                              max_tokens_per_step=rows * query + rows)
        engine = Engine.from_loaded(model, config)
        states = [engine.submit(f"r{i}", [3 + (i + j) % vocab for j in range(context + query)],
                                SamplingParams(max_new_tokens=1, ignore_eos=True)) for i in range(rows)]
        for state in engine.scheduler.admit(engine.now()):  # the first `context` tokens "are" cached already
            engine.scheduler.set_progress(state, context, context)
        report = engine.step()
        assert all(s.generated_ids for s in states)
        times.append(report.wall_s)
        shape = (report.rows, report.query_positions, report.rows * (context + query))  # keys read: each row's own
    times.sort()
    return shape, times[len(times) // 2]


def fit(samples: list[tuple[tuple[int, int, int], float]]) -> tuple[StepCostModel, float]:
    """Non-negative least squares of seconds on [1, rows, tokens, keys]; returns (model, R^2)."""
    x = torch.tensor([[1.0, r, q, k] for (r, q, k), _ in samples], dtype=torch.float64)
    y = torch.tensor([s for _, s in samples], dtype=torch.float64)
    active = list(range(4))
    while True:  # drop coefficients that come out negative and refit (a tiny active-set NNLS)
        coef = torch.linalg.lstsq(x[:, active], y[:, None]).solution[:, 0]
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(torch.argmin(coef)))
    full = torch.zeros(4, dtype=torch.float64)
    full[active] = coef.clamp(min=0)
    predicted = x @ full
    r2 = 1 - float(((y - predicted) ** 2).sum() / ((y - y.mean()) ** 2).sum().clamp(min=1e-18))
    return StepCostModel(*map(float, full)), r2


def calibrate(loaded, *, device: str = "cpu", console=None, grid=None) -> dict:
    """Measure the grid, fit, store; returns what was written."""
    grid = grid or GRID_QUICK
    samples = []
    t0 = time.perf_counter()
    for rows, query, context in grid:
        if console is not None:
            console.print(f"  step: {rows} rows x {query} tokens on {context} cached")
        samples.append(measure(loaded.model, rows, query, context))
    model, r2 = fit(samples)
    dtype = str(loaded.dtype).replace("torch.", "")
    data = {"model": loaded.model_id, "dtype": dtype, "device": device, "created": time.strftime("%Y-%m-%d %H:%M"),
            "torch_threads": torch.get_num_threads(), "seconds": time.perf_counter() - t0, "r2": r2,
            "coefficients": asdict(model),
            "samples": [{"rows": r, "tokens": q, "keys": k, "seconds": s} for (r, q, k), s in samples]}
    path = calibration_path(loaded.model_id, dtype, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    data["file"] = str(path)
    return data
