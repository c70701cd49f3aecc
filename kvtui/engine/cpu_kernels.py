"""kvtui's C++ kernels for the CPU, built with the machine's C++ compiler at first use.

Decode attention. At decode every row has one query per head and reads its own slot's keys 0 .. end-1.
torch's SDPA does this as one call over a span of slots with a mask (kvtui/engine/attention.py), reading each
row's masked tail too, and its kernel treats each query head alone. `decode_attention` reads each row's own
keys and values once for all the query heads of a grouped-query group, as vLLM's CPU paged-attention kernel
does, and nothing past the row's end: scores q.k * scale in float32, a softmax (exp by Cephes' degree-6
polynomial after range reduction, within 2 ulp of expf), the probabilities times V, and, for the
attention_flow detector, the probabilities summed over heads. Each row is computed alone in a fixed order, so a
row's output is the same bits whatever other rows share the step: batched and solo runs agree in attention.

Element-wise parts of a decoder layer (`rms_norm`, `add_rms_norm`, `silu_mul`, `rotate_`), float32: one call
where torch runs 3-6 small operators, each the same arithmetic in the same order as the torch code in
kvtui/engine/fused.py (products and sums rounded one by one: `-ffp-contract=off`); the norm's sum of squares
is summed in another order than torch's, and SiLU's exp is the polynomial above.

The source below is compiled once per machine (`c++ -O3 -march=native -shared`, about 1 s) into kvtui's cache
(`kernels/cpu-kernels-<digest of source, flags and CPU>.so`) and loaded with ctypes (which releases the GIL
during a call). Where no compiler is found or the build fails, `problem()` says why and every caller keeps its
torch code. Decode attention splits its rows over torch's OpenMP threads where the compiler has OpenMP (the
library then uses the libgomp torch loaded); the element-wise kernels run on the calling thread. Whether decode attention uses its kernel is chosen by measuring it
against SDPA on the machine at the process's thread count (`use_kernel`, stored in decode-attention.json in
kvtui's cache); `KVTUI_DECODE_ATTENTION=sdpa|kernel` forces either, and `KVTUI_ELEMENTWISE=torch` keeps the
element-wise parts on torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time

import torch

ENV = "KVTUI_DECODE_ATTENTION"
CHOICES = ("sdpa", "kernel")

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

#ifdef _OPENMP
#include <omp.h>
static inline int thread_id(void) { return omp_get_thread_num(); }
#else
static inline int thread_id(void) { return 0; }
#endif

static inline float exp_poly(float x) {  /* e^x (Cephes expf's polynomial), x clamped to [-87, 88] */
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float shifter = 12582912.0f;  /* 1.5 * 2^23: adding it rounds to an integer (no floorf: vectorizes) */
    float n = (x * 1.44269504088896341f + shifter) - shifter;
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return p * scale.f;
}

/* q: [rows] x [hq] x [d] at strides (q_row, q_head, 1); pools: [slot] x [hkv] x [pos] x [d] at strides
   (p_slot, p_head, d, 1); out: [rows, hq, d] contiguous; scratch_all: threads x scratch_stride floats, with
   scratch_stride >= hq / hkv * max_end; flow: NULL, or [rows] x [>= max_end] at row stride flow_row, which gets
   each row's probabilities summed over heads. Rows are split over `threads` OpenMP threads (each row on one
   thread, in the same order whatever the count, so the bits do not depend on it). */
int kvtui_decode_attention(const float *q, int64_t q_row, int64_t q_head,
                           const float *k_pool, const float *v_pool, int64_t p_slot, int64_t p_head,
                           const int64_t *slots, const int64_t *ends, int64_t rows, int64_t hq,
                           int64_t hkv, int64_t d, float scale, float *out, float *scratch_all,
                           int64_t scratch_stride, float *flow, int64_t flow_row, int64_t threads,
                           int64_t num_slots, int64_t max_len) {
    const int64_t g = hq / hkv;
    for (int64_t r = 0; r < rows; r++)  /* a row outside the pool: nothing computed, the caller raises */
        if (slots[r] < 0 || slots[r] >= num_slots || ends[r] < 1 || ends[r] > max_len) return (int)r + 1;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        float *scratch = scratch_all + thread_id() * scratch_stride;
        const int64_t n = ends[r];
        for (int64_t h = 0; h < hkv; h++) {
            const float *k = k_pool + slots[r] * p_slot + h * p_head;
            const float *v = v_pool + slots[r] * p_slot + h * p_head;
            const float *qs = q + r * q_row + h * g * q_head;
            float *o = out + (r * hq + h * g) * d;
            for (int64_t j = 0; j < n; j++) {
                const float *kj = k + j * d;
                for (int64_t i = 0; i < g; i++) {
                    const float *qi = qs + i * q_head;
                    float s = 0.0f;
                    #pragma omp simd reduction(+ : s)
                    for (int64_t c = 0; c < d; c++) s = fmaf(qi[c], kj[c], s);
                    scratch[i * n + j] = s * scale;
                }
            }
            for (int64_t i = 0; i < g; i++) {
                float *p = scratch + i * n;
                float m = p[0];
                for (int64_t j = 1; j < n; j++) m = p[j] > m ? p[j] : m;
                float sum = 0.0f;
                #pragma omp simd reduction(+ : sum)
                for (int64_t j = 0; j < n; j++) { p[j] = exp_poly(p[j] - m); sum += p[j]; }
                const float inv = 1.0f / sum;
                for (int64_t j = 0; j < n; j++) p[j] *= inv;
                if (flow) {  /* attention_flow: the probabilities summed over heads, added to flow[r, 0:n] */
                    float *f = flow + r * flow_row;
                    for (int64_t j = 0; j < n; j++) f[j] += p[j];
                }
                memset(o + i * d, 0, d * sizeof(float));
            }
            for (int64_t j = 0; j < n; j++) {
                const float *vj = v + j * d;
                for (int64_t i = 0; i < g; i++) {
                    const float w = scratch[i * n + j];
                    float *oi = o + i * d;
                    #pragma omp simd
                    for (int64_t c = 0; c < d; c++) oi[c] = fmaf(w, vj[c], oi[c]);
                }
            }
        }
    }
    return 0;
}

/* The element-wise parts of a decoder layer in float32, each the arithmetic of the torch code it replaces
   (kvtui/engine/fused.py) in the same order, products and sums rounded one by one (no contraction). */

static void norm_row(const float *x, const float *w, float eps, int64_t n, float *out) {
    float ss = 0.0f;
    #pragma omp simd reduction(+ : ss)
    for (int64_t c = 0; c < n; c++) ss += x[c] * x[c];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    #pragma omp simd
    for (int64_t c = 0; c < n; c++) out[c] = w[c] * (x[c] * inv);
}

/* out[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)); x, out: [rows, n] contiguous */
void kvtui_rms_norm(const float *x, const float *w, float eps, int64_t rows, int64_t n, float *out) {
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * n, w, eps, n, out + r * n);
}

/* hidden[r] += delta[r], then out[r] = rms_norm(hidden[r]); all [rows, n] contiguous */
void kvtui_add_rms_norm(float *hidden, const float *delta, const float *w, float eps, int64_t rows, int64_t n,
                        float *out) {
    for (int64_t r = 0; r < rows; r++) {
        float *h = hidden + r * n;
        const float *dl = delta + r * n;
        #pragma omp simd
        for (int64_t c = 0; c < n; c++) h[c] += dl[c];
        norm_row(h, w, eps, n, out + r * n);
    }
}

/* out[r, c] = silu(gate_up[r, c]) * gate_up[r, inter + c]; gate_up [rows, 2 inter], out [rows, inter] */
void kvtui_silu_mul(const float *gate_up, int64_t rows, int64_t inter, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *__restrict g = gate_up + r * 2 * inter, *__restrict u = g + inter;
        float *__restrict o = out + r * inter;
        #pragma omp simd
        for (int64_t c = 0; c < inter; c++) o[c] = (g[c] / (1.0f + exp_poly(-g[c]))) * u[c];
    }
}

/* Rotary in place: token t's heads 0 .. heads-1 at x + t * t_stride + h * d, each
   (x1, x2) -> (x1 cos1 + -(x2 sin1), x2 cos2 + x1 sin2) with cos, sin [tokens, d] contiguous */
void kvtui_rotate(float *x, int64_t tokens, int64_t t_stride, int64_t heads, int64_t d, const float *cos,
                  const float *sin) {
    const int64_t half = d / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * d, *s = sin + t * d;
        for (int64_t h = 0; h < heads; h++) {
            float *a = x + t * t_stride + h * d, *b = a + half;
            #pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float x1 = a[i], x2 = b[i];
                a[i] = x1 * c[i] + -(x2 * s[i]);
                b[i] = x2 * c[half + i] + x1 * s[half + i];
            }
        }
    }
}
"""

FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC")

_LOCK = threading.Lock()
_LIB: dict = {}  # "fn": the loaded function, or "problem": why there is none


def library_path():
    """Where the built kernel lives: kvtui's cache dir / kernels / cpu-kernels-<digest>.so, the digest over
    the source, the flags, this CPU's model and flags (kvtui.engine.linear.cpu_identity) and the compiler's path."""
    from kvtui.engine.linear import cpu_identity
    from kvtui.models.default import cache_dir

    model, flags = cpu_identity()
    parts = [SOURCE, " ".join(FLAGS), model, flags, compiler_path() or ""]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"cpu-kernels-{digest}.so"


def compiler_path() -> str | None:
    """The C++ compiler inductor would call and kvtui builds its kernels with (torch._inductor.config.cpp.cxx,
    found on PATH), or None."""
    from torch._inductor import config

    for name in config.cpp.cxx:
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build(path) -> None:
    """Compile SOURCE into `path` (atomically: a temporary file renamed). Raises RuntimeError with the
    compiler's first error line, or when no compiler is found."""
    cxx = compiler_path()
    if cxx is None:
        raise RuntimeError("no C++ compiler found")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, lib = os.path.join(tmp, "k.cpp"), os.path.join(tmp, "k.so")
        with open(src, "w") as f:
            f.write('extern "C" {\n' + SOURCE + "\n}\n")
        done = subprocess.run([cxx, *FLAGS, "-fopenmp", src, "-o", lib], capture_output=True, text=True)
        if done.returncode != 0:  # no OpenMP with this compiler: one thread per call
            done = subprocess.run([cxx, *FLAGS, src, "-o", lib], capture_output=True, text=True)
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines()
            raise RuntimeError(f"the compiler failed: {lines[0] if lines else done.returncode}")
        os.replace(lib, path)


