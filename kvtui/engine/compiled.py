"""The fused forward's decode step compiled with torch.compile (inductor).

A decode-only step (every chunk one query token) runs kvtui's fused forward (kvtui/engine/fused.py) as
one inductor graph: the norms, rotary, SiLU and residual adds become generated C++ fused into few
loops, the linear layers kvtui's own oneDNN-prepacked calls (an opaque op), and the LM head on the
sampled rows. The weights stay graph inputs: on torch 2.13, `options={"freezing": True}` per call freezes
nothing (only the global `torch._inductor.config.freezing` does), and with global freezing the step measured
no faster than kvtui's eager step on its prepacked kernels (docs/performance.md). Attention and the KV write stay out of the graph: both run behind one custom
op, `kvtui::pooled_attention`, that writes the step's new K/V into the pool in place and runs
`kvtui_attention` with the step's state, exactly the eager code (every attention path, the
attention_flow measurement and every fault that acts in attention see what they see eagerly). Writing
the KV cache inside the graph instead made the step several times slower (the pool is functionalized:
copied).

Prefill and mixed steps, LoRA rows and the batch-invariant mode run eagerly.

Compiled code is paid once per machine: inductor's own on-disk caches (its FX graph cache and
AOTAutograd's cache) are pointed at a folder under kvtui's cache dir keyed by the torch version, the CPU's
model and flags and the shape policy (`cache_folder`; inductor keys each entry further by the graph, its
configuration and the thread count). A process with a warm folder still traces the module with dynamo
(a few seconds) but neither lowers nor runs the C++ compiler. An AOTInductor package would skip the
tracing too: measured, it holds the step's Python custom ops (its generated code calls
`kvtui::pooled_attention` back in Python, so it loads only in a kvtui process); not used yet
(docs/performance.md).

Compiling needs a C++ compiler (torch's configured cxx): `compile_problem` says why a step cannot be
compiled here, and the engine falls back to eager with that reason. It is off by default
(EngineConfig.compile): on the 2-core AMD EPYC measured (docs/performance.md) the compiled step was no
faster than the eager fused forward, whose linear layers already run oneDNN prepacked kernels, and each
new shape kind costs 30-110 s of compiling, once per machine.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import os
import textwrap
import threading
import time
from pathlib import Path

import torch
from torch.fx.experimental import _config as fx_config

from kvtui.engine import cpu_kernels
from kvtui.engine.attention import kvtui_attention

SHAPES = "rows-dynamic"  # the shape policy compiled_decode asks for (dynamic=True), part of cache_folder's name
ENV = "KVTUI_COMPILE"  # "0": never compile (the test suite's default); "1": compile where possible
_STEP = threading.local()  # the step the custom op serves: .cache, .modules, .mask


@torch.library.custom_op("kvtui::pooled_attention", mutates_args=("k_pool", "v_pool"))
def pooled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                     v_pool: torch.Tensor, layer: int) -> torch.Tensor:
    """One layer's KV write and attention for the running step: k, v [R, Hkv, Q, D] written into the
    layer's pool (k_pool, v_pool, mutated in place: the pool's tensors of `layer`) through the step's
    PooledCache, then q [R, Hq, Q, D] attends as kvtui_attention does. Returns [R, Q, Hq, D] (a new
    tensor). The step's cache, state and mask come from `bound_step` (thread-local).

    Raises:
        RuntimeError: called outside bound_step.
    """
    step = getattr(_STEP, "current", None)
    if step is None:
        raise RuntimeError("kvtui::pooled_attention called outside an engine step")
    cache, modules, mask = step
    kwargs: dict = {}
    keys, values = cache.layers[layer].update(k, v, kwargs=kwargs)
    out, _ = kvtui_attention(modules[layer], q, keys, values, mask, scaling=modules[layer].scaling, **kwargs)
    out = out.contiguous()
    storage = out.untyped_storage().data_ptr()
    if any(storage == t.untyped_storage().data_ptr() for t in (q, k, v, k_pool, v_pool)):
        out = out.clone()  # a custom op's output must not alias its inputs
    return out


@pooled_attention.register_fake
def _(q, k, v, k_pool, v_pool, layer):
    rows, heads, q_len, d = q.shape
    return q.new_empty(rows, q_len, heads, d)


@torch.library.custom_op("kvtui::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, out_features: int) -> torch.Tensor:
    """oneDNN's linear on a weight kvtui prepacked (kvtui/engine/linear.py "prepacked"): x [N, in] ->
    [N, out_features]. Opaque to inductor, which lowers its own mkldnn linear only over weights it
    froze itself."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


