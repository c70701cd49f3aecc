"""What every benchmark part shares: prompts, repeated timings, the engine run loop, memory figures.

Timings are wall seconds from time.perf_counter. A figure is the median of repeats, reported with
its min and max; comparisons inside one part run interleaved (A, B, A, B, ...) so a slower phase
of the machine hits both sides.
"""

from __future__ import annotations

import random
import resource
import statistics
import time
from dataclasses import dataclass

import torch

from kvtui.config import EngineConfig
from kvtui.engine import Engine, SamplingParams


@dataclass(frozen=True)
class Spread:
    """Median, min and max of repeated measurements (units as measured)."""

    median: float
    min: float
    max: float
    n: int

    @staticmethod
    def of(values: list[float]) -> "Spread":
        return Spread(statistics.median(values), min(values), max(values), len(values))

    def as_dict(self) -> dict:
        return {"median": self.median, "min": self.min, "max": self.max, "n": self.n}


def make_prompts(tokenizer, n: int, seed: int, min_len: int, max_len: int) -> list[list[int]]:
    """`n` prompts of uniform random length in [min_len, max_len] tokens, ids drawn from the
    non-special vocabulary, deterministic in `seed`."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(min(len(tokenizer), 40000)) if i not in special]
    return [[rng.choice(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def engine_for(model, prompts: list[list[int]], new_tokens: int, **config) -> Engine:
    """An engine sized for `prompts` + `new_tokens` (one slot each unless `num_slots` is given)."""
    max_len = max(len(p) for p in prompts) + new_tokens + 1
    base = dict(num_slots=len(prompts), max_len=max_len, max_batch_size=len(prompts),
                max_tokens_per_step=max(4096, sum(map(len, prompts))))
    return Engine.from_loaded(model, EngineConfig(**{**base, **config}))  # a bare model: no EOS ids


def run_all(engine: Engine, prompts, new_tokens: int) -> tuple[float, list[list[int]], list]:
    """Submit every prompt at once (greedy, exactly `new_tokens` each) and step to the end.
    Returns (wall seconds, outputs, step reports)."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    states = [engine.submit(f"r{i}", p, params) for i, p in enumerate(prompts)]
    reports = engine.run_until_done()
    return time.perf_counter() - t0, [list(s.generated_ids) for s in states], reports


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (bytes; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def pool_bytes(engine: Engine) -> dict:
    """KV pool bytes as configured (slots x bytes per slot) and as allocated (tensor storage)."""
    measured = sum(t.untyped_storage().nbytes() for t in engine.pool.keys + engine.pool.values)
    return {"configured": engine.pool.nbytes, "measured": measured}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def machine() -> dict:
    """What the figures ran on."""
    import os
    import platform

    import transformers

    return {"machine": platform.machine(), "processor": _cpu_name() or platform.processor() or "?", "cores": os.cpu_count(),
            "cpu_flags": cpu_flags(), "torch": torch.__version__, "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version()}


# The CPU flags that decide which kernels run fast: vector widths, and native bfloat16/float16/int8 math.
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile",
                "amx_bf16", "amx_int8", "asimd", "sve", "bf16")


def cpu_flags() -> list[str]:
    """Which of KERNEL_FLAGS this CPU has (/proc/cpuinfo's flags, or Features on Arm), in that order;
    [] where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.split(":", 1)[0].strip() in ("flags", "Features")), "")
    except OSError:
        return []
    have = set(line.split(":", 1)[1].split()) if ":" in line else set()
    return [flag for flag in KERNEL_FLAGS if flag in have]
