"""Linear layers on the kernel this CPU runs fastest, chosen by measurement.

A linear layer `y = x W^T + b` can be computed from one stored weight by four exact kernels (the same
arithmetic; results may differ in the last bits, since each sums in its own order):

  - "linear": `F.linear` on nn.Linear's own [out, in] layout;
  - "tiled": the same layout and BLAS call, over tiles of TILE output features written into one output
    (for a wide layer such as a 49152-token LM head, BLAS picks a faster blocking per tile: on a
    2-core AMD EPYC with avx2, no avx512, SmolLM2's head at 16 rows took 21 ms against 26 ms whole,
    weights cold, one thread);
  - "input_major": `x @ W` on the weight stored [in, out] contiguous;
  - "prepacked": oneDNN's `_linear_pointwise` on a weight reordered once into oneDNN's blocked layout
    (`torch.ops.mkldnn._reorder_linear_weight`), valid for any row count (vLLM's CPU path and
    inductor's freezing do the same);
  - "zentorch": AMD's zentorch plugin (`pip install 'kvtui[zentorch]'`, a wheel per torch release) on a
    weight it prepacked once (`zentorch_weight_prepack_for_linear` on a copy: its linear op called on an
    unpacked weight rewrites that weight in place). A candidate only where the plugin imports and
    computes a probe right.

Which is fastest depends on the CPU, the dtype and the row count. Measured with one thread over 30
distinct layers of SmolLM2's shapes (weights cold, as a step meets them), float32, ms: on a 2-core AMD
EPYC (avx512_bf16, no AMX) at 16 rows 74.4 (linear) / 72.0 (input-major) / 44.0 (prepacked); on a
2-core Intel Xeon (AVX-512 with avx512_bf16, no AMX) 78 / 72 / 58 at 16 rows and 464 / 435 / 437 at
256 rows; on an Intel Xeon with AMX input-major was 1.3-2.3x faster than linear at 8-64 rows
(docs/performance.md). So nothing is assumed: `choose_kernel` times every candidate on the model's own
shapes at load and keeps the one with the smallest time per token over a decode step (DECODE_ROWS)
and a prefill chunk (PREFILL_ROWS), and stores the choice per CPU model, flags, torch version, threads,
dtype and shapes in kvtui's cache (`kernels.json`), so every later process on the machine picks the
same kernel without measuring. Off the CPU (a CUDA model) the kernel is `F.linear`, unmeasured.
`KVTUI_LINEAR_KERNEL=linear|tiled|input_major|prepacked|zentorch` forces one.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F

KERNELS = ("linear", "tiled", "input_major", "prepacked", "zentorch")
OPAQUE = ("prepacked", "zentorch")  # kernels whose weight is a blocked copy no nn.Linear can read
# a tied head's kernels: those that keep the embedding's one copy readable, and the opaque ones as a copy
# of the table beside it (vocab x hidden more bytes: 113 MB for SmolLM2 in float32), taken only where one
# measures fastest, as vLLM's CPU path keeps such a copy
TIED_HEAD_KERNELS = ("linear", "tiled", "input_major", "prepacked", "zentorch")
TILE = 2048  # output features per tile of the "tiled" kernel (1024 to 4096 timed alike)
ENV = "KVTUI_LINEAR_KERNEL"
DECODE_ROWS, PREFILL_ROWS = 16, 128

_CHOSEN: dict = {}  # (dtype, shapes) -> {"kernel", "why", "ms"}, once per process


def prepack_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack a linear weight of `dtype` in this torch build (tried on a 16 x 16
    weight)."""
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=dtype))
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 16, dtype=dtype), w, None, "none", [], "")
        return bool(torch.backends.mkldnn.is_available() and out.shape == (2, 16) and float(out[0, 0]) == 16.0)
    except (RuntimeError, AttributeError):
        return False