@packed_linear.register_fake
def _(x, weight, out_features):
    return x.new_empty(x.shape[0], out_features)


class bound_step:
    """Context manager: the custom op serves `cache` (a PooledCache bound to the step's state), with the
    layers' attention modules `modules` (for the scaling and overrides) and the additive `mask` (None on
    the own-range path)."""

    def __init__(self, cache, modules, mask) -> None:
        self.value = (cache, modules, mask)

    def __enter__(self):
        self.previous = getattr(_STEP, "current", None)
        _STEP.current = self.value
        return self

    def __exit__(self, *exc) -> None:
        _STEP.current = self.previous


def compile_problem(model, *, compile: bool | None = None, enforce_eager: bool = False,
                    batch_invariant: bool = False) -> str | None:
    """Why the decode step of `model` is not compiled here, or None when it can be, in this order: a model
    the fused forward does not run, a model off the CPU, --enforce-eager, the batch-invariant mode,
    --no-compile (`compile` False), $KVTUI_COMPILE=0 when the choice is automatic (`compile` None; an
    explicit --compile overrides it), no C++ compiler (torch's configured cxx not on PATH)."""
    from kvtui.engine import fused

    if not fused.supports(model):
        return f"the compiled step runs Llama-family models, not {model.config.model_type!r}"
    if model.device.type != "cpu":
        return f"the model is on {model.device.type}"
    if enforce_eager:
        return "--enforce-eager runs transformers' own modules"
    if batch_invariant:
        return "the batch-invariant mode runs its own tiled forward"
    if compile is False:
        return "compile off (--compile turns it on)"
    if compile is None and os.environ.get(ENV) == "0":
        return f"${ENV}=0"
    if cpu_kernels.compiler_path() is None:
        from torch._inductor import config

        return f"no C++ compiler found (torch looks for {' or '.join(c for c in config.cpp.cxx if c)})"
    return None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward (fused._rms_norm), traceable: float32 variance, rsqrt, cast back, times weight."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary_pos_emb for q and k at once (fused._rotate without its out= buffers, which a graph
    cannot hold): (x * cos) + (rotate_half(x) * sin), rotate_half(x) = (-x2, x1)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class _DecodeModule(torch.nn.Module):
    """The fused forward of a decode step as a module whose weights are parameters (graph inputs to
    inductor; see the module docstring on freezing): forward(embeds [R, Q, hidden], position_ids [R, Q], sample_row [S],
    sample_col [S], *pools) -> logits [S, V] in the model dtype."""

    def __init__(self, fused) -> None:
        super().__init__()
        self.fused = fused
        params = torch.nn.ParameterDict()
        for i, layer in enumerate(fused.layers):
            for name in ("qkv", "o", "gate_up", "down"):
                params[f"{name}{i}"] = torch.nn.Parameter(getattr(layer, name).weight, requires_grad=False)
            params[f"norm1_{i}"] = torch.nn.Parameter(layer.norm1.detach(), requires_grad=False)
            params[f"norm2_{i}"] = torch.nn.Parameter(layer.norm2.detach(), requires_grad=False)
        params["final_norm"] = torch.nn.Parameter(fused.final_norm.detach(), requires_grad=False)
        params["head"] = torch.nn.Parameter(fused.head.weight, requires_grad=False)
        self.params = params

    def _linear(self, which, name: str, x: torch.Tensor) -> torch.Tensor:
        weight = self.params[name]
        if which.kernel == "prepacked":
            flat = x.reshape(-1, which.in_features)
            out = torch.ops.kvtui.packed_linear(flat, weight, which.out_features)
            return out.reshape(*x.shape[:-1], which.out_features)
        if which.kernel == "zentorch":  # zentorch's op traces under inductor (it has a fake kernel)
            flat = x.reshape(-1, which.in_features)
            out = torch.ops.zentorch.zentorch_linear_unary(flat, weight, is_weight_prepacked=True)
            return out.reshape(*x.shape[:-1], which.out_features)
        if which.kernel == "input_major":
            return x.matmul(weight)
        return torch.nn.functional.linear(x, weight)

    def forward(self, embeds, cos, sin, sample_row, sample_col, k_pools: list, v_pools: list):
        fused = self.fused
        hidden = embeds
        rows, q_len = hidden.shape[:2]
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        for i, layer in enumerate(fused.layers):
            d = layer.head_dim
            qkv = self._linear(layer.qkv, f"qkv{i}", _rms_norm(hidden, self.params[f"norm1_{i}"], float(layer.eps1)))
            split = layer.q_size + layer.kv_size
            qk = _rotate(qkv[..., :split].reshape(rows, q_len, -1, d), cos, sin)
            heads = layer.q_size // d
            q = qk[:, :, :heads].transpose(1, 2)
            k = qk[:, :, heads:].transpose(1, 2)
            v = qkv[..., split:].reshape(rows, q_len, -1, d).transpose(1, 2)
            out = torch.ops.kvtui.pooled_attention(q.contiguous(), k.contiguous(), v.contiguous(), k_pools[i],
                                                   v_pools[i], i)
            hidden = hidden + self._linear(layer.o, f"o{i}", out.reshape(rows, q_len, -1))
            gate, up = self._linear(layer.gate_up, f"gate_up{i}",
                                    _rms_norm(hidden, self.params[f"norm2_{i}"], float(layer.eps2))).split(layer.inter, dim=-1)
            hidden = hidden + self._linear(layer.down, f"down{i}", torch.nn.functional.silu(gate) * up)
        hidden = _rms_norm(hidden, self.params["final_norm"], float(fused.final_eps))[sample_row, sample_col]
        return self._linear(fused.head, "head", hidden)