_SIGNATURES = {  # the library's functions: (argument types), returning nothing but decode attention
    "kvtui_decode_attention": "p i i p p i i p p i i i i f p p i p i i i i",
    "kvtui_rms_norm": "p p f i i p",
    "kvtui_add_rms_norm": "p p p f i i p",
    "kvtui_silu_mul": "p i i p",
    "kvtui_rotate": "p i i i i p p",
}


def _load():
    """The library's ctypes functions by name, built on first use; None where they cannot be (the reason in
    _LIB["problem"])."""
    with _LOCK:
        if not _LIB:
            try:
                path = library_path()
                if not path.exists():
                    _build(path)
                lib = ctypes.CDLL(str(path))
                kinds = {"p": ctypes.c_void_p, "i": ctypes.c_int64, "f": ctypes.c_float}
                functions = {}
                for name, signature in _SIGNATURES.items():
                    fn = getattr(lib, name)
                    fn.argtypes, fn.restype = [kinds[k] for k in signature.split()], None
                    functions[name] = fn
                functions["kvtui_decode_attention"].restype = ctypes.c_int  # 0, or 1 + a bad row's index
                _LIB["fn"] = functions
            except (OSError, RuntimeError, AttributeError) as err:
                _LIB["problem"] = str(err)
        return _LIB.get("fn")


def problem() -> str | None:
    """Why the kernel cannot run in this process (no compiler, a failed build), or None when it can."""
    return None if _load() is not None else _LIB.get("problem")


