"""The reference detector's numeric tolerance, measured on the machine that runs the checks.

In bfloat16 or float16 a request run in a batch and the same request run alone differ by rounding:
the batch changes how the kernels split and order their sums (matrix tiles, padded or packed rows,
chunked prefill, paged blocks), so every logit moves a little. How much depends on the CPU's kernels
(an Intel CPU with AMX and an AMD EPYC with avx512_bf16 round differently), the model, the dtype, the
torch version and its threads; a constant tuned on one machine labels another machine's rounding as
contamination, or a fault's damage as rounding.

`measure` runs a fixed set of prompts alone (sampled at temperature 1 with fixed seeds, so each keeps
a Draw of every token), then batched in a few compositions (COMPOSITIONS: padded, left-padded with
chunked prefill, paged and packed with chunked prefill), teacher-forced on each prompt's solo tokens
(Engine.submit's `forced`), so every position is compared on the same context. At each position it
takes the spread of the logits the two Draws list (the 8 most likely and those ranked near the draw:
max minus min over tokens of batched minus solo logit, compare_draws' figure) and the change of the
top-2 gap. While that took under BUDGET_S it runs further rounds with other seeds (other tokens,
other positions), at most MAX_ROUNDS: the largest move is a rare event (on tiny-llama in bfloat16 most
positions move by exactly 0; one round of 96 positions found 0.125, four rounds 0.22). The largest
over all positions, times SAFETY, floored at the float32 tolerance, is the tolerance (logits). It is stored per (model, dtype, CPU model name, torch version, torch threads)
beside the step-cost calibration and read by every later run (`kvtui calibrate --numeric` measures
it anew).

Why SAFETY = 2: the detector compares a run batched one way with a reference batched another way (the
clean engine computes up to 8 references together); each lies within the measured spread of the solo
run, so the two lie within twice it. Measured on SmolLM2-135M in bfloat16 on a 2-core AMD EPYC
(avx512_bf16, no AMX), torch 2.13, 1 thread (docs/faults.md): this measurement's largest spread was
0.5 logits over its 96 positions; 12 prompts x 16 tokens in 6 compositions (1,152 positions) gave 0.5
as well, against the solo runs and between any two compositions, so the largest does not grow with the
sample there. float32's largest spread there is 9.2e-5, far below its 1e-3.

Cost: a round is about 80 engine steps, most of one row. On tiny-llama 4 rounds in 8 s; on SmolLM2 in
bfloat16 on that machine, loaded by other work, one round: 71 s on transformers' modules and 383 s on
kvtui's fused forward (whose input-major bfloat16 matrix multiplies are about 20x slower there than
transformers' layout). Made once per machine and stored.
"""

from __future__ import annotations

import json
import math
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvtui.config import EngineConfig
from kvtui.engine import Engine, SamplingParams
from kvtui.model_kinds import ModelKind, model_kind

SAFETY = 2.0
BUDGET_S = 10.0  # seconds: further rounds (other seeds) while the measurement took less
MAX_ROUNDS = 4
FLOAT32 = 1e-3  # logits: float32's batched-vs-solo spread is under 1e-4 (9.2e-5 on SmolLM2, AMD EPYC)
BUILT_IN = {torch.float32: FLOAT32, torch.float64: 1e-6, torch.float16: 0.1, torch.bfloat16: 0.5}
CALIBRATED_DTYPES = (torch.bfloat16, torch.float16)

PROMPTS = (
    "Q: What is the capital of France?\nA:",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "In 1905 Albert Einstein published four papers that changed physics. The first",
    "Dear customer, thank you for your order #4512. Unfortunately the item you asked for is out of stock, "
    "and we expect new",
)
NEW_TOKENS = 8
# batched compositions, each teacher-forced on the solo tokens: EngineConfig fields
COMPOSITIONS = {
    "padded, batch 4": dict(num_slots=4, max_batch_size=4, layout="padded"),
    "padded left, batch 2, chunked prefill": dict(num_slots=2, max_batch_size=2, layout="padded",
                                                  padding_side="left", max_tokens_per_step=8),
    "paged packed, batch 4, chunked prefill": dict(num_slots=4, max_batch_size=4, layout="packed", kv="paged",
                                                   block_size=16, max_tokens_per_step=16),
}