def cache_folder() -> Path:
    """Where compiled decode steps are kept on this machine: `compiled/torch-<version>-<cpu flags digest>-<shape
    policy>` under kvtui's cache dir (kvtui.models.default.cache_dir: $KVTUI_CACHE_DIR, else ~/.cache/kvtui).
    Not created here."""
    from kvtui.engine.linear import cpu_identity
    from kvtui.models.default import cache_dir

    _, flags = cpu_identity()
    return cache_dir() / "compiled" / f"torch-{torch.__version__}-cpu-{flags}-{SHAPES}"


def _kind(args) -> tuple:
    """What makes dynamo compile a new graph for the same module (its 0/1 size specialization under
    dynamic shapes): which sizes of the step's tensors are 1, and their dtypes. The pools share one shape."""
    tensors = list(args[:5]) + [args[5][0], args[6][0]]
    return tuple((t.dtype, tuple(d == 1 for d in t.shape)) for t in tensors)


_WARMED = threading.Event()  # set once a warm-up thread started in this process


def _warm_up_inductor() -> None:
    """Inductor's fixed costs in each process, paid ahead of the first decode step (in a background thread
    while the model loads and prefills): importing its modules (about 2 s here) and probing which vector
    instruction sets the C++ compiler can build and this CPU can run (small programs built and loaded, about
    2.5 s; torch keeps the answer for the process). A failure here is left for the first compile to meet."""
    try:
        import torch._inductor.compile_fx  # noqa: F401
        from torch._inductor import cpu_vec_isa

        cpu_vec_isa.valid_vec_isa_list()
    except Exception:  # noqa: BLE001 - the compile itself reports it
        pass


