"""`kvtui conformance --target` against real servers, marked and grouped as the other tests of that server.

- vLLM CPU 0.32 shares the session's server (tests/remote/conftest.py vllm_url, the "vllm" xdist group): the whole
  quick command, every class; every applicable check passes, images is n/a (SmolLM2 takes none). About 90 s.
- transformers serve 5.24.0, pinned (scripts/install-transformers-serve.sh's venv, as
  tests/remote/test_transformers_serve.py; the request-ids failure is that release's, 5.25.0 passes the class): a
  server of this module's own (the request-id check leaves it dead), the "transformers_serve" xdist group:
  the whole quick command; it refuses cache_salt, prompt_embeds and response_format, gives one choice for
  n > 1: each of those classes is n/a with the server's answer; the prompt cache passes (judged by the
  canary alone); the request ids fail (duplicate ids kill its batching worker). About 60 s with its start.
- llama-server: the whole quick command (a server of the test's own): tenant salts fail (no cache_salt), the
  rest pass or are n/a (prompt embeddings, images). About 80 s with its start.

docs/conformance.md has the whole tables. Skipped, with the reason, where a server is not installed.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

KVTUI = [sys.executable, "-m", "kvtui.cli"]


@pytest.mark.llama_server
@pytest.mark.smollm
def test_llama_server_shares_its_prompt_cache_across_salts_and_keeps_the_rest_apart(tmp_path):
    """The whole quick command: llama.cpp has no cache_salt (tenant salts fail on its own cached-token
    counts), takes n and json_schema and keeps each apart, refuses prompt embeddings and images."""
    from kvtui.models import default_model_path
    from kvtui.remote.llama_server import LlamaServer, find_llama_server

    if find_llama_server() is None:
        pytest.skip("llama-server not built: run scripts/build-llama-server.sh")
    with LlamaServer(default_model_path(), parallel=4, ctx_per_slot=512, threads=1) as srv:
        out, found = conformance(srv.url, tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    server = found.pop("server")
    assert (server["name"], server["version"], server["server_header"]) == ("llama.cpp", "b0-0c1e57098", "llama.cpp")
    assert {name: c["verdict"] for name, c in found.items()} == {
        "tenant_salts": "fail", "solo_parity": "pass", "parallel_sampling": "pass", "structured_output": "pass",
        "prompt_embeds": "n/a", "images": "n/a", "prompt_cache": "pass", "recurrent_state": "pass", "adapters": "n/a", "request_ids": "pass"}
    assert "with different cache_salts 6 of 6 matching probes read" in found["tenant_salts"]["evidence"]
    # llama.cpp prefills a cached prompt's last token alone, which rounds otherwise than the whole prompt (token-
    # equal answers moved up to 0.79 nats, past the 0.5 tolerance): the control finds that, so logprob moves
    # are not judged and only tokens and the canary count
    assert "a cached prompt is not computed exactly (control moved" in found["prompt_cache"]["figures"]
    assert found["parallel_sampling"]["figures"] == "3 of 3 choices equal their seeded run; 3 distinct choices"
    assert "key 'prompt' not found" in found["prompt_embeds"]["evidence"]


def conformance(url: str, tmp_path, *more: str) -> tuple[subprocess.CompletedProcess, dict]:
    """`kvtui conformance --quick --target URL --json FILE [MORE]`: the finished command and its results by check
    (and the server it identified under "server")."""
    path = tmp_path / "conformance.json"
    out = subprocess.run(KVTUI + ["conformance", "--quick", "--target", url, "--json", str(path), *more],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode in (0, 1), out.stdout + out.stderr  # 2 and 3: bad input, server unreachable
    data = json.loads(path.read_text())
    return out, {c["check"]: c for c in data["checks"]} | {"server": data["server"]}


@pytest.mark.vllm
@pytest.mark.smollm
@pytest.mark.xdist_group("vllm")
def test_vllm_passes_every_applicable_check(vllm_url, tmp_path):
    out, found = conformance(vllm_url, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert found.pop("server") == {"name": "vLLM", "version": "0.32.0", "server_header": "uvicorn",
                                   "source": "name: /v1/models owned_by; version: GET /version"}
    assert {name: c["verdict"] for name, c in found.items()} == {
        "tenant_salts": "pass", "solo_parity": "pass", "parallel_sampling": "pass", "structured_output": "pass",
        "prompt_embeds": "pass", "images": "n/a", "prompt_cache": "pass", "recurrent_state": "pass", "adapters": "n/a", "request_ids": "pass"}
    salts = found["tenant_salts"]["figures"]  # judged on vLLM's own cached-token counts
    assert "different salts: 0/6 probes hit" in salts and "same salt (control): 6/6 probes hit" in salts
    assert found["solo_parity"]["figures"].startswith("6 of 6 answered; 6 compared with their solo run, 0 solo runs "
                                                      "served from cache")
    assert found["parallel_sampling"]["figures"] == "3 of 3 choices equal their seeded run; 3 distinct choices"
    assert found["prompt_embeds"]["figures"] == ("4 of 4 answered, 4 said their own passphrase; 4 compared with "
                                                 "their solo run")
    assert found["images"]["evidence"] == ("the server takes no images: HTTP 400: SmolLM2-135M-Instruct is not a "
                                           "multimodal model")
    assert "0 answers to the wrong client; 0 hung; 0 lost" in found["request_ids"]["figures"]
    cache = found["prompt_cache"]["figures"]  # each conversation sent again finds its blocks in vLLM's cache
    assert cache.startswith("12 of 12 answered;") and "8 lone ones compared with their solo run" in cache


@pytest.fixture(scope="module")
def transformers_url(tmp_path_factory):
    """transformers serve 5.24.0 (the pinned release) for this module alone (the request-id check kills its
    batching worker)."""
    from helpers import transformers_serve

    for srv in transformers_serve(tmp_path_factory):
        yield srv.url


@pytest.mark.transformers_serve
@pytest.mark.smollm
@pytest.mark.xdist_group("transformers_serve")
def test_transformers_serve_lacks_most_features_and_dies_on_duplicate_request_ids(transformers_url, tmp_path):
    """Pinned 5.24.0: every row is that release's answer; on 5.25.0 the request-ids row passes (its batching
    is keyed by ids of the server's own)."""
    out, found = conformance(transformers_url, tmp_path, "--server-release", "transformers-serve 5.24.0")
    assert out.returncode == 1, out.stdout + out.stderr
    server = found.pop("server")  # it says neither its name nor its release: the pinned install's
    assert (server["name"], server["version"]) == ("transformers-serve", "5.24.0")
    assert {name: c["verdict"] for name, c in found.items()} == {
        "tenant_salts": "n/a", "solo_parity": "n/a", "parallel_sampling": "n/a", "structured_output": "n/a",
        "prompt_embeds": "n/a", "images": "n/a", "prompt_cache": "pass", "recurrent_state": "n/a", "adapters": "n/a", "request_ids": "fail"}
    salt = "the server refuses cache_salt: HTTP 422: {'detail': \"Unexpected fields in the request: {'cache_salt'}\"}"
    assert found["tenant_salts"]["evidence"].startswith(salt)
    assert found["solo_parity"]["evidence"].startswith(salt)
    assert found["recurrent_state"]["evidence"].startswith(salt)
    assert found["parallel_sampling"]["evidence"] == "asked for n=3, the server gave 1 choice"
    assert found["structured_output"]["evidence"].startswith("the server does not keep to response_format "
                                                             "json_schema: 'The passphrase is AMBER-FALCON-37")
    assert "Unexpected fields in the request: {'prompt_embeds'}" in found["prompt_embeds"]["evidence"]
    assert found["images"]["evidence"].startswith("the server ignores the picture: each of the 2 pictures got the "
                                                  "same solo answer")  # HTTP 200, the picture dropped
    assert found["prompt_cache"]["figures"].startswith("12 of 12 answered;")  # 4 lone, the same 4 again, 2 pairs
    assert "judged by the canary alone" in found["prompt_cache"]["figures"]
    ids = found["request_ids"]["figures"]
    assert "then the server stopped serving other clients" in ids and "CB worker is dead" in ids
    assert ids.endswith('GET /health 503 {"status":"unhealthy","reason":"cb_worker_dead"}')
