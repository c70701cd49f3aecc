"""`kvtui serve --model tiny-qwen35moe`: the hybrid (gated-delta layers beside attention) behind the OpenAI API.

- Served with paged KV, prefix caching and the offload tier, the official `openai` client's chat completion,
  streamed and not, is transformers' own greedy `generate` on a separate instance of the seeded model; the
  second sending of a prompt takes its prefix from the cache (a state checkpoint restored) and is the same.
- A fault that does not act on the model is refused in one line before any weights load: a non-state fault on
  the hybrid, a recurrent-state fault on an attention-only model; a model given by path is refused once loaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import torch

from kvtui.models.hybrid import build_hybrid
from kvtui.scenario.prompts import chat_ids
from kvtui.serve.server import ServeOptions, ServeServer

ROOT = Path(__file__).resolve().parents[2]
NEW_TOKENS = 8
MESSAGES = [{"role": "system", "content": "You are a careful assistant who answers in one short line, always."},
            {"role": "user", "content": "Name three harbours on the northern coast and the boats they keep."}]


@pytest.fixture(scope="module")
def served():
    """A kvtui serve on the hybrid (paged KV, 16-token blocks, prefix caching, a 64-block offload tier, one
    thread), started once for the module."""
    options = ServeOptions(model="tiny-qwen35moe", port=0, kv="paged", block_size=16, prefix_caching=True,
                           kv_offload_blocks=64, max_len=256, detectors=(), threads=1)
    with ServeServer(options) as server:
        yield server


def test_the_openai_client_gets_transformers_greedy_answer_streamed_and_not(served):
    oracle, tokenizer = build_hybrid()
    ids = chat_ids(tokenizer, MESSAGES)
    out = oracle.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=tokenizer.pad_token_id or 0)
    expected = tokenizer.decode(out[0, len(ids):].tolist())
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    assert model == "tiny-qwen35moe"
    kwargs = dict(model=model, messages=MESSAGES, max_tokens=NEW_TOKENS, temperature=0.0,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].message.content == expected
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == NEW_TOKENS
    assert whole.usage.prompt_tokens_details.cached_tokens == 0  # the first sending: nothing cached yet
    text, usage = "", None
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    assert text == expected
    # the second sending restored the state checkpoint kept with its last full block
    assert usage.prompt_tokens_details.cached_tokens == len(ids) // 16 * 16 > 0


def check(model: str, fault: str) -> str:
    """The one line ServeServer.check() refuses `fault` on `model` with (no weights read)."""
    with pytest.raises(ValueError) as info:
        ServeServer(ServeOptions(model=model, port=0, kv="paged", prefix_caching=True, kv_offload_blocks=8,
                                 faults=(fault,))).check()
    return str(info.value)


def test_a_fault_that_does_not_act_on_the_model_is_refused_before_loading():
    assert check("tiny-qwen35moe", "cow_missing") == (
        "--fault cow_missing does not act on hybrid models like tiny-qwen35moe; it acts on attention-only decoder "
        "models (`kvtui faults` lists them)")
    assert check("default", "state_slot_not_reset") == (
        "--fault state_slot_not_reset does not act on decoder-only models like default; it acts on hybrid models "
        "(`kvtui faults` lists them)")


def test_the_command_refuses_a_non_state_fault_on_the_hybrid_in_one_line():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "kvtui.cli", "serve", "--model", "tiny-qwen35moe", "--port", "0",
                        "--fault", "prefix_key_no_parent", "--kv", "paged", "--prefix-caching"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: --fault prefix_key_no_parent does not act on hybrid models like tiny-qwen35moe; it acts on "
        "attention-only decoder or encoder-decoder models (`kvtui faults` lists them)"]


def test_default_detectors_name_a_state_leak_on_the_hybrid():
    """`kvtui serve` on the hybrid with its default detectors and `--fault state_slot_not_reset` (one state
    slot, so the second request reuses the first's, unreset): state_provenance names the leak in /metrics."""
    import re

    import httpx

    options = ServeOptions(model="tiny-qwen35moe", port=0, kv="paged", block_size=16, max_len=256, slots=1,
                           faults=("state_slot_not_reset",), threads=1)
    with ServeServer(options) as server:
        for word in ("harbours", "lighthouses"):
            r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
                "model": "tiny-qwen35moe", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": f"Name three {word} on the northern coast."}]})
            assert r.status_code == 200, r.text
        text = httpx.get(server.url + "/metrics", timeout=30).text
    found = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'kvtui:contamination_events_total\{[^}]*detector="(\w+)"[^}]*\} ([\d.]+)', text)}
    assert found.get("state_provenance", 0) >= 1, found
