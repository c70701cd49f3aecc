"""Where a decode step's time goes, at batch 1, 8 and 16 (contexts of 128 tokens), with the in-engine
detectors off and on.

Each phase of Engine.step() is timed on the wall clock by wrapping the engine's own functions for the
measurement (nothing is changed for a normal run): scheduling (admit + plan), batch building (the step's
tables, write tags and expected writers), slot_taint, the model forward, attention_flow's attribution,
the logit facts (top-2 gap, finiteness), sampling and postprocessing, and the step report. Inside the
forward, torch's profiler splits the operators' own time into linear layers (mm / addmm), attention
(SDPA, the eager matmuls and softmax of a measured step), KV writes and gathers (index / index_put),
and the element-wise rest (norms, rotary, activation, residual adds, casts); what the forward's wall
time holds beyond its operators is Python and module overhead. Figures are medians over steps
(the first steps warm up and are dropped).
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

from torch.profiler import ProfilerActivity, profile

import kvtui.engine.engine as engine_module
from kvtui.bench.common import engine_for
from kvtui.engine import SamplingParams

PHASES = ("schedule", "batch", "slot_taint", "forward", "attention_flow", "facts", "sample", "report")
OP_GROUPS = {
    "linear": ("aten::mm", "aten::addmm", "aten::linear", "mkldnn::_linear_pointwise"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::bmm", "aten::_softmax",
                  "aten::masked_fill_", "aten::_scaled_dot_product_attention_math"),
    "kv": ("aten::index", "aten::index_put_", "aten::_index_put_impl_", "aten::index_select"),
}


class _Timer:
    """Accumulates wall seconds per phase while installed (see module docstring)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - t0
        return timed


@contextmanager
def _timed(engine, timer: _Timer):
    """Install the phase timers on `engine` and on the engine module's functions; undo them after."""
    names = {"build_batch": "batch", "key_writers": "batch", "slot_taint": "slot_taint",
             "attention_flow": "attention_flow", "gaps_and_finite": "facts"}
    saved = {n: getattr(engine_module, n) for n in names}
    for n, phase in names.items():
        setattr(engine_module, n, timer.wrap(phase, saved[n]))
    methods = [(engine.scheduler, "admit", "schedule"), (engine.scheduler, "plan", "schedule"),
               (engine.kv, "expected_writers", "batch"), (engine.runner, "forward", "forward"),
               (engine, "_postprocess", "sample"), (engine, "_report", "report")]
    for owner, attr, phase in methods:
        setattr(owner, attr, timer.wrap(phase, getattr(owner, attr)))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(engine_module, n, fn)
        for owner, attr, _ in methods:
            delattr(owner, attr)  # the instance attribute goes; the class's method shows again


def _decode_engine(model, batch: int, context: int, steps: int, detectors: bool):
    """An engine decoding `batch` requests whose slots hold `context` tokens (as bench.overhead)."""
    vocab = min(model.config.vocab_size, 1000) - 3
    prompts = [[3 + (i + j) % vocab for j in range(context)] for i in range(batch)]
    engine = engine_for(model, prompts, steps + 2)
    engine.measure_flow = engine.detect_taint = detectors
    params = SamplingParams(max_new_tokens=steps + 1, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, params)
    for state in engine.scheduler.admit(engine.now()):
        engine.scheduler.set_progress(state, context, context)
        state.generated_ids.append(7)
    return engine


def _ops(model, batch: int, context: int, steps: int, detectors: bool) -> dict[str, float]:
    """Operator self time per forward by group (seconds), from torch's profiler over `steps` steps."""
    engine = _decode_engine(model, batch, context, steps + 1, detectors)
    engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    groups = dict.fromkeys((*OP_GROUPS, "elementwise"), 0.0)
    lookup = {op: g for g, ops in OP_GROUPS.items() for op in ops}
    for event in prof.key_averages():
        group = lookup.get(event.key, "elementwise" if event.key.startswith("aten::") else None)
        if group is not None:
            groups[group] += event.self_cpu_time_total / 1e6 / steps
    return groups


def run(loaded, *, name: str, quick: bool, console, context: int = 128) -> dict:
    """Per batch and detector setting: median step ms, phase ms, and the forward's operator split."""
    steps = 6 if quick else 12
    rows = []
    for detectors in (False, True):
        for batch in (1, 8, 16):
            console.print(f"  profile: batch {batch}, detectors {'on' if detectors else 'off'}")
            engine = _decode_engine(loaded.model, batch, context, steps + 2, detectors)
            engine.step()
            engine.step()  # warm-up
            per_step, phases = [], []
            for _ in range(steps):
                timer = _Timer()
                with _timed(engine, timer):
                    t0 = time.perf_counter()
                    engine.step()
                    per_step.append(time.perf_counter() - t0)
                phases.append(timer.seconds)
            median = {p: statistics.median(s[p] for s in phases) for p in PHASES}
            ops = _ops(loaded.model, batch, context, max(3, steps // 3), detectors)
            rows.append({"batch": batch, "detectors": detectors, "step_s": statistics.median(per_step),
                         "phases_s": median, "forward_ops_s": ops,
                         "forward_python_s": max(0.0, median["forward"] - sum(ops.values())),
                         "forward_path": engine.runner.forward_path})
    fused = getattr(loaded.model, "_kvtui_fused", None)
    kernel = fused.kernel_choice if fused is not None else {"kernel": "modules", "why": "transformers' own modules "
                                                            "(the fused forward runs Llama-family models)", "ms": {}}
    return {"context": context, "rows": rows, "linear_kernel": kernel}


def markdown(result: dict) -> list[str]:
    kernel = result.get("linear_kernel")
    lines = []
    if kernel:
        lines += [f"Linear kernel: {kernel['kernel']} (LM head: {kernel.get('head_kernel', kernel['kernel'])}): "
                  f"{kernel['why']}.", ""]
        layers = (kernel.get("ms") or {}).get("layers") or {}
        if layers:
            counts = list(next(iter(layers.values())))
            head = kernel["ms"].get("head") or {}
            lines += ["| kernel | " + " | ".join(f"layers, {n} rows, ms" for n in counts) + " | LM head, ms |",
                      "|---|" + "---|" * (len(counts) + 1)]
            for k, per_rows in layers.items():
                cells = [f"{per_rows[n]:.1f}" for n in counts] + [f"{head[k]:.1f}" if k in head else "-"]
                lines.append(f"| {k} | " + " | ".join(cells) + " |")
            lines.append("")
    lines += [f"Decode steps, contexts of {result['context']} tokens; ms per step (share of the step).", "",
             "| batch | detectors | step | forward: linear | attention | KV index | element-wise | Python | "
             "batch build | slot_taint | attention_flow | facts | sample | schedule + report |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        step, p, o = r["step_s"], r["phases_s"], r["forward_ops_s"]

        def cell(seconds: float, step: float = step) -> str:
            return f"{seconds * 1e3:.1f} ({seconds / step:.0%})"

        lines.append(f"| {r['batch']} | {'on' if r['detectors'] else 'off'} | {step * 1e3:.1f} | {cell(o['linear'])} | "
                     f"{cell(o['attention'])} | {cell(o['kv'])} | {cell(o['elementwise'])} | "
                     f"{cell(r['forward_python_s'])} | {cell(p['batch'])} | {cell(p['slot_taint'])} | "
                     f"{cell(p['attention_flow'])} | {cell(p['facts'])} | {cell(p['sample'])} | "
                     f"{cell(p['schedule'] + p['report'])} |")
    return lines