def zentorch_available(dtype: torch.dtype) -> bool:
    """Whether AMD's zentorch plugin imports here and computes a linear of `dtype` right on a weight it
    prepacked (tried on a 16 x 16 weight of ones; any failure, an Intel CPU it refuses included, is False)."""
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    try:
        try:  # ctranslate2 first where it is installed: loaded after zentorch, its Whisper (the transcripts'
            import ctranslate2  # noqa: F401  reference) returned one token repeated (measured, ctranslate2 4.8.5)
        except ImportError:
            pass
        import zentorch  # noqa: F401  (registers torch.ops.zentorch)

        w = torch.ops.zentorch.zentorch_weight_prepack_for_linear(torch.ones(16, 16, dtype=dtype))
        out = torch.ops.zentorch.zentorch_linear_unary(torch.ones(2, 16, dtype=dtype), w, is_weight_prepacked=True)
        return out.shape == (2, 16) and float(out[0, 0]) == 16.0
    except Exception:  # ImportError, or the plugin failing on this CPU or dtype
        return False


class FusedLinear:
    """One linear layer over the concatenated outputs of `linears` (q, k and v; gate and up; or one
    layer alone), its weight held once, in `kernel`'s layout.

    With "linear", "tiled" and "input_major" each nn.Linear's weight (and bias) becomes a view into the fused
    tensor, so the model's own modules keep computing on the same numbers. A prepacked weight is opaque
    (oneDNN's or zentorch's blocked layout): the nn.Linear modules are then replaced in `owner` by `PackedSlice`
    modules that run this layer and keep their own columns, so `model.generate` and --enforce-eager
    still work, without a second copy of any weight.

    Args:
        linears: nn.Linear modules sharing in_features, [out_i, in] weights, optional [out_i] biases.
        kernel: one of KERNELS.
        owners: for each linear, (parent module, attribute name), needed only for the OPAQUE kernels.
    Raises:
        ValueError: unknown kernel.
    """

    def __init__(self, linears: list[torch.nn.Linear], kernel: str, owners: list[tuple] | None = None) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"unknown linear kernel {kernel!r}: choose one of {', '.join(KERNELS)}")
        self.kernel = kernel
        self.in_features = linears[0].in_features
        self.sizes = [lin.out_features for lin in linears]
        self.out_features = sum(self.sizes)
        weight = torch.cat([lin.weight.detach() for lin in linears], dim=0).contiguous()  # [N, in]
        self.bias = None
        if linears[0].bias is not None:
            self.bias = torch.cat([lin.bias.detach() for lin in linears]).contiguous()
        if kernel == "input_major":
            weight = weight.t().contiguous()  # [in, N]
        if kernel in OPAQUE:  # `weight` is a fresh tensor (torch.cat): the plugin may rewrite it in place
            self.weight = (torch.ops.mkldnn._reorder_linear_weight(weight) if kernel == "prepacked" else
                           torch.ops.zentorch.zentorch_weight_prepack_for_linear(weight))
            del weight
            start = 0
            for lin, (parent, name) in zip(linears, owners or []):
                setattr(parent, name, PackedSlice(self, start, start + lin.out_features))
                start += lin.out_features
            return
        self.weight = weight
        start = 0
        for lin in linears:
            n = lin.out_features
            lin.weight.data = weight[:, start : start + n].t() if kernel == "input_major" else weight[start : start + n]
            if self.bias is not None:
                lin.bias.data = self.bias[start : start + n]
            start += n

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype."""
        if self.kernel == "linear" or (self.kernel == "tiled" and self.out_features <= TILE):
            return F.linear(x, self.weight, self.bias)
        if self.kernel == "tiled":
            return self._tiled(x)
        if self.kernel == "input_major":
            out = x.matmul(self.weight)
            return out if self.bias is None else out + self.bias
        flat = x.reshape(-1, self.in_features)
        if self.kernel == "zentorch":
            out = torch.ops.zentorch.zentorch_linear_unary(flat, self.weight, self.bias, is_weight_prepacked=True)
        else:
            out = torch.ops.mkldnn._linear_pointwise(flat, self.weight, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        """The "tiled" kernel: x [..., in] -> [..., out], F.linear's call (mm, or addmm with the bias) on
        each TILE output features, written into their columns of one output."""
        flat = x.reshape(-1, self.in_features)
        out = flat.new_empty(flat.shape[0], self.out_features)
        for start in range(0, self.out_features, TILE):
            stop = min(start + TILE, self.out_features)
            tile = self.weight[start:stop].t()
            if self.bias is None:
                torch.mm(flat, tile, out=out[:, start:stop])
            else:
                torch.addmm(self.bias[start:stop], flat, tile, out=out[:, start:stop])
        return out.reshape(*x.shape[:-1], self.out_features)


class PackedSlice(torch.nn.Module):
    """Stands in for an nn.Linear whose weight went into a prepacked FusedLinear: its output is the
    fused layer's columns start..stop-1 (the fused layer runs whole, so calling q, k and v separately
    costs three fused multiplies; only transformers' own module path does that)."""

    def __init__(self, fused: FusedLinear, start: int, stop: int) -> None:
        super().__init__()
        self.fused, self.start, self.stop = fused, start, stop
        self.in_features, self.out_features = fused.in_features, stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x)[..., self.start : self.stop]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fused.kernel}"


