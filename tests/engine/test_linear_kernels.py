"""The linear kernel chosen on the machine (kvtui/engine/linear.py): every kernel computes what
nn.Linear computes, the choice is measured once and stored per machine, a forced choice wins, and a
bad one is one clear error."""

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import make_engine

from kvtui.engine import linear


@pytest.fixture
def fresh_store(tmp_path, monkeypatch):
    """kvtui's cache in a temporary folder, no forced kernel, no choice remembered by this process."""
    monkeypatch.setenv("KVTUI_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(linear.ENV, raising=False)
    monkeypatch.setattr(linear, "_CHOSEN", {})
    return tmp_path / "kernels.json"


@pytest.mark.parametrize("kernel", linear.KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16, 130])
def test_every_kernel_computes_nn_linear_on_the_fused_outputs(kernel, dtype, rows, monkeypatch):
    """Two nn.Linear layers (with biases) fused: each kernel's output columns equal F.linear on each
    layer's own weight (float32 within 1e-5; bfloat16 within its rounding), and the modules afterwards
    still give their own outputs (views, or PackedSlice columns). Tiles of 12 over the 32 outputs (12, 12
    and 8) make the tiled kernel tile, each tile's bias included."""
    if kernel == "prepacked" and not linear.prepack_available(dtype):
        pytest.skip(f"oneDNN cannot prepack {dtype} in this torch build")
    if kernel == "zentorch" and not linear.zentorch_available(dtype):
        pytest.skip(f"zentorch cannot run {dtype} here (pip install 'kvtui[zentorch]')")
    monkeypatch.setattr(linear, "TILE", 12)
    tiles = []

    def addmm(*args, out):  # torch.addmm, noting each tile's output shape
        tiles.append(out.shape)
        return torch.ops.aten.addmm.out(*args, out=out)

    monkeypatch.setattr(linear.torch, "addmm", addmm)
    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.a, holder.b = torch.nn.Linear(40, 24, dtype=dtype), torch.nn.Linear(40, 8, dtype=dtype)
    weights = [holder.a.weight.detach().clone(), holder.b.weight.detach().clone()]
    biases = [holder.a.bias.detach().clone(), holder.b.bias.detach().clone()]
    fused = linear.FusedLinear([holder.a, holder.b], kernel, [(holder, "a"), (holder, "b")])
    x = torch.randn(rows, 40).to(dtype)
    expected = torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], dim=-1)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.inference_mode():
        out = fused(x)
        assert out.shape == (rows, 32)
        assert torch.allclose(out.float(), expected.float(), atol=tolerance, rtol=tolerance)
        assert torch.allclose(holder.a(x).float(), expected[:, :24].float(), atol=tolerance, rtol=tolerance)
        assert torch.allclose(holder.b(x).float(), expected[:, 24:].float(), atol=tolerance, rtol=tolerance)
        assert fused(x.reshape(1, rows, 40)).shape == (1, rows, 32)  # a leading batch axis kept
    assert (type(holder.a).__name__ == "PackedSlice") == (kernel in linear.OPAQUE)
    assert tiles[:3] == ([(rows, 12), (rows, 12), (rows, 8)] if kernel == "tiled" else [])


