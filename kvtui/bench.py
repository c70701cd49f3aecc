"""`kvtui bench`: throughput of serial solo runs vs kvtui padded vs kvtui packed vs one left-padded
transformers `model.generate`, on the same prompts, greedy, every request forced to new_tokens.

Figures are generated tokens / wall seconds of the whole phase (prefill included), measured once
on this machine; they vary with the CPU, so the JSON also records torch threads and versions.
"""

from __future__ import annotations

import json
import platform
import random
import time
from pathlib import Path

import torch
import transformers
from rich.console import Console
from rich.table import Table

from kvtui.config import EngineConfig
from kvtui.engine import Engine, SamplingParams


def make_prompts(tokenizer, num_requests: int, seed: int, min_len: int = 20, max_len: int = 200) -> list[list[int]]:
    """`num_requests` prompts of uniform random length in [min_len, max_len] tokens, ids drawn from
    the non-special vocabulary, deterministic in `seed`."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(min(len(tokenizer), 40000)) if i not in special]
    return [[rng.choice(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_requests)]


def _engine_run(model, prompts, new_tokens: int, *, layout: str, slots: int, max_batch: int) -> tuple[float, list]:
    max_len = max(len(p) for p in prompts) + new_tokens + 1
    engine = Engine(model, EngineConfig(num_slots=slots, max_len=max_len, max_batch_size=max_batch,
                                        max_tokens_per_step=max(4096, sum(map(len, prompts))), layout=layout))
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    states = [engine.submit(f"r{i}", p, params) for i, p in enumerate(prompts)]
    engine.run_until_done()
    return time.perf_counter() - t0, [s.generated_ids for s in states]


def _solo_runs(model, prompts, new_tokens):
    total, outputs = 0.0, []
    for p in prompts:
        seconds, out = _engine_run(model, [p], new_tokens, layout="padded", slots=1, max_batch=1)
        total += seconds
        outputs += out
    return total, outputs


@torch.inference_mode()
def _hf_generate(model, tokenizer, prompts, new_tokens):
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = transformers.GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                           eos_token_id=None, pad_token_id=pad)
    model.set_attn_implementation("sdpa")  # transformers' own fastest CPU path, not kvtui's attention
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    return time.perf_counter() - t0, out[:, width:].tolist()


def run_bench(loaded, *, output: Path, num_requests: int = 16, new_tokens: int = 32, seed: int = 0,
              console: Console | None = None) -> dict:
    """Run the four phases, print a table, write JSON to `output`; returns the figures."""
    console = console or Console()
    model, tokenizer = loaded.model, loaded.tokenizer
    prompts = make_prompts(tokenizer, num_requests, seed)
    generated = num_requests * new_tokens
    phases = {}
    with console.status("solo runs, one after another") as status:
        phases["solo (kvtui, batch 1, serial)"] = _solo_runs(model, prompts, new_tokens)
        status.update("kvtui padded")
        phases["kvtui padded"] = _engine_run(model, prompts, new_tokens, layout="padded", slots=num_requests,
                                             max_batch=num_requests)
        status.update("kvtui packed")
        phases["kvtui packed"] = _engine_run(model, prompts, new_tokens, layout="packed", slots=num_requests,
                                             max_batch=num_requests)
        status.update("transformers generate (left-padded)")
        phases["transformers generate, left-padded"] = _hf_generate(model, tokenizer, prompts, new_tokens)
    solo_outputs = phases["solo (kvtui, batch 1, serial)"][1]
    table = Table(title=f"{loaded.model_id}: {num_requests} requests, prompts {min(map(len, prompts))}-"
                        f"{max(map(len, prompts))} tokens, {new_tokens} new tokens, greedy, "
                        f"{torch.get_num_threads()} torch threads", title_justify="left")
    for column in ("phase", "seconds", "tokens/s", "x solo", "outputs equal to solo"):
        table.add_column(column, justify="left" if column == "phase" else "right")
    base = generated / phases["solo (kvtui, batch 1, serial)"][0]
    results = []
    for name, (seconds, outputs) in phases.items():
        rate = generated / seconds
        same = sum(a == b for a, b in zip(outputs, solo_outputs))
        results.append({"phase": name, "seconds": seconds, "tokens_per_s": rate, "speedup_vs_solo": rate / base,
                        "outputs_equal_to_solo": same})
        table.add_row(name, f"{seconds:.2f}", f"{rate:.1f}", f"{rate / base:.2f}", f"{same}/{num_requests}")
    console.print(table)
    figures = {"model": loaded.model_id, "num_requests": num_requests, "new_tokens": new_tokens, "seed": seed,
               "prompt_lengths": [len(p) for p in prompts], "torch": torch.__version__,
               "transformers": transformers.__version__, "torch_threads": torch.get_num_threads(),
               "machine": platform.machine(), "results": results}
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(figures, indent=2))
    console.print(f"figures written to {output}")
    return figures


def detector_cost(loaded, *, output: Path, batch: int = 8, new_tokens: int = 32, seed: int = 0, repeats: int = 3,
                  console: Console | None = None) -> dict:
    """Decode tokens/s of the engine (summed step wall time of decode-only steps) with each in-engine
    detector switched on vs off, batch `batch`. The reference and canary detectors run outside the
    engine's steps (reference: solo runs after a request finishes; canary: text matching), so their
    step cost is measured as 0 by construction; their own time is reported separately."""
    console = console or Console()
    prompts = make_prompts(loaded.tokenizer, batch, seed, 40, 60)
    configs = {"off": (False, False), "attention_flow": (True, False), "slot_taint": (False, True),
               "both": (True, True)}
    rates: dict[str, float] = {}
    for name, (flow, taint) in list(configs.items()) * repeats:
        engine = Engine(loaded.model, EngineConfig(num_slots=batch, max_len=128, max_batch_size=batch))
        engine.measure_flow, engine.detect_taint = flow, taint
        for i, p in enumerate(prompts):
            engine.submit(f"r{i}", p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
        decode_s = decode_tokens = 0
        for report in engine.run_until_done():
            if report.prefill_tokens == 0 and report.decode_tokens:
                decode_s += report.wall_s
                decode_tokens += report.decode_tokens
        rates[name] = max(rates.get(name, 0.0), decode_tokens / decode_s)  # best of `repeats`
    from kvtui.detect.reference import ReferenceDetector

    ref = ReferenceDetector(loaded, loaded.tokenizer)
    ReferenceDetector._cache.clear()
    t0 = time.perf_counter()
    for p in prompts:
        ref.solo(p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    reference_s = time.perf_counter() - t0
    table = Table(title=f"detector cost, {loaded.model_id}, batch {batch}, {new_tokens} decode steps",
                  title_justify="left")
    for column in ("detectors in the step", "decode tokens/s", "vs off"):
        table.add_column(column)
    for name, rate in rates.items():
        table.add_row(name, f"{rate:.1f}", f"{rate / rates['off'] - 1:+.1%}")
    table.caption = (f"reference: {reference_s:.1f} s of solo runs for {batch} requests, done after they finish "
                     f"(off the step path: step cost 0)")
    console.print(table)
    figures = {"model": loaded.model_id, "batch": batch, "decode_tokens_per_s": rates,
               "reference_solo_seconds": reference_s}
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(figures, indent=2))
    return figures