def _largest_cache_bytes() -> int:
    """The largest CPU cache's size in bytes (Linux sysfs; 64 MiB when it cannot be read)."""
    import glob

    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(path).read().strip().upper()
            sizes.append(int(text.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1))
        except (OSError, ValueError):
            pass
    return max(sizes, default=64 << 20)


def _standalone(kernel: str, weight: torch.Tensor) -> FusedLinear:
    """A FusedLinear of `kernel` over a copy of `weight` [out, in] (for timing; nothing else holds it)."""
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    lin.weight.data = weight.clone()
    holder = torch.nn.Module()
    holder.lin = lin
    return FusedLinear([lin], kernel, [(holder, "lin")])


def _pass(stack: list[FusedLinear], inputs: list[torch.Tensor]) -> None:
    """Each layer of `stack` once, layer i on inputs[i % len(inputs)]; the outputs are dropped."""
    for i, layer in enumerate(stack):
        layer(inputs[i % len(inputs)])


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(dtype: torch.dtype, shapes: list[tuple[int, int]], num_layers: int, head: tuple[int, int] | None = None,
            kernels=KERNELS, head_kernels=TIED_HEAD_KERNELS, rows=(DECODE_ROWS, PREFILL_ROWS),
            repeats: int = 3) -> dict:
    """Seconds a model's linear layers take per kernel on this CPU with the weights cold, as a step meets
    them (a decode step reads SmolLM2's 425 MB of float32 weights from memory; one layer timed over and
    over stays hot in the cache and ranks the kernels wrongly: see the module docstring). Each kernel
    runs over enough distinct layers of `shapes` ((in, out) each; copies of one random layer of `dtype`)
    to hold twice the largest cache, at most `num_layers`; the LM head `head` ((in, vocab), or None) is
    timed right after such a pass, cold too, for each of `head_kernels`.

    Returns {"layers": {kernel: {rows: fastest of `repeats` passes, seconds}}, "head": {kernel: seconds
    at DECODE_ROWS rows}, "layers_timed": how many layers a pass covered}.
    """
    generator = torch.Generator().manual_seed(0)
    source = [torch.randn(o, i, generator=generator).to(dtype) for i, o in shapes]
    layer_bytes = sum(w.numel() for w in source) * source[0].element_size()
    count = max(1, min(num_layers, -(-2 * _largest_cache_bytes() // layer_bytes)))
    inputs = {n: [torch.randn(n, i, generator=generator).to(dtype) for i, _ in shapes] for n in rows}
    table = None if head is None else torch.randn(head[1], head[0], generator=generator).to(dtype)
    heads = {} if table is None else {k: _standalone(k, table) for k in head_kernels}
    head_x = None if head is None else torch.randn(DECODE_ROWS, head[0], generator=generator).to(dtype)
    layers = {k: {n: float("inf") for n in rows} for k in kernels}
    head_s = dict.fromkeys(heads, float("inf"))
    with torch.inference_mode():
        for kernel in kernels:
            stack = [_standalone(kernel, w) for _ in range(count) for w in source]
            for n in rows:
                one_pass = partial(_pass, stack, inputs[n])
                one_pass()  # warm-up: a kernel may pick and pack on its first call
                for _ in range(repeats):
                    layers[kernel][n] = min(layers[kernel][n], _seconds(one_pass))
                    for name, lin in heads.items() if n == rows[0] else ():  # cold: a layer pass came between
                        head_s[name] = min(head_s[name], _seconds(lambda lin=lin: lin(head_x)))
            del stack
    return {"layers": layers, "head": head_s, "layers_timed": count}


def cpu_identity() -> tuple[str, str]:
    """This CPU's model name (/proc/cpuinfo, else platform.processor()) and a 12-hex-digit digest of its
    flags (the instruction sets generated code may use): what machine-specific choices and code are keyed by."""
    found = {"model name": platform.processor(), "flags": ""}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name = line.split(":", 1)[0].strip()
                if name in found and ":" in line:
                    found[name] = line.split(":", 1)[1].strip()
                if name == "flags":
                    break
    except OSError:
        pass
    return found["model name"], hashlib.sha256(found["flags"].encode()).hexdigest()[:12]


def _machine_key() -> str:
    """CPU model, a digest of its flags, torch version and threads: what a kernel choice holds for."""
    model, digest = cpu_identity()
    return f"{model} flags:{digest} torch {torch.__version__} threads {torch.get_num_threads()}"


def _store_path():
    from kvtui.models.default import cache_dir

    return cache_dir() / "kernels.json"


def runnable_kernels(dtype: torch.dtype) -> list[str]:
    """The KERNELS that can run `dtype` here: all but "prepacked" where oneDNN cannot prepack it and
    "zentorch" where the plugin is missing or fails its probe."""
    available = {"prepacked": prepack_available, "zentorch": zentorch_available}
    return [k for k in KERNELS if k not in available or available[k](dtype)]


def choose_kernel(dtype: torch.dtype, shapes: list[tuple[int, int]], num_layers: int = 1,
                  head: tuple[int, int] | None = None, tied: bool = True, announce=None) -> dict:
    """The linear kernels for a model's layers (`num_layers` layers of `shapes`, (in, out) each) and LM
    head (`head`, (in, vocab), or None) in `dtype` on this machine.

    The layers take one of KERNELS. A tied head is the embedding table itself, so it may take a kernel
    that keeps one copy the embedding can still read: "linear", "tiled", or "input_major" (the table
    stored [hidden, vocab], the embedding reading rows of its transposed view); or an OPAQUE one, a
    oneDNN or zentorch copy of the table beside it (vocab x hidden more bytes); an untied head any.

    Order: $KVTUI_LINEAR_KERNEL when set (the layers, and the head where it can); this process's earlier
    choice; the choice stored in kvtui's cache for this CPU model, flags, torch version, threads, dtype
    and shapes; else `measure` now and store it. The layers' kernel is the one with the smallest
    DECODE_ROWS-row time / DECODE_ROWS + PREFILL_ROWS-row time / PREFILL_ROWS (time per token, decode
    and prefill tokens weighed alike); the head's the fastest at DECODE_ROWS rows. `announce` (one line)
    hears about a measurement before it starts (about 15 s for SmolLM2 on one thread, once per machine).

    Returns {"kernel", "head_kernel", "why": one line, "ms": {"layers": {kernel: {rows: ms}}, "head":
    {kernel: ms}} or {}}.
    Raises:
        ValueError: $KVTUI_LINEAR_KERNEL names no kernel, or one that cannot run here ("prepacked" where
            oneDNN cannot prepack, "zentorch" where the plugin is missing or fails its probe).
    """
    forced = os.environ.get(ENV)
    candidates = runnable_kernels(dtype)
    head_candidates = [k for k in TIED_HEAD_KERNELS if k in candidates] if tied else candidates
    if forced:
        return _forced_choice(forced, candidates, head_candidates, tied)
    key = (dtype, tuple(shapes), num_layers, head, tied)
    if key in _CHOSEN:
        return _CHOSEN[key]
    store_key = (f"{_machine_key()} | {str(dtype).replace('torch.', '')} | {shapes} x {num_layers} | head {head}"
                 f"{' tied' if tied else ''} | {'/'.join(candidates)}"  # a new candidate measures again
                 + (f" | head {'/'.join(head_candidates)}" if tied else ""))
    path = _store_path()
    with _locked(path):  # one process measures; the others wait and read its choice
        choice = _stored_or_measured(path, store_key, dtype, shapes, num_layers, head, candidates, head_candidates,
                                     announce)
    _CHOSEN[key] = choice
    return choice


def _forced_choice(forced: str, candidates: list[str], head_candidates: list[str], tied: bool) -> dict:
    """choose_kernel's answer when $KVTUI_LINEAR_KERNEL names `forced` (ValueError where it cannot run here)."""
    if forced not in candidates:
        raise ValueError(f"{ENV}={forced!r}: choose one of {', '.join(candidates)} on this machine")
    copy = tied and forced in OPAQUE  # a forced kernel makes no copy of a tied table
    head_kernel = forced if forced in head_candidates and not copy else "linear"
    return {"kernel": forced, "head_kernel": head_kernel, "why": f"forced by {ENV}", "ms": {}}


def _stored_or_measured(path, store_key: str, dtype, shapes, num_layers: int, head, candidates, head_candidates,
                        announce=None) -> dict:
    """The choice stored under `store_key` in `path`, else a new measurement, stored (see choose_kernel)."""
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    old = stored.get(store_key)
    if isinstance(old, dict) and old.get("kernel") in candidates and old.get("head_kernel") in head_candidates:
        return {**old, "why": f"{old.get('why', '')} (stored in {path})"}
    if announce is not None:
        announce(f"timing the linear kernels on this CPU for {str(dtype).replace('torch.', '')} (once per machine; "
                 f"the choice is stored in {path})")
    seconds = measure(dtype, shapes, num_layers, head, candidates, head_candidates)
    per_token = {k: t[DECODE_ROWS] / DECODE_ROWS + t[PREFILL_ROWS] / PREFILL_ROWS for k, t in seconds["layers"].items()}
    best = min(per_token, key=per_token.get)
    head_kernel = min(seconds["head"], key=seconds["head"].get) if seconds["head"] else "linear"
    ms = {"layers": {k: {str(n): round(v * 1e3, 3) for n, v in t.items()} for k, t in seconds["layers"].items()},
          "head": {k: round(v * 1e3, 3) for k, v in seconds["head"].items()}}
    figures = "; ".join(f"{k} {t[str(DECODE_ROWS)]:.1f} / {t[str(PREFILL_ROWS)]:.1f} ms" for k, t in ms["layers"].items())
    heads = "; ".join(f"{k} {v:.1f} ms" for k, v in ms["head"].items())
    choice = {"kernel": best, "head_kernel": head_kernel, "ms": ms,
              "why": (f"fastest per token over {seconds['layers_timed']} distinct layers at {DECODE_ROWS} and "
                      f"{PREFILL_ROWS} rows, weights cold as in a step ({figures})"
                      + (f"; LM head at {DECODE_ROWS} rows: {heads}" if heads else ""))}
    stored[store_key] = choice
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(stored, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache: measure again next time
    return choice


@contextmanager
def _locked(path):
    """An exclusive lock on `path`.lock while the block runs (fcntl; none where the folder cannot be
    written or fcntl is missing: then two processes may both measure, each keeping its own choice)."""
    handle = None
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_suffix(".lock"), "w")
        fcntl.flock(handle, fcntl.LOCK_EX)
    except (OSError, ImportError):
        handle = None
    try:
        yield
    finally:
        if handle is not None:
            handle.close()  # closing releases the lock