def test_the_choice_is_measured_once_stored_and_reused(fresh_store, monkeypatch):
    """The first choice measures (the fastest per token over a decode and a prefill pass wins) and writes
    kernels.json; a later process (the in-process memory cleared) reads it back without measuring."""
    calls = []

    def fake_measure(dtype, shapes, num_layers, head, kernels, head_kernels):
        calls.append(kernels)
        per_rows = {"linear": (0.020, 0.080), "tiled": (0.021, 0.080), "input_major": (0.012, 0.120),
                    "prepacked": (0.016, 0.060), "zentorch": (0.017, 0.064)}
        return {"layers": {k: {linear.DECODE_ROWS: per_rows[k][0], linear.PREFILL_ROWS: per_rows[k][1]}
                           for k in kernels},
                "head": {"linear": 0.004, "tiled": 0.0035, "input_major": 0.003} if head else {}, "layers_timed": 2}

    monkeypatch.setattr(linear, "measure", fake_measure)
    shapes = [(64, 128), (64, 64)]
    heard = []
    choice = linear.choose_kernel(torch.float32, shapes, 2, (64, 500), True, heard.append)
    assert heard == [f"timing the linear kernels on this CPU for float32 (once per machine; the choice is stored "
                     f"in {fresh_store})"]
    # per token: linear 0.020/16 + 0.080/128 = 1.875 ms; input-major 0.75 + 0.9375 = 1.6875; prepacked 1.0 + 0.469
    expected = "prepacked" if linear.prepack_available(torch.float32) else "input_major"
    assert choice["kernel"] == expected and choice["head_kernel"] == "input_major"
    assert "16 and 128 rows" in choice["why"] and len(calls) == 1
    stored = json.loads(fresh_store.read_text())
    assert [v["kernel"] for v in stored.values()] == [expected]
    monkeypatch.setattr(linear, "_CHOSEN", {})
    again = linear.choose_kernel(torch.float32, shapes, 2, (64, 500), True, heard.append)
    assert again["kernel"] == expected and len(calls) == 1 and str(fresh_store) in again["why"]
    assert len(heard) == 1  # read back: nothing to announce
    other = linear.choose_kernel(torch.float32, [(32, 32)], 2, None, True)  # other shapes: measured anew
    assert len(calls) == 2 and other["head_kernel"] == "linear"


def test_a_tied_head_is_offered_the_kernels_that_keep_the_table_and_a_prepacked_copy(fresh_store, monkeypatch):
    """A tied head is the embedding table: F.linear, tiled F.linear or input-major (the table re-laid in
    place) keep its one copy; prepacked is offered as a oneDNN copy beside it (where oneDNN can prepack),
    taken only where it measures fastest; an untied head may take any."""
    offered = []

    def fake_measure(dtype, shapes, num_layers, head, kernels, head_kernels):
        offered.append(tuple(head_kernels))
        return {"layers": {k: {linear.DECODE_ROWS: 1.0, linear.PREFILL_ROWS: 1.0} for k in kernels},
                "head": {k: 1.0 for k in head_kernels}, "layers_timed": 1}

    monkeypatch.setattr(linear, "measure", fake_measure)
    linear.choose_kernel(torch.float32, [(8, 8)], 1, (8, 50), True)
    linear.choose_kernel(torch.float32, [(8, 8)], 1, (8, 50), False)
    packs, zen = linear.prepack_available(torch.float32), linear.zentorch_available(torch.float32)
    assert offered[0] == ("linear", "tiled", "input_major") + (("prepacked",) if packs else ()) + (
        ("zentorch",) if zen else ())
    assert set(offered[1]) == set(linear.KERNELS) - {k for k, ok in (("prepacked", packs), ("zentorch", zen)) if not ok}


def test_a_forced_kernel_wins_and_a_wrong_one_is_one_clear_error(fresh_store, monkeypatch):
    monkeypatch.setenv(linear.ENV, "input_major")
    assert linear.choose_kernel(torch.float32, [(8, 8)], 1)["kernel"] == "input_major"
    monkeypatch.setenv(linear.ENV, "prepacked")
    choice = linear.choose_kernel(torch.float32, [(8, 8)], 1, (8, 50), True)
    assert choice["why"] == f"forced by {linear.ENV}" and choice["head_kernel"] == "linear"  # tied: no copy
    monkeypatch.setenv(linear.ENV, "fastest")
    with pytest.raises(ValueError, match="KVTUI_LINEAR_KERNEL='fastest': choose one of linear, tiled, input_major"):
        linear.choose_kernel(torch.float32, [(8, 8)], 1)
    assert not fresh_store.exists()  # forced choices are not stored