def _inductor_counts() -> tuple[int, int]:
    """Inductor's FX graph cache misses and bypasses (graphs it would not cache) so far in this process."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_miss"], counters["inductor"]["fxgraph_cache_bypass"]


class CompiledDecode:
    """The compiled decode step of one FusedLlama: callable as _DecodeModule.forward (embeds, cos, sin,
    sample_row, sample_col, k_pools, v_pools) -> logits [S, V], compiled by inductor lazily on the first call
    per shape kind (one row, several rows) in a process, from inductor's on-disk cache under `folder` when a
    process before this one compiled that kind.

    Attributes:
        graph: the torch.compile'd module.
        folder: the on-disk cache (cache_folder()).
        announce: None, or a callable that hears one line before a shape kind's first call in this process
            ("compiling the decode step for this machine (once; cached under ...)" when no process on this
            machine compiled it before, "compiled code from cache (...)" when one did) and one after it, with
            its seconds.
        first_calls: per shape kind called so far, {"seconds": the first call's wall time, "from_cache":
            whether no graph was compiled for it (inductor's FX graph cache served it, or dynamo already held it)}.
    """

    def __init__(self, fused) -> None:
        module = _DecodeModule(fused).eval()
        self.graph = torch.compile(module, backend="inductor", dynamic=True, fullgraph=True)
        self.folder = cache_folder()  # inductor is pointed at it on the first call
        self.announce = None
        self.first_calls: dict[tuple, dict] = {}
        self._lock = threading.Lock()
        self._signature = _model_signature(module)
        if not _WARMED.is_set():
            _WARMED.set()
            threading.Thread(target=_warm_up_inductor, name="kvtui-inductor-warm-up", daemon=True).start()

    def __call__(self, *args):
        kind = _kind(args)
        if kind in self.first_calls:
            return self._run(args)
        with self._lock:  # the first call of a kind compiles once, whichever engine's thread comes first
            if kind in self.first_calls:
                return self._run(args)
            return self._first_call(kind, args)

    def _run(self, args):
        # every size its own symbol: with dynamo's duck shaping, sizes that happen to be equal (a max_len
        # of 64 and a hidden size of 64) share one, so an engine of another max_len or slot count traced
        # another graph and missed the on-disk cache
        with fx_config.patch(use_duck_shape=False):
            return self.graph(*args)

    def _first_call(self, kind, args):
        # inductor's on-disk caches (its FX graph cache and AOTAutograd's, both on by default in torch 2.13)
        # for the whole process: inductor reads $TORCHINDUCTOR_CACHE_DIR on each look-up; a folder that
        # cannot be written leaves inductor its own default
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            writable = os.access(self.folder, os.W_OK)
        except OSError:
            writable = False
        if writable:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.folder)
        key = repr((self._signature, kind, torch.get_num_threads()))  # inductor keys its entries by threads too
        marker = self.folder / "kvtui-steps" / hashlib.sha256(key.encode()).hexdigest()[:24]
        if self.announce is not None:
            self.announce(f"compiling the decode step ({self.folder} cannot be written: inductor keeps its own "
                          "cache folder)" if not writable else
                          f"compiled code from cache ({self.folder})" if marker.exists() else
                          f"compiling the decode step for this machine (once; cached under {self.folder})")
        before = _inductor_counts()
        start = time.perf_counter()
        out = self._run(args)
        seconds = time.perf_counter() - start
        misses, bypasses = (now - then for now, then in zip(_inductor_counts(), before))
        from_cache = not misses and not bypasses
        self.first_calls[kind] = {"seconds": seconds, "from_cache": from_cache}
        if self.announce is not None:
            how = ("compiled code from cache" if from_cache else
                   "compiled now; later processes load it" if not bypasses else "compiled now; inductor did not cache it")
            self.announce(f"decode step ready in {seconds:.1f} s ({how})")
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(f"{seconds:.1f} s\n")
        except OSError:
            pass  # a read-only cache: inductor compiles again next time too
        return out


def _traced_code() -> str:
    """The code dynamo traces (_DecodeModule and the helpers its forward calls) as syntax trees, without
    comments and docstrings: an edit to those alone changes no graph."""
    trees = []
    for obj in (_DecodeModule, _rms_norm, _rotate):
        tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and body and isinstance(body[0], ast.Expr) \
                    and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
        trees.append(ast.dump(tree))
    return "\n".join(trees)


def _model_signature(module: _DecodeModule) -> str:
    """What the compiled graph of `module` depends on besides torch and the CPU: the traced code, the
    weights' names, shapes and dtypes, each layer's sizes and norm epsilons, and the linear kernels chosen
    at load."""
    fused = module.fused
    weights = [(name, tuple(p.shape), str(p.dtype)) for name, p in module.params.items()]
    layers = [(layer.head_dim, layer.q_size, layer.kv_size, layer.inter, float(layer.eps1), float(layer.eps2),
               [getattr(layer, name).kernel for name in ("qkv", "o", "gate_up", "down")]) for layer in fused.layers]
    source = hashlib.sha256(_traced_code().encode()).hexdigest()
    return repr((source, weights, layers, float(fused.final_eps), fused.head.kernel))


def compiled_decode(fused) -> CompiledDecode:
    """The compiled decode step over `fused` (a FusedLlama): built on first use and kept on it, so every
    engine over the same model instance (the batched run, the detectors' reference and replay engines)
    runs the same graphs. Inductor compiles lazily, on the first call per new shape kind (one row, more
    rows: the row count is dynamic), or loads that kind's code from the on-disk cache (CompiledDecode)."""
    built = getattr(fused, "_compiled_decode", None)
    if built is None:
        built = CompiledDecode(fused)
        fused._compiled_decode = built
    return built


def decode_only(batch) -> bool:
    """Whether every chunk of the step's BatchTensors decodes one token (the compiled step's shape)."""
    return bool(batch.segments) and all(s.num_tokens == 1 for s in batch.segments)