def supports(query: torch.Tensor, pool_k: torch.Tensor) -> bool:
    """Whether decode_attention takes these tensors: float32 on the CPU, the head dimension contiguous, and
    the kernel built."""
    return (query.dtype == torch.float32 and pool_k.dtype == torch.float32 and query.device.type == "cpu"
            and query.stride(-1) == 1 and pool_k.stride(-1) == 1 and pool_k.stride(-2) == pool_k.shape[-1]
            and _load() is not None)


def _check_decode_inputs(query: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, slots: torch.Tensor,
                         ends: torch.Tensor, flow: torch.Tensor | None) -> None:
    """Raise ValueError where decode_attention's inputs are not the shapes, dtypes and layouts its C code reads."""
    rows, hq, one, d = query.shape
    hkv = pool_k.shape[1]
    _check(one == 1 and pool_v.shape == pool_k.shape and pool_v.stride() == pool_k.stride() and hq % hkv == 0
           and pool_k.shape[3] == d and supports(query, pool_k), "decode_attention: query [R, Hq, 1, D] and pools "
           "[S, Hkv, L, D] float32 with Hkv dividing Hq")
    _check(slots.dtype == ends.dtype == torch.int64 and slots.is_contiguous() and ends.is_contiguous()
           and slots.shape == ends.shape == (rows,), "decode_attention: slots and ends must be int64 [R], contiguous")
    _check(flow is None or (flow.dtype == torch.float32 and flow.dim() == 2 and flow.shape[0] == rows
                            and flow.stride(1) == 1 and flow.shape[1] >= int(ends.max())),
           "decode_attention: flow must be float32 [R, >= max(ends)], rows contiguous")


