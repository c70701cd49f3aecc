"""llama-server with per-request LoRA adapters (llama.cpp #26207), against the vendored build.

kvtui's built-in adapters lora-a and lora-b for SmolLM2 (peft folders, seeds 1 and 2), converted by llama.cpp's
own convert_lora_to_gguf.py (installed beside llama-server by scripts/build-llama-server.sh), loaded with
`--lora A --lora B --lora-init-without-apply` on one slot (`-np 1`); one server for the module.

- The server logic, by its own counts (`timings.prompt_n`, the prompt tokens it evaluated): a request naming
  another adapter's scales after an adapter request evaluates its whole prompt again (the slot's cache is
  cleared on a change of `lora`); a request without `lora` (the base model) after an adapter request on the
  same prompt evaluates one token: it runs on the adapter's KV (#26207; `tools/server/server-context.cpp`
  `launch_slot_with_task` resets the slot's adapters without clearing its prompt when the request names
  none). `cache_prompt: false` (the workaround) evaluates it whole.
- `kvtui conformance --check adapters` fails on it, naming the base request that took the adapter's
  cached prompt.

Skipped where llama-server, its converter or the default model is missing.
"""

from __future__ import annotations

import httpx
import pytest

from kvtui.conformance import CHECKS, Server
from kvtui.conformance.adapters import prompt

pytestmark = [pytest.mark.llama_server, pytest.mark.smollm]


@pytest.fixture(scope="module")
def server():
    from kvtui.models import ModelLoadError, default_model_path
    from kvtui.models.lora import default_adapter_gguf
    from kvtui.remote.llama_server import LlamaServer, find_llama_server

    if find_llama_server() is None:
        pytest.skip("llama-server not built: run scripts/build-llama-server.sh")
    try:
        gguf = default_model_path()
        adapters = [default_adapter_gguf(name) for name in ("lora-a", "lora-b")]
    except ModelLoadError as exc:
        pytest.skip(str(exc))
    args = ["--lora", str(adapters[0]), "--lora", str(adapters[1]), "--lora-init-without-apply"]
    with LlamaServer(gguf, parallel=1, ctx_per_slot=1024, threads=1, startup_timeout_s=300, extra_args=args) as srv:
        yield srv


@pytest.fixture(scope="module")
def tokenizer():
    from kvtui.models import load_tokenizer

    return load_tokenizer("default")


A = [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.0}]
B = [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}]


def ask(client: httpx.Client, text: str, lora: list | None, **extra) -> tuple[str, int, int]:
    """(answer, timings.prompt_n, timings.cache_n) of a greedy 8-token chat request under `lora` (None: no field)."""
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0.0, **extra}
    if lora is not None:
        body["lora"] = lora
    data = client.post("/v1/chat/completions", json=body, headers={"Connection": "close"}).json()
    return data["choices"][0]["message"]["content"], data["timings"]["prompt_n"], data["timings"]["cache_n"]


def test_a_base_request_after_an_adapter_request_runs_on_the_adapters_cached_prompt(server, tokenizer):
    with httpx.Client(base_url=server.url, timeout=300) as client:
        assert [a["id"] for a in client.get("/lora-adapters").json()] == [0, 1]
        one, two, three = (prompt(n, tokenizer) for n in (11, 12, 13))
        _, evaluated, _ = ask(client, one, A)
        assert evaluated > 200  # a new prompt: evaluated whole
        _, again, cached = ask(client, one, B)  # another adapter named: the slot's prompt is cleared
        assert (again, cached) == (evaluated, 0)
        ask(client, two, A)
        _, base, cached = ask(client, two, None)  # no lora: the base model, on lora-a's KV
        assert base == 1 and cached > 200
        ask(client, three, A)
        _, workaround, cached = ask(client, three, None, cache_prompt=False)
        assert workaround > 200 and cached == 0


def test_the_adapters_check_fails_naming_the_base_request_that_took_the_adapters_prompt(server, tokenizer):
    check = Server(url=server.url, model="default", tokenizer=tokenizer, server_kind="llama.cpp", timeout_s=300,
                   quick=True)
    result = CHECKS["adapters"].run(check)
    assert result.verdict == "fail", result
    assert result.sent.startswith("base and 2 adapters (by the body's `lora` scales)")
    assert result.evidence.startswith("P1 #2 base after lora0: the server took ")
    assert "on base's first sending of the prompt, which only lora0 had sent: their KV" in result.evidence
    assert "#1 lora0 first: cached 0 of " in result.figures and "#3 lora1 after base: cached 0 of " in result.figures
    assert result.figures.endswith("no reload (the server lists no adapter folders)")