def test_measure_times_every_kernel_over_layers_that_outgrow_the_cache(monkeypatch):
    """Real timings on small shapes: every kernel and row count gets a positive time, the head a time per
    head kernel, and a pass covers as many distinct layers as twice the largest cache needs (a 1 MiB
    cache here), at most the model's."""
    monkeypatch.setattr(linear, "_largest_cache_bytes", lambda: 1 << 20)
    shapes = [(128, 256), (256, 128)]  # 64K weights x 4 bytes = 256 KiB a layer: 8 layers make 2 MiB
    result = linear.measure(torch.float32, shapes, 20, (128, 1000), ("linear", "input_major"), ("linear",), repeats=1)
    assert result["layers_timed"] == 8
    assert set(result["layers"]) == {"linear", "input_major"}
    assert all(t > 0 for per_rows in result["layers"].values() for t in per_rows.values())
    assert set(result["layers"]["linear"]) == {linear.DECODE_ROWS, linear.PREFILL_ROWS}
    assert list(result["head"]) == ["linear"] and result["head"]["linear"] > 0
    assert linear.measure(torch.float32, shapes, 3, None, ("linear",), (), repeats=1)["layers_timed"] == 3


def test_the_cpu_flags_the_bench_prints_are_the_machines():
    from kvtui.bench.common import KERNEL_FLAGS, cpu_flags

    with open("/proc/cpuinfo") as f:
        line = next(line for line in f if line.split(":", 1)[0].strip() in ("flags", "Features"))
    have = set(line.split(":", 1)[1].split())
    assert cpu_flags() == [flag for flag in KERNEL_FLAGS if flag in have]