@dataclass(frozen=True)
class Tolerance:
    """The logit tolerance of numeric labelling and where it came from.

    Attributes:
        value: logits; a divergence whose top-2 gap (greedy) or logit spread (sampled) is within it is
            numeric (kvtui/detect/reference.py).
        source: "calibrated" (a stored measurement of this machine), "measured" (measured when the run
            loaded, and stored), or "built-in" (float32's constant, or a last resort when no
            measurement could be made: a constant that was tuned on one CPU).
        described: the recording header's reference_tolerance: value, source, file, CPU, torch, threads,
            the largest spread measured, the safety factor, why built-in.
    """

    value: float
    source: str
    described: dict = field(default_factory=dict)


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo's "model name"), else platform.processor() or the machine."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_key(loaded) -> dict:
    """What a measurement holds for: model, dtype, CPU, torch version, torch threads."""
    return {"model": loaded.model_id, "dtype": str(loaded.dtype).replace("torch.", ""), "cpu": cpu_name(),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def measure(loaded, *, prompts=PROMPTS, new_tokens: int = NEW_TOKENS, compositions=None,
            safety: float = SAFETY, budget_s: float = BUDGET_S, progress=None) -> dict:
    """Measure the batched-against-solo logit spread of `loaded` on this machine (see the module docstring):
    one round of the prompts alone and in each composition, then more rounds with other seeds (other
    solo tokens, other positions) while the time spent is under `budget_s`, at most MAX_ROUNDS (a
    largest value is a rare event: on tiny-llama most positions move by 0). `progress`, a callable
    taking one line, hears each round.

    Returns the record `store` writes: machine_key fields, `tolerance` (logits: max(largest x safety,
    FLOAT32)), `largest` (logits: the largest spread or top-2 gap change seen), `safety`, `positions`
    compared, `rounds`, `by_composition` (each composition's largest), `seconds`, `created`.
    Raises ValueError for a model whose decoder needs more than token ids (an encoder-decoder)."""
    if model_kind(loaded.model.config) is ModelKind.ENCODER_DECODER:
        raise ValueError("an encoder-decoder model needs audio to run; no numeric calibration for it")
    started = time.perf_counter()
    vocab = loaded.model.get_input_embeddings().num_embeddings
    ids = [[t % vocab for t in loaded.tokenizer.encode(p)] or [1] for p in prompts]
    compositions = compositions or COMPOSITIONS
    by, positions, rounds = dict.fromkeys(compositions, 0.0), 0, 0
    while rounds < MAX_ROUNDS and (rounds == 0 or time.perf_counter() - started < budget_s):
        if progress is not None:
            progress(f"round {rounds + 1}: {len(ids)} prompts x {new_tokens} tokens alone, then batched "
                     f"{len(compositions)} ways")
        seeds = range(rounds * len(ids), (rounds + 1) * len(ids))
        for name, moves in _round(loaded, ids, new_tokens, compositions, seeds).items():
            by[name], positions = max([by[name], *moves]), positions + len(moves)
        rounds += 1
    largest = max(by.values(), default=0.0)
    return {**machine_key(loaded), "tolerance": max(largest * safety, FLOAT32), "largest": largest,
            "safety": safety, "positions": positions, "rounds": rounds, "by_composition": by,
            "seconds": round(time.perf_counter() - started, 2), "created": time.strftime("%Y-%m-%d %H:%M")}


def _round(loaded, ids: list[list[int]], new_tokens: int, compositions: dict, seeds) -> dict[str, list[float]]:
    """Each composition's per-position moves (position_moves) against the prompts run alone with `seeds`."""
    params = [SamplingParams(temperature=1.0, seed=seed, max_new_tokens=new_tokens, ignore_eos=True)
              for seed in seeds]
    max_len = max(map(len, ids)) + new_tokens + 1
    solo = [_run(loaded, dict(num_slots=1, max_batch_size=1), max_len, [(p, s, None)])[0]
            for p, s in zip(ids, params)]
    out = {}
    for name, overrides in compositions.items():
        runs = _run(loaded, overrides, max_len, [(p, s, tuple(r.generated_ids)) for p, s, r in zip(ids, params, solo)])
        out[name] = [move for a, b in zip(runs, solo) for move in position_moves(a, b)]
    return out


def position_moves(batched, solo) -> list[float]:
    """Per position of two runs of one request (RequestStates with draws and top2_gaps): the larger of the
    spread of the logits both Draws list (max minus min of batched minus solo, tokens masked in both
    left out) and the change of the top-2 gap, logits. A position with a non-finite move is skipped
    (not rounding: nothing here masks or overflows)."""
    moves = []
    for b, s, gb, gs in zip(batched.draws, solo.draws, batched.top2_gaps, solo.top2_gaps):
        move = max(logit_spread(b.logit_of(), s.logit_of()), abs(gb - gs))
        if math.isfinite(move):
            moves.append(move)
    return moves


def logit_spread(ours: dict[int, float], theirs: dict[int, float], above=(), below=()) -> float:
    """How far two runs' logits of the same tokens moved relative to each other: max minus min of
    (ours - theirs) over the tokens both list (token id -> logit; logits; 0 for one token or none). A
    token non-finite in both (masked by the same deterministic stage: grammar, min_tokens, bad_words; a
    Draw keeps NaN for it) is left out; one finite in one run only gives inf. `above` / `below`: moves
    known only as bounds (a token one run does not list moved by at least / at most this much): the
    spread is then the smallest these allow."""
    moves = [z - theirs[t] for t, z in ours.items() if t in theirs and (math.isfinite(z) or math.isfinite(theirs[t]))]
    if not all(map(math.isfinite, [*moves, *above, *below])) or (not moves and (above or below)):
        return math.inf
    return max([*moves, *above]) - min([*moves, *below]) if moves else 0.0


def _run(loaded, overrides: dict, max_len: int, items) -> list:
    """Run (prompt ids, sampling, forced tokens or None) items together in a fresh engine with `overrides`;
    their RequestStates."""
    config = EngineConfig(**{"max_len": max_len, "max_tokens_per_step": 1024, **overrides})
    engine = Engine.from_loaded(loaded, config, eos_token_ids=(), tokenizer=None, image_encoder=None)
    states = [engine.submit(f"n{i}", p, s, forced=f) for i, (p, s, f) in enumerate(items)]
    engine.run_until_done()
    return states


def numeric_calibration_path(key: dict) -> Path:
    """Where the tolerance measured for `key` (machine_key's model, dtype, CPU model name, torch version,
    torch threads) lives: beside the step-cost fits of kvtui/calibrate.py (calibration_path), under
    the cache directory's calibration/."""
    from kvtui.models import cache_dir

    name = f"{key['model']}-{key['dtype']}-{key['cpu']}-torch{key['torch']}-{key['threads']}t"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return cache_dir() / "calibration" / f"numeric-{safe}.json"


def store(record: dict) -> str:
    """Write a measurement (from `measure`) where `load` finds it; returns the file's path."""
    path = numeric_calibration_path(record)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(record, indent=2))
    partial.replace(path)  # whole or not at all: two runs measuring at once never leave half a file
    return str(path)


