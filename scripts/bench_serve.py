"""Throughput and TTFT of OpenAI-compatible servers on one workload: N concurrent greedy chat requests
(passphrase prompts), streamed, each timed from send to first content chunk (TTFT) and to its end.

    python scripts/bench_serve.py --url http://127.0.0.1:8000          # one running server
    python scripts/bench_serve.py --compare                            # kvtui serve vs llama-server

--compare starts, one after another on 127.0.0.1, `kvtui serve` (SmolLM2, one torch thread, slots and
batch = N) and llama.cpp's llama-server (same GGUF, --threads 1) with -np 4 and -np N, runs the
workload once to warm up and once measured on each, and prints a table. Output tokens/s = completion
tokens of all requests / wall time from the first send to the last finish.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
REPEAT = 3
sys.path.insert(0, str(ROOT))


def prompts(n: int, seed: int = 0) -> list[str]:
    from kvtui.scenario.prompts import DEFAULT_TEMPLATE, passphrases

    phrases = passphrases(random.Random(seed))
    return [DEFAULT_TEMPLATE.replace("{passphrase}", next(phrases)) for _ in range(n)]


async def one(client: httpx.AsyncClient, url: str, text: str, max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0, ttft, tokens, chunks, out = time.perf_counter(), None, None, 0, []
    async with client.stream("POST", url + "/v1/chat/completions", json=body,
                             headers={"Connection": "close"}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
            for choice in data.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    chunks += 1
                    out.append(content)
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
    return {"ttft_s": ttft, "e2e_s": time.perf_counter() - t0, "tokens": tokens if tokens is not None else chunks,
            "text": "".join(out), "start": t0, "end": time.perf_counter()}


async def workload(url: str, n: int, max_tokens: int, seed: int = 0) -> dict:
    """Send n requests at once (passphrases drawn with `seed`); returns the figures."""
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=n + 4)) as client:
        results = await asyncio.gather(*(one(client, url, p, max_tokens) for p in prompts(n, seed)))
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    ttfts = sorted(r["ttft_s"] for r in results if r["ttft_s"] is not None)
    tokens = sum(r["tokens"] for r in results)
    echoed = sum(bool(re.search(r"[A-Z]+-[A-Z]+-\d\d", r["text"])) for r in results)
    return {"requests": n, "output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall,
            "ttft_p50_s": pct(ttfts, 50), "ttft_p95_s": pct(ttfts, 95), "passphrase_echoed": echoed}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    rank = (len(values) - 1) * q / 100
    low, high = int(rank), min(int(rank) + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (rank - low)


def measure(url: str, n: int, max_tokens: int, repeat: int = REPEAT) -> dict:
    """One warm-up, then `repeat` measured runs on other passphrases each (a prefix cache may reuse the
    shared chat-template prefix, never a whole prompt); returns the run of median wall time."""
    asyncio.run(workload(url, n, max_tokens, seed=1000))
    runs = sorted((asyncio.run(workload(url, n, max_tokens, seed=i)) for i in range(repeat)), key=lambda r: r["wall_s"])
    return {**runs[len(runs) // 2], "wall_s_all": [round(r["wall_s"], 2) for r in runs]}


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server not healthy in time")


def kvtui_serve(n: int, max_tokens: int, port: int, detectors: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "kvtui.cli", "serve", "--port", str(port), "--threads", "1", "--slots", str(n),
           "--max-batch-size", str(n), "--detectors", detectors]
    process = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process)
        return measure(url, n, max_tokens)
    finally:
        process.terminate()
        process.wait(60)


def llama_server(n: int, max_tokens: int, parallel: int) -> dict:
    from kvtui.models import default_model_path
    from kvtui.remote.llama_server import LlamaServer

    with LlamaServer(default_model_path(), parallel=parallel, threads=1, ctx_per_slot=512) as server:
        return measure(server.url, n, max_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (no /v1)")
    parser.add_argument("--compare", action="store_true", help="kvtui serve vs llama-server -np 4 and -np N")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--output", type=Path, help="also write the figures here (JSON)")
    args = parser.parse_args()
    n, m = args.requests, args.max_tokens
    if args.url:
        rows = {args.url: measure(args.url, n, m)}
    elif args.compare:
        rows = {f"kvtui serve (slots {n}, detectors none)": kvtui_serve(n, m, args.port, "none"),
                f"kvtui serve (slots {n}, default detectors)": kvtui_serve(
                    n, m, args.port, "reference,canary,attention_flow,slot_taint"),
                "llama-server -np 4": llama_server(n, m, 4), f"llama-server -np {n}": llama_server(n, m, n)}
    else:
        parser.error("give --url or --compare")
    print(f"{n} concurrent chat requests, max_tokens {m}, greedy; one CPU thread per server; median of {REPEAT}")
    print(f"{'server':44} {'tokens':>6} {'wall s':>7} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p95':>9} {'echoed':>6}")
    for name, r in rows.items():
        print(f"{name:44} {r['output_tokens']:>6} {r['wall_s']:>7.2f} {r['output_tokens_per_s']:>7.1f} "
              f"{r['ttft_p50_s']:>8.3f}s {r['ttft_p95_s']:>8.3f}s {r['passphrase_echoed']:>3}/{r['requests']}")
    if args.output:
        args.output.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
