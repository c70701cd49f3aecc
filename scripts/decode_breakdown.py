"""Where a decode step's time goes, part by part, on the engine at saturation.

The peers bench's burst workload (kvtui/bench/peers.py, Workload.burst: its first ROWS requests, all at t=0),
every request forced to OUT output tokens, SmolLM2 in float32, 1 thread, no detectors, kvtui serve's token
budget. The steps in which all ROWS requests decode are timed; the others run untimed. Times are the
thread's CPU time (time.thread_time), not wall time, so a machine shared with other jobs does not add the
time this process waits off the CPU; a part's figure is its CPU time per decode step, in ms.

The fused forward's layer runs as a copy of FusedLlama._layer with a clock between its parts (norms, the
fused linear layers, rotary, the KV write through PooledCacheLayer.update, attention, residual adds, SiLU x
up); the LM head, the runner's forward and the whole step are timed around their calls. "engine outside
the forward" is the step less the runner's forward (scheduling, batch building, sampling, stop checks,
the step event). Keep the copy in step with kvtui/engine/fused.py when that changes.

    PYTHONPATH=. OMP_NUM_THREADS=1 python scripts/decode_breakdown.py --rows 16 --out 32
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
import torch.nn.functional as F

from kvtui.bench.peers import Workload
from kvtui.config import EngineConfig
from kvtui.engine import Engine, SamplingParams, attention, fused, runner
from kvtui.models.loader import load_model
from kvtui.serve.options import SERVE_MAX_TOKENS_PER_STEP

clock = time.thread_time
parts: dict[str, float] = collections.defaultdict(float)
timing = [False]  # only the steps in which every request decodes are timed


def timed_layer(layer, hidden, cos, sin, cache, state, attention_mask, linear):
    """fused.FusedLlama._layer with a clock between its parts."""
    last = clock()

    def lap(name: str) -> None:
        nonlocal last
        now = clock()
        if timing[0]:
            parts[name] += now - last
        last = now

    rows, q_len = hidden.shape[:2]
    d = layer.head_dim
    x = fused._rms_norm(hidden, layer.norm1, layer.eps1)
    lap("norms")
    qkv = linear(layer, "qkv", x)
    lap("linear layers")
    split = layer.q_size + layer.kv_size
    qk = fused._rotate(qkv[..., :split].view(rows, q_len, -1, d), cos, sin)
    lap("rotary")
    heads = layer.q_size // d
    q, k = qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:].transpose(1, 2)
    v = qkv[..., split:].view(rows, q_len, -1, d).transpose(1, 2)
    kwargs: dict = {}
    k, v = cache.layers[layer.index].update(k, v, kwargs=kwargs)
    lap("KV write")
    out, _ = attention.kvtui_attention(layer.attn, q, k, v, attention_mask, scaling=layer.attn.scaling, **kwargs)
    lap("attention")
    o = linear(layer, "o", out.reshape(rows, q_len, -1))
    lap("linear layers")
    hidden.add_(o)
    lap("residual adds")
    x = fused._rms_norm(hidden, layer.norm2, layer.eps2)
    lap("norms")
    gate, up = linear(layer, "gate_up", x).split(layer.inter, dim=-1)
    lap("linear layers")
    act = F.silu(gate).mul_(up)
    lap("SiLU x up")
    down = linear(layer, "down", act)
    lap("linear layers")
    hidden.add_(down)
    lap("residual adds")
    return hidden


def clocked(owner, name: str, part: str) -> None:
    """Replace owner.name by a wrapper that adds its CPU time to `part` while timing."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if not timing[0]:
            return inner(*args, **kwargs)
        start = clock()
        try:
            return inner(*args, **kwargs)
        finally:
            parts[part] += clock() - start

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16, help="requests at once (at most 16)")
    parser.add_argument("--out", type=int, default=32, help="output tokens per request")
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_model("default", progress=False)
    work = Workload.burst(loaded.tokenizer, 16)
    prompts = work.prompts[: args.rows]
    fused.FusedLlama._layer = staticmethod(timed_layer)
    clocked(attention, "_span_plan", "attention: span plan (tails zeroed, mask)")
    clocked(attention.F, "scaled_dot_product_attention", "attention: SDPA calls")
    clocked(attention.KVPool, "write", "KV write: pool index_put")
    clocked(fused.FusedLlama, "logits", "LM head")
    clocked(fused.FusedLlama, "__call__", "body forward")
    clocked(runner.ModelRunner, "forward", "runner forward")
    config = EngineConfig(num_slots=args.rows, max_batch_size=args.rows, max_len=max(map(len, prompts)) + args.out + 1,
                          max_tokens_per_step=SERVE_MAX_TOKENS_PER_STEP)
    engine = Engine.from_loaded(loaded, config)
    states = [engine.submit(f"r{i}", p, SamplingParams(max_new_tokens=args.out, ignore_eos=True))
              for i, p in enumerate(prompts)]
    steps = []
    while engine.has_unfinished():
        timing[0] = sum(0 < len(s.generated_ids) < args.out for s in states) == args.rows
        start = clock()
        engine.step()
        if timing[0]:
            steps.append(clock() - start)
    timing[0] = False
    n = len(steps)
    step = sum(steps) / n
    print(f"{n} decode steps at {args.rows} rows: CPU time per step median {statistics.median(steps) * 1e3:.1f} ms, "
          f"mean {step * 1e3:.1f} ms")
    parts["engine outside the forward"] = step * n - parts["runner forward"]
    for name, total in sorted(parts.items(), key=lambda item: -item[1]):
        print(f"  {name:44s} {total / n * 1e3:7.2f} ms  {total / n / step:6.1%}")


if __name__ == "__main__":
    main()