def decode_attention(query: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, slots: torch.Tensor,
                     ends: torch.Tensor, scaling: float, flow: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scaling) v for one query per row over its own slot's keys 0 .. end-1.

    Args:
        query: [R, Hq, 1, D] float32 (any strides with the last dimension contiguous).
        pool_k, pool_v: the layer's slot pool [S, Hkv, L, D] float32, the last two dimensions contiguous and
            both with the same strides; Hkv divides Hq (grouped-query heads share a K/V head).
        slots, ends: [R] int64 each (contiguous): row r reads pool[slots[r], :, 0:ends[r]]; 1 <= ends[r] <= L.
        scaling: the score scale.
        flow: None, or [R, K] float32 contiguous with K >= max(ends): each row's attention probabilities,
            summed over the Hq heads, are added to flow[r, 0:ends[r]] (the attention_flow detector's sums).
    Returns:
        [R, 1, Hq, D] float32, contiguous.
    Raises:
        RuntimeError: the kernel is not available here (check `supports` first).
        IndexError: a row's slot is outside the pool or its end outside 1 .. L (checked before any work).
        ValueError: shapes, dtypes or layouts other than the above.
    """
    functions = _load()
    if functions is None:
        raise RuntimeError(f"the decode-attention kernel is not available: {problem()}")
    fn = functions["kvtui_decode_attention"]
    rows, hq, _, d = query.shape
    _check_decode_inputs(query, pool_k, pool_v, slots, ends, flow)
    out = torch.empty((rows, 1, hq, d), dtype=torch.float32)
    longest = int(ends.max()) if rows else 0
    threads = min(torch.get_num_threads(), max(rows, 1))
    stride = (hq // pool_k.shape[1]) * max(longest, 1)
    scratch = torch.empty(threads * stride, dtype=torch.float32)
    bad = fn(query.data_ptr(), query.stride(0), query.stride(1), pool_k.data_ptr(), pool_v.data_ptr(),
             pool_k.stride(0), pool_k.stride(1), slots.data_ptr(), ends.data_ptr(), rows, hq, pool_k.shape[1], d,
             scaling, out.data_ptr(), scratch.data_ptr(), stride, None if flow is None else flow.data_ptr(),
             0 if flow is None else flow.stride(0), threads, pool_k.shape[0], pool_k.shape[2])
    if bad:
        raise IndexError(f"decode attention: row {bad - 1} reads slot {int(slots[bad - 1])} up to position "
                         f"{int(ends[bad - 1])}, outside the pool's {pool_k.shape[0]} slots of {pool_k.shape[2]}")
    return out


ELEMENTWISE = os.environ.get("KVTUI_ELEMENTWISE", "kernel") != "torch"  # "torch": the fused forward's torch code


def elementwise(x: torch.Tensor) -> bool:
    """Whether the fused forward runs its element-wise parts (norms, rotary, SiLU x up, residual adds) on this
    library for activations `x`: float32, on the CPU, contiguous, the library built, and $KVTUI_ELEMENTWISE not
    "torch"."""
    return ELEMENTWISE and x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous() and \
        _load() is not None


def _check(ok: bool, what: str) -> None:
    """ValueError(`what`) unless `ok`: the kernels read raw memory, so their wrappers check shapes first."""
    if not ok:
        raise ValueError(what)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm on x [..., n] float32 contiguous (weight [n] float32): a new tensor like x."""
    out = torch.empty_like(x)
    _check(weight.shape == x.shape[-1:] and weight.is_contiguous() and weight.dtype == torch.float32,
           "rms_norm: weight must be float32 [n], contiguous")
    _LIB["fn"]["kvtui_rms_norm"](x.data_ptr(), weight.data_ptr(), eps, x.numel() // x.shape[-1], x.shape[-1],
                                 out.data_ptr())
    return out


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """hidden += delta (in place), then rms_norm(hidden): both [..., n] float32 contiguous. Returns the norm."""
    out = torch.empty_like(hidden)
    delta = delta.contiguous()  # held until the call returns
    _check(delta.shape == hidden.shape and weight.shape == hidden.shape[-1:] and weight.is_contiguous(),
           "add_rms_norm: delta must match hidden and weight its last dimension")
    _LIB["fn"]["kvtui_add_rms_norm"](hidden.data_ptr(), delta.data_ptr(), weight.data_ptr(), eps,
                                     hidden.numel() // hidden.shape[-1], hidden.shape[-1], out.data_ptr())
    return out


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2 inter] float32 contiguous (gate first): [..., inter]."""
    _check(gate_up.shape[-1] == 2 * inter and gate_up.is_contiguous(), "silu_mul: gate_up must be [..., 2 inter], contiguous")
    out = gate_up.new_empty((*gate_up.shape[:-1], inter))
    _LIB["fn"]["kvtui_silu_mul"](gate_up.data_ptr(), gate_up.numel() // gate_up.shape[-1], inter, out.data_ptr())
    return out


def rotate_(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary embedding in place on the first `heads` heads of x [R, Q, width] float32 contiguous (head h at
    columns h * head_dim ..), with cos, sin [R, Q, 1, head_dim] float32 contiguous: transformers'
    apply_rotary_pos_emb, rounded as it rounds."""
    cos, sin = cos.contiguous(), sin.contiguous()  # held until the call returns
    tokens = x.shape[0] * x.shape[1]
    _check(x.is_contiguous() and heads * head_dim <= x.shape[2] and cos.numel() == sin.numel() == tokens * head_dim
           and cos.dtype == sin.dtype == torch.float32, "rotate_: cos and sin must be float32 [R, Q, 1, head_dim]")
    _LIB["fn"]["kvtui_rotate"](x.data_ptr(), tokens, x.shape[2], heads, head_dim, cos.data_ptr(), sin.data_ptr())


_CHOICE: dict = {}


def use_kernel(head_dim: int, kv_heads: int, query_heads: int, announce=None) -> bool:
    """Whether decode steps run this kernel instead of SDPA on this machine at the process's thread count:
    $KVTUI_DECODE_ATTENTION when set, else a choice stored in kvtui's decode-attention.json, else measured now (16 rows
    of 256 keys, both alternating, about 1 s) and stored. False where the kernel cannot run."""
    forced = os.environ.get(ENV)
    if forced:
        if forced not in CHOICES:
            raise ValueError(f"${ENV}={forced!r}: choose one of {', '.join(CHOICES)}")
        return forced == "kernel" and problem() is None
    if problem() is not None:
        return False
    key = (head_dim, kv_heads, query_heads, torch.get_num_threads())
    if key not in _CHOICE:
        _CHOICE[key] = _stored_or_measured(head_dim, kv_heads, query_heads, announce)
    return _CHOICE[key]


def _stored_or_measured(head_dim: int, kv_heads: int, query_heads: int, announce) -> bool:
    """The choice stored for this machine, shape and thread count in kvtui's cache (decode-attention.json),
    else measured now and stored (a read-only cache: measured again next time)."""
    from kvtui.engine.linear import _locked, _machine_key
    from kvtui.models.default import cache_dir

    path = cache_dir() / "decode-attention.json"
    name = f"{_machine_key()} {library_path().stem} d{head_dim} kv{kv_heads} q{query_heads}"  # a new build measures anew
    with _locked(path):
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError):
            stored = {}
        if isinstance(stored.get(name), dict) and "kernel" in stored[name]:
            return bool(stored[name]["kernel"])
        if announce is not None:
            announce(f"timing decode attention on this CPU, SDPA against kvtui's kernel (once per machine; "
                     f"the choice is stored in {path})")
        seconds = measure(head_dim, kv_heads, query_heads)
        stored[name] = {"kernel": seconds["kernel"] < seconds["sdpa"],
                        "ms": {k: round(v * 1e3, 4) for k, v in seconds.items()}}
        try:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(stored, indent=1))
            tmp.replace(path)
        except OSError:
            pass
        return stored[name]["kernel"]