def load(loaded) -> tuple[dict, str] | None:
    """The stored measurement for `loaded` on this machine and its file, or None."""
    path = numeric_calibration_path(machine_key(loaded))
    try:
        record = json.loads(path.read_text())
        float(record["tolerance"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record, str(path)


_MEASURED: dict = {}  # machine_key values -> Tolerance measured in this process (it measures once if it cannot store)


def reference_tolerance(loaded, *, progress=None) -> Tolerance:
    """The tolerance the reference detector labels with for `loaded` on this machine.

    float32 / float64: the built-in constant (rounding there is far below it). bfloat16 / float16: the
    stored calibration; else measured now (`progress`, a callable taking one line, hears about it; see
    the module docstring for its cost) and stored (kept in this process when the cache directory is not
    writable); else, when it cannot be measured (an encoder-decoder model) the built-in constant, a
    last resort tuned on one CPU.
    """
    dtype = loaded.dtype
    if dtype not in CALIBRATED_DTYPES:
        return _built_in(dtype, "float32 rounding is far below it")
    found = load(loaded)
    if found is not None:
        return _from(found[0], "calibrated", found[1])
    key = tuple(machine_key(loaded).values())
    if key in _MEASURED:
        return _MEASURED[key]
    if progress is not None:
        progress(f"measuring {str(dtype).replace('torch.', '')} batch rounding on this CPU for the reference "
                 "detector (once; `kvtui calibrate --numeric` redoes it)")
    try:
        record = measure(loaded)
    except ValueError as e:
        return _built_in(dtype, str(e))
    try:
        path = store(record)
    except OSError:
        path = None
    _MEASURED[key] = found = _from(record, "measured", path)
    return found


def _from(record: dict, source: str, path: str | None) -> Tolerance:
    keep = ("model", "dtype", "cpu", "torch", "threads", "largest", "safety", "positions", "rounds", "created")
    return Tolerance(float(record["tolerance"]), source, {"tolerance": float(record["tolerance"]), "source": source,
                                                         "file": path, **{k: record.get(k) for k in keep}})


def _built_in(dtype: torch.dtype, why: str) -> Tolerance:
    value = BUILT_IN.get(dtype, 0.5)
    return Tolerance(value, "built-in", {"tolerance": value, "source": "built-in", "why": why})