def test_two_processes_loading_at_once_measure_once_and_pick_the_same_kernel(tmp_path):
    """The first process to load measures (under a lock on kernels.json); one started meanwhile waits and
    reads that choice, so every process on the machine computes with the same kernel (a run and its
    references must agree bit for bit in the batch-invariant mode)."""
    import os
    import subprocess
    import sys

    script = f"""
import time, torch
from kvtui.engine import linear
def slow(dtype, shapes, num_layers, head, kernels, head_kernels):
    with open({str(tmp_path / "measured")!r}, "a") as f:
        f.write("x\\n")
    time.sleep(1.5)
    return {{"layers": {{k: {{linear.DECODE_ROWS: 1.0, linear.PREFILL_ROWS: 1.0 + i}} for i, k in enumerate(kernels)}},
            "head": {{k: 1.0 for k in head_kernels}}, "layers_timed": 1}}
linear.measure = slow
print(linear.choose_kernel(torch.float32, [(8, 8)], 1, (8, 50), True)["kernel"])
"""
    env = {**os.environ, "KVTUI_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env.pop("KVTUI_LINEAR_KERNEL", None)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert outs == ["linear", "linear"]  # the first kernel has the smallest prefill time in the fake
    assert (tmp_path / "measured").read_text() == "x\n"


def test_a_prepacked_untied_head_leaves_no_second_copy_and_the_choice_can_be_asked_again(monkeypatch):
    """tiny-llama's LM head is untied: prepacked, it becomes a PackedSlice and the old nn.Linear (with its
    [V, hidden] weight) is freed, not kept by the engine's runner; asking for the kernel choice of the
    re-laid model returns the one it was built with (its head has no .weight to inspect any more)."""
    import gc
    import weakref

    from kvtui.engine.fused import kernel_choice
    from kvtui.models import build_tiny

    if not linear.prepack_available(torch.float32):
        pytest.skip("oneDNN cannot prepack float32 in this torch build")
    monkeypatch.setenv(linear.ENV, "prepacked")
    model, _ = build_tiny("tiny-llama")
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight  # untied
    old_head = weakref.ref(model.get_output_embeddings())
    engine = make_engine(model, num_slots=1, max_len=32)
    gc.collect()
    assert old_head() is None
    assert type(engine.runner.head).__name__ == "PackedSlice" and engine.runner.head is model.get_output_embeddings()
    assert kernel_choice(model) is model._kvtui_fused.kernel_choice


@pytest.mark.parametrize("kernel", linear.OPAQUE)
def test_a_prepacked_tied_head_is_a_copy_beside_the_table_and_gives_its_logits(kernel, monkeypatch):
    """A tied head that measured fastest on an opaque kernel runs on a oneDNN (zentorch) copy of the table:
    the embedding keeps the table (its values and the head module's weight untouched: zentorch's linear
    rewrites an unpacked weight in place, so its copy is packed from a copy), and the fused forward's
    logits are the table's own F.linear logits."""
    from kvtui.engine import fused
    from kvtui.models import build_tiny

    available = linear.prepack_available if kernel == "prepacked" else linear.zentorch_available
    if not available(torch.float32):
        pytest.skip(f"{kernel} cannot run float32 here")
    model, _ = build_tiny("tiny-llama")
    model.lm_head.weight = model.model.embed_tokens.weight  # tie them, as SmolLM2's are
    table = model.model.embed_tokens.weight.detach().clone()
    monkeypatch.setattr(fused, "kernel_choice", lambda model, announce=None: {
        "kernel": "linear", "head_kernel": kernel, "why": "measured (test)", "ms": {}})
    make_engine(model, num_slots=1, max_len=32)
    head = model._kvtui_fused.head
    assert head.kernel == kernel and model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert torch.equal(model.get_input_embeddings().weight, table)
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.allclose(model._kvtui_fused.logits(hidden), F.linear(hidden, table), atol=1e-5, rtol=1e-5)


def test_off_the_cpu_the_kernel_is_f_linear_and_nothing_is_measured(fresh_store):
    """A model on another device (the meta device stands in for CUDA here) takes F.linear without a
    measurement: the candidates are CPU kernels (oneDNN's prepacking has no CUDA implementation)."""
    from kvtui.engine.fused import kernel_choice
    from kvtui.models import build_tiny

    model, _ = build_tiny("tiny-llama")
    choice = kernel_choice(model.to("meta"))
    assert (choice["kernel"], choice["head_kernel"]) == ("linear", "linear") and "meta" in choice["why"]
    assert not fresh_store.exists()


def test_kvtui_serve_chooses_the_kernel_with_the_threads_its_engine_computes_with(fresh_store):
    """serve loads the model on the main thread and steps it on an engine thread set to --threads: the
    kernel is chosen at load with those threads (the stored key says so), and the loading thread's own
    thread count is left as it was."""
    import json

    from kvtui.serve.options import ServeOptions
    from kvtui.serve.server import _load_model

    before = torch.get_num_threads()
    threads = 1 if before != 1 else 2
    _load_model(ServeOptions(model="tiny-llama", threads=threads, progress=False))
    assert torch.get_num_threads() == before
    keys = list(json.loads(fresh_store.read_text()))
    assert len(keys) == 1 and f" threads {threads} | float32 |" in keys[0]


def test_a_wrong_forced_kernel_is_one_line_and_exit_2_when_a_run_loads_its_model(monkeypatch, capsys):
    """kvtui run's model load (cli.inputs.load_model) turns a bad KVTUI_LINEAR_KERNEL into one error line
    and exit 2, not a traceback."""
    import typer

    from kvtui.cli.inputs import load_model

    monkeypatch.setenv(linear.ENV, "bogus")
    monkeypatch.setattr(linear, "_CHOSEN", {})
    with pytest.raises(typer.Exit) as exit_info:
        load_model("tiny-llama", "float32", "cpu")
    assert exit_info.value.exit_code == 2
    err = capsys.readouterr().err
    assert "KVTUI_LINEAR_KERNEL='bogus': choose one of linear, tiled, input_major" in err and "Traceback" not in err