def measure(head_dim: int, kv_heads: int, query_heads: int, rows: int = 16, keys: int = 256,
            repeats: int = 15) -> dict:
    """Seconds per call (median of `repeats`, alternating) of SDPA over a span of slots with a mask, as the
    engine's span path calls it, and of decode_attention, on random float32 data: {"sdpa": s, "kernel": s}."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    pool = torch.randn((2, rows, kv_heads, keys + 32, head_dim), generator=gen)
    q = torch.randn((rows, 1, query_heads, head_dim), generator=gen).transpose(1, 2)
    ends = torch.randint(keys // 2, keys + 1, (rows,), generator=gen)
    mask = (torch.arange(keys)[None, :] < ends[:, None])[:, None, None, :]
    slots = torch.arange(rows)
    calls = {"sdpa": lambda: F.scaled_dot_product_attention(q, pool[0, :, :, :keys], pool[1, :, :, :keys],
                                                            attn_mask=mask, enable_gqa=True),
             "kernel": lambda: decode_attention(q, pool[0], pool[1], slots, ends, head_dim ** -0.5)}
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def choose_for(model, dtype: torch.dtype, device: torch.device, announce=None, paged: bool = False) -> tuple[bool, str]:
    """Whether a runner of `model` with a KV pool of `dtype` on `device` (`paged`: a block pool) runs decode
    attention on this kernel, and a note saying which runs and why (the status line "decode attention: ...").
    An encoder-decoder's decoder heads are the ones measured (its self-attention is what decodes)."""
    cfg = getattr(model.config, "get_text_config", lambda: model.config)()
    heads = getattr(cfg, "decoder_attention_heads", None) or getattr(cfg, "num_attention_heads", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) if not getattr(cfg, "decoder_attention_heads", None) else heads
    head_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads else None)
    if paged:
        return False, "SDPA (paged KV: kvtui's kernel reads the slot pool)"
    if dtype != torch.float32 or device.type != "cpu":
        return False, f"SDPA (kvtui's kernel runs float32 on the CPU; this pool is {str(dtype)[6:]} on {device.type})"
    if not heads or not head_dim:
        return False, "SDPA (the model's config names no attention heads)"
    if problem() is not None:
        return False, f"SDPA (kvtui's kernel cannot run here: {problem()})"
    kv_heads = kv_heads or heads
    use = use_kernel(head_dim, kv_heads, heads, announce)
    why = f"forced by ${ENV}" if os.environ.get(ENV) else "measured faster here" if use else "SDPA measured faster here"
    return use, ("kvtui's C++ kernel" if use else "SDPA") + f" ({why})"
