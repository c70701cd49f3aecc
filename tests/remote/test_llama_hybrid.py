"""llama.cpp's host-RAM prompt cache on a hybrid model (gated-delta recurrent layers beside attention).

A public llama.cpp report says the prompt cache restores another conversation's state on hybrid models.
No hybrid weights ship in any package, so kvtui makes one (kvtui/models/hybrid.py: a random-weight
Qwen3.5-MoE with SmolLM2's tokenizer, in kvtui's cache) and converts it with llama.cpp's own converter
from the vendored sources (installed by scripts/build-llama-server.sh).

- The GGUF is what llama.cpp expects (architecture `qwen35moe`, pre-tokenizer `smollm`) and the vendored
  llama-server's greedy tokens equal transformers' `generate` on the Hugging Face copy, token for token.
- `kvtui run scenarios/llama_hybrid_prompt_cache.yaml --model tiny-qwen35moe --llama-server '-np 2 ...'`
  (multi-turn conversations, cancellations, each answer against its solo run on a cache-off control):
  what the runs here found is pinned: no answer differs from its solo run, with the cache restoring
  recurrent-state checkpoints and host-RAM prompts all along (the server's trace log counts them), and
  `--cache-reuse` switched off by the server itself for this model.

Skipped when llama-server, its converter or the default model (whose tokenizer the hybrid has) is missing.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvtui.events import Contamination, Finish
from kvtui.record import read_recording

pytestmark = [pytest.mark.llama_server, pytest.mark.xdist_group("llama_hybrid")]
KVTUI = [sys.executable, "-m", "kvtui.cli"]
SCENARIO = Path(__file__).parents[2] / "scenarios" / "llama_hybrid_prompt_cache.yaml"
REQUESTS, CANCELLED = 8 + 8 * 2 + 6 * 4, 8 + 6  # the scenario's rounds: one request cut in each concurrent round
THREADS = "-t 1 -tb 1"


@pytest.fixture(scope="module")
def gguf() -> Path:
    from kvtui.models import ModelLoadError
    from kvtui.models.hybrid import hybrid_gguf
    from kvtui.remote.llama_server import find_llama_server

    if find_llama_server() is None:
        pytest.skip("llama-server not built: run scripts/build-llama-server.sh")
    try:
        return hybrid_gguf()  # built and converted once, then cached
    except ModelLoadError as exc:
        pytest.skip(str(exc))


def test_the_converter_writes_a_qwen35moe_gguf_with_smollm2s_tokenizer(gguf, monkeypatch):
    from kvtui.models.hybrid import converter_dir

    monkeypatch.syspath_prepend(str(converter_dir() / "gguf-py"))
    import gguf as gguf_py

    reader = gguf_py.GGUFReader(str(gguf))

    def text(key: str) -> str:
        field = reader.fields[key]
        return bytes(field.parts[field.data[0]]).decode()

    assert (text("general.architecture"), text("tokenizer.ggml.pre"), text("tokenizer.ggml.model")) == (
        "qwen35moe", "smollm", "gpt2")
    assert len(reader.tensors) == 76 and {t.tensor_type.name for t in reader.tensors} == {"F32"}


def test_llama_server_greedy_tokens_equal_transformers_generate(gguf):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvtui.remote.llama_server import LlamaServer

    folder = gguf.parent
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    texts = ["The passphrase is BISCUIT-DRAGON-67. Reply with only the passphrase.", "Hello, how are you?",
             "Read the notes below, then answer. Breakfast is served from seven to ten. " * 3, "x"]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for t in texts]
    ours, theirs = [], []
    with LlamaServer(gguf, parallel=1, threads=1, ctx_per_slot=1024, startup_timeout_s=300) as server:
        for ids in prompts:
            body = {"prompt": ids, "n_predict": 16, "temperature": 0, "cache_prompt": False, "return_tokens": True}
            ours.append(httpx.post(f"{server.url}/completion", json=body, timeout=120).json()["tokens"])
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
            theirs.append(out[0, len(ids):].tolist())
    assert [len(t) for t in theirs] == [16] * 4
    assert ours == theirs  # measured: all 4 x 16 tokens equal (float32 GGUF, f16 KV cache)
    assert len({tuple(t) for t in theirs}) == 4  # the answers depend on the prompt (the decay change)


def test_kvtui_run_llama_server_finds_no_answer_changed_by_the_prompt_cache(gguf, tmp_path):
    """The user's one command, `-np 2`, default prompt-cache flags: every completed answer equals its solo
    run on the cache-off control, while the server took most prompt tokens from its cache."""
    record = tmp_path / "run.jsonl"
    out = subprocess.run(KVTUI + ["run", str(SCENARIO), "--model", "tiny-qwen35moe", "--llama-server",
                                  f"-np 2 {THREADS}", "--headless", "--record", str(record), "--timeout", "300"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "and its control (-np 1 --cache-ram 0)" in out.stderr
    _, events, summary, truncated = read_recording(record)
    assert not truncated and summary is not None
    finishes = [e for e in events if isinstance(e, Finish)]
    assert len(finishes) == REQUESTS and summary.finish_reasons == {"length": REQUESTS - CANCELLED,
                                                                    "abort": CANCELLED}
    assert summary.reference_checked == REQUESTS - CANCELLED and summary.contamination_total() == 0
    assert [e for e in events if isinstance(e, Contamination)] == []
    # measured 3,816 of 5,808 prompt tokens from the cache (checkpoint restores of each conversation)
    assert summary.prompt_tokens_cached >= 3000


def test_np4_with_cache_reuse_restores_recurrent_state_and_every_answer_holds(gguf):
    """`-np 4 --cache-reuse 16` in-process with the trace log (-lv 4): the server restored recurrent-state
    checkpoints and host-RAM prompts for the conversations' next turns, cut cancelled streams, and every
    completed answer still equals its solo run. It turns --cache-reuse off for this model at startup."""
    from kvtui.models import load_tokenizer
    from kvtui.remote.llama_server import LlamaServerPair
    from kvtui.remote.session import TargetOptions, TargetSession
    from kvtui.scenario import load_scenario

    events = []
    with LlamaServerPair(gguf, f"-np 4 --cache-reuse 16 {THREADS} -lv 4") as pair:
        session = TargetSession(load_scenario(SCENARIO), load_tokenizer("default"),
                                TargetOptions(url=pair.server.url, reference_url=pair.control.url, timeout_s=300),
                                listeners=(events.append,))
        summary = session.run()
        log = pair.server.log_text()
    assert "cache_reuse is not supported by this context, it will be disabled" in log
    restored = len(re.findall(r"restored context checkpoint", log))
    loads = [float(x) for x in re.findall(r"found better prompt with f_keep = ([0-9.]+)", log)]
    # measured 32 restores and 32 RAM loads (f_keep 0.88-0.99: each the conversation's own earlier turn)
    assert restored >= 20 and len(loads) >= 20
    assert summary.finish_reasons == {"length": REQUESTS - CANCELLED, "abort": CANCELLED}
    assert session.reference_checked == REQUESTS - CANCELLED
    assert [e for e in events if isinstance(e, Contamination)] == []
