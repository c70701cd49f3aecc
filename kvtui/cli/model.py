"""`kvtui model NAME`: load a model once and say what it is."""

from __future__ import annotations

from typing import Annotated

import typer

from kvtui.cli.console import out
from kvtui.cli.inputs import load_model
from kvtui.cli.options import DTYPE, ENGINE, MODEL


def model_cmd(
    name: Annotated[str, typer.Argument(help="default, tiny-llama, tiny-gpt2, a HF directory or a .gguf file")] = MODEL,
) -> None:
    """Load a model once (converting the default GGUF into the cache) and print what it is."""
    import time

    t0 = time.perf_counter()
    loaded = load_model(name, DTYPE, ENGINE.device)
    cfg = loaded.model.config
    out.print(f"{loaded.model_id}: {type(loaded.model).__name__}, "
              f"{sum(p.numel() for p in loaded.model.parameters()) / 1e6:.1f}M parameters, "
              f"{loaded.num_layers} layers, {loaded.num_heads} heads, {loaded.num_kv_heads} KV heads, "
              f"head_dim {loaded.head_dim}, vocab {cfg.vocab_size}; loaded in {time.perf_counter() - t0:.1f} s",
              markup=False, highlight=False)
    from kvtui.engine.fused import kernel_choice, supports

    if supports(loaded.model):  # the fused forward's linear kernels: measured, stored, or forced
        choice = kernel_choice(loaded.model)
        out.print(f"linear kernels: layers {choice['kernel']}, LM head {choice['head_kernel']} ({choice['why']})",
                  markup=False, highlight=False)
    from kvtui.engine.cpu_kernels import choose_for

    param = next(loaded.model.parameters())
    out.print(f"decode attention: {choose_for(loaded.model, param.dtype, param.device)[1]}", markup=False, highlight=False)
    if loaded.source_path:
        out.print(f"source: {loaded.source_path}" + (f" (sha256 {loaded.source_sha256})" if loaded.source_sha256 else ""),
                  markup=False, highlight=False)
