"""`kvtui serve` at its edges: one client's bad request fails alone (out-of-vocabulary ids, a request
whose own step raises), hostile inputs get a 4xx JSON answer or a clean result and never a 500 or a
dead server, the body size limit, tokenizing off the event loop, and the API key."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from helpers import uncached_greedy

import kvtui.engine.output as engine_module  # the output side draws the tokens
from kvtui.models import load_model
from kvtui.serve.server import ServeOptions, ServeServer

CHEAP_DETECTORS = ("canary", "attention_flow", "slot_taint")
ERROR_KEYS = {"message", "type", "param", "code"}
V = 259  # tiny-llama's vocabulary: token ids 0 .. 258


def client(server: ServeServer, api_key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oracle_tiny():
    """tiny-llama built again: the same weights as the server's, a separate instance."""
    return load_model("tiny-llama", progress=False)


@pytest.fixture(scope="module")
def server():
    options = ServeOptions(model="tiny-llama", port=0, slots=4, max_len=2048, detectors=CHEAP_DETECTORS,
                           max_request_bytes=1_000_000)
    with ServeServer(options) as s:
        yield s


def assert_alive(s: ServeServer) -> None:
    """The server answers /health and still generates (the engine thread is alive)."""
    assert httpx.get(s.url + "/health", timeout=60).status_code == 200
    assert not s.engine_stopped
    answer = httpx.post(s.url + "/v1/completions", timeout=120,
                        json={"prompt": "ok", "max_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2


# -- one request fails alone ----------------------------------------------------------------------------
def test_an_out_of_vocabulary_prompt_beside_a_stream_gets_400_and_the_stream_its_solo_answer(tmp_path, oracle_tiny):
    """Before: `{"prompt": [1, 999999]}` got HTTP 200 "abort", killed the engine thread and aborted every
    other client's stream."""
    record = tmp_path / "serve.jsonl"
    options = ServeOptions(model="tiny-llama", port=0, slots=4, max_len=2048, detectors=(), record=record)
    with ServeServer(options) as s:
        c = client(s)
        stream = c.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=60, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        texts = [next(chunks).choices[0].text]  # the stream runs
        for bad in (-1, V, 999_999, 2**63):
            with pytest.raises(openai.BadRequestError) as caught:
                c.completions.create(model="tiny-llama", prompt=[1, bad, 2], max_tokens=4)
            error = caught.value.body
            assert (caught.value.status_code, error["code"], error["param"]) == (400, "out_of_vocabulary", "prompt")
            assert error["message"].startswith(f"Token id {bad} is out of vocabulary")
        texts += [ch.choices[0].text for ch in chunks]
        solo = uncached_greedy(oracle_tiny.model, oracle_tiny.tokenizer.encode("Once upon a time"), 60)
        assert "".join(texts) == oracle_tiny.tokenizer.decode(solo, skip_special_tokens=True)
        assert_alive(s)
    finishes = [json.loads(line) for line in record.read_text().splitlines() if '"request.finish"' in line]
    assert [(f["finish_reason"], f["code"]) for f in finishes if f["code"]] == [("rejected", "out_of_vocabulary")] * 4


def test_a_request_whose_own_sampling_raises_gets_an_error_and_its_neighbour_its_answer(server, oracle_tiny,
                                                                                        monkeypatch):
    """An exception in one request's sampling: 500 `internal_error` for it (whole), an error event then
    [DONE] when streamed (the openai client raises APIError), and the request beside it is unharmed."""
    real, draws = engine_module.draw_token, []

    def sample(logits, params, generator):  # greedy ignores top_k: top_k=13 marks the request to break
        if params.top_k == 13:
            draws.append(1)
            if len(draws) % 4 == 3:
                raise RuntimeError("injected sampling failure")
        return real(logits, params, generator)

    monkeypatch.setattr(engine_module, "draw_token", sample)
    c, tok = client(server), oracle_tiny.tokenizer
    answers = {}
    neighbour = threading.Thread(target=lambda: answers.setdefault("n", c.completions.create(
        model="tiny-llama", prompt="neighbour", max_tokens=40, temperature=0, extra_body={"ignore_eos": True})))
    neighbour.start()
    broken = {"model": "tiny-llama", "prompt": "breaks", "max_tokens": 20, "temperature": 0, "top_k": 13,
              "ignore_eos": True}
    whole = httpx.post(server.url + "/v1/completions", json=broken, timeout=120)
    assert whole.status_code == 500 and whole.json()["error"]["code"] == "internal_error"
    assert "injected sampling failure" in whole.json()["error"]["message"]
    streamed = c.completions.create(model="tiny-llama", prompt="breaks", max_tokens=20, temperature=0, stream=True,
                                    logprobs=0, extra_body={"top_k": 13, "ignore_eos": True})
    chunks = []
    with pytest.raises(openai.APIError, match="injected sampling failure"):
        for chunk in streamed:
            chunks.append(chunk)
    assert len(chunks) == 3  # one chunk per token (logprobs on) before its fourth draw failed
    neighbour.join(120)
    solo = uncached_greedy(oracle_tiny.model, tok.encode("neighbour"), 40)
    assert answers["n"].choices[0].text == tok.decode(solo, skip_special_tokens=True)
    monkeypatch.undo()
    assert_alive(server)


# -- hostile inputs -------------------------------------------------------------------------------------
CHAT = "chat/completions"
MSG = [{"role": "user", "content": "hi"}]
HOSTILE = [  # (name, path, body: a dict sent as JSON or raw bytes, status, error code or None)
    ("bad JSON", "completions", b'{"prompt": ', 400, None),
    ("not an object", "completions", b"[1, 2]", 400, None),
    ("a bare string", "completions", b'"x"', 400, None),
    ("invalid UTF-8", "completions", b'{"prompt": "x\xff\xfe"}', 400, None),
    ("deep nesting", "completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    ("missing prompt", "completions", {}, 400, None),
    ("missing messages", CHAT, {"model": "tiny-llama"}, 400, None),
    ("message without role", CHAT, {"messages": [{"content": "x"}]}, 400, None),
    ("prompt of wrong type", "completions", {"prompt": 5}, 400, None),
    ("messages of wrong type", CHAT, {"messages": "hi"}, 400, None),
    ("max_tokens of wrong type", "completions", {"prompt": "x", "max_tokens": [1]}, 400, None),
    ("huge n", "completions", {"prompt": "x", "n": 10**30}, 400, None),
    ("negative n", "completions", {"prompt": "x", "n": -1}, 400, None),
    ("huge max_tokens", "completions", {"prompt": "x", "max_tokens": 10**30}, 400, "context_length_exceeded"),
    ("negative max_tokens", "completions", {"prompt": "x", "max_tokens": -5}, 400, None),
    ("zero max_tokens", CHAT, {"messages": MSG, "max_tokens": 0}, 400, None),
    ("temperature 1e308", "completions", {"prompt": "x", "temperature": 1e308}, 400, None),
    ("temperature 2.5", CHAT, {"messages": MSG, "temperature": 2.5}, 400, None),
    ("temperature Infinity", "completions", b'{"prompt": "x", "temperature": Infinity}', 400, None),
    ("temperature NaN", "completions", b'{"prompt": "x", "temperature": NaN}', 400, None),
    ("temperature -1", "completions", {"prompt": "x", "temperature": -1}, 400, None),
    ("top_p 0", "completions", {"prompt": "x", "top_p": 0}, 400, None),
    ("top_p 1.5", "completions", {"prompt": "x", "top_p": 1.5}, 400, None),
    ("top_p NaN", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "top_p": NaN}', 400, None),
    ("top_k -2", "completions", {"prompt": "x", "top_k": -2}, 400, None),
    ("logprobs 21", "completions", {"prompt": "x", "logprobs": 21}, 400, None),
    ("logprobs -1", "completions", {"prompt": "x", "logprobs": -1}, 400, None),
    ("token id -1", "completions", {"prompt": [1, -1]}, 400, "out_of_vocabulary"),
    ("token id = vocab size", "completions", {"prompt": [V]}, 400, "out_of_vocabulary"),
    ("token id 999999", "completions", {"prompt": [1, 999999]}, 400, "out_of_vocabulary"),
    ("token id 2**63", "completions", {"prompt": [2**63]}, 400, "out_of_vocabulary"),
    ("token id 2**100", "completions", {"prompt": [[2**100, 1]]}, 400, "out_of_vocabulary"),
    ("token id 1.5", "completions", {"prompt": [1.5]}, 400, None),
    ("mixed token list", "completions", {"prompt": ["a", 1]}, 400, None),
    ("two token lists", "completions", {"prompt": [[1], [2]]}, 200, None),  # two prompts, two choices
    ("triple nesting", "completions", {"prompt": [[[1]]]}, 400, None),
    ("empty token list", "completions", {"prompt": [[]]}, 400, None),
    ("empty prompt list", "completions", {"prompt": []}, 400, None),
    ("empty prompt text", "completions", {"prompt": ""}, 400, None),
    ("lone surrogate in prompt", "completions", b'{"prompt": "a\\ud800b"}', 400, "invalid_unicode"),
    ("lone surrogate in model", "completions", b'{"prompt": "x", "model": "\\udfff"}', 400, "invalid_unicode"),
    ("lone surrogate in stop", "completions", b'{"prompt": "x", "stop": ["\\ud800"]}', 400, "invalid_unicode"),
    ("lone surrogate in a message", CHAT, b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', 400,
     "invalid_unicode"),
    ("lone surrogate in a key", "completions", b'{"prompt": "x", "\\ud800": 1}', 400, "invalid_unicode"),
    ("unknown model", "completions", {"prompt": "x", "model": "gpt-4"}, 404, 404),
    ("image content", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "model_not_supported"),
    ("prompt past max_len", "completions", {"prompt": "x" * 3000}, 400, "context_length_exceeded"),
    ("body past the limit", "completions", {"prompt": "x" * 1_100_000}, 413, "request_too_large"),
    # accepted, with a clean answer
    ("a surrogate pair", "completions", b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2}', 200, None),
    ("one nested token list", "completions", {"prompt": [[1, 2]], "max_tokens": 2}, 200, None),
    ("top_k past the vocabulary", "completions", {"prompt": "x", "max_tokens": 2, "top_k": 10**30}, 200, None),
    ("huge seed", "completions", {"prompt": "x", "max_tokens": 2, "seed": 10**30}, 200, None),
    ("negative seed", "completions", {"prompt": "x", "max_tokens": 2, "seed": -7}, 200, None),
    ("temperature 2", CHAT, {"messages": MSG, "max_tokens": 2, "temperature": 2}, 200, None),
    ("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "x"}], "max_tokens": 2}, 200, None),
    ("unknown field", "completions", {"prompt": "x", "max_tokens": 2, "frobnicate": {"a": [1]}}, 200, None),
    ("a long stop string", "completions", {"prompt": "x", "max_tokens": 2, "stop": "s" * 10_000}, 200, None),
]


@pytest.mark.parametrize("name, path, body, status, code", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_inputs_get_a_4xx_json_or_a_clean_answer_and_the_server_stays_up(server, name, path, body, status,
                                                                                 code):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    response = httpx.post(f"{server.url}/v1/{path}", timeout=120, **kwargs)
    assert response.status_code == status, response.text[:300]
    if status >= 400:
        error = response.json()["error"]
        assert set(error) == ERROR_KEYS and error["message"] and error["code"] == code
    else:
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert httpx.get(server.url + "/health", timeout=60).status_code == 200 and not server.engine_stopped


def test_hostile_inputs_leave_the_engine_serving(server):
    assert_alive(server)


# -- body size and the event loop -----------------------------------------------------------------------
def test_a_body_past_max_request_bytes_gets_413_declared_or_chunked(server):
    big = json.dumps({"prompt": "x" * 1_000_001}).encode()
    declared = httpx.post(server.url + "/v1/completions", content=big, headers={"content-type": "application/json"})
    chunked = httpx.post(server.url + "/v1/completions", content=iter([big[i:i + 65536] for i in range(0, len(big),
                                                                                                   65536)]),
                         headers={"content-type": "application/json"})
    assert "content-length" not in chunked.request.headers and chunked.request.headers["transfer-encoding"] == "chunked"
    for response in (declared, chunked):
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"
        assert "1000000 bytes" in response.json()["error"]["message"]
    small = httpx.post(server.url + "/v1/completions", content=iter([b'{"prompt": "ab",', b' "max_tokens": 3}']),
                       headers={"content-type": "application/json"})
    assert small.status_code == 200 and small.json()["usage"] == {"prompt_tokens": 2, "completion_tokens": 3,
                                                                  "total_tokens": 5}


def test_tokenizing_runs_off_the_event_loop(server, monkeypatch):
    """While one prompt is being tokenized (held here until /health answered), the server answers
    /health and streams other clients' tokens. Before, tokenizing ran on the event loop: a 10 MB prompt
    blocked every client, /health too, for 13 s."""
    import kvtui.serve.app as app_module

    real, entered, release = app_module.encode_text, threading.Event(), threading.Event()

    def slow_encode(tokenizer, text):
        if text.startswith("slow"):
            entered.set()
            assert release.wait(60)
        return real(tokenizer, text)

    monkeypatch.setattr(app_module, "encode_text", slow_encode)
    answers = []
    held = threading.Thread(target=lambda: answers.append(httpx.post(
        server.url + "/v1/completions", timeout=120, json={"prompt": "slow prompt", "max_tokens": 2})))
    held.start()
    try:
        assert entered.wait(60)
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        with httpx.stream("POST", server.url + "/v1/completions", timeout=10,
                          json={"prompt": "fast", "max_tokens": 3, "stream": True, "ignore_eos": True}) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
    finally:
        release.set()
        held.join(60)
    assert answers[0].status_code == 200 and answers[0].json()["usage"]["completion_tokens"] == 2


# -- API key --------------------------------------------------------------------------------------------
def test_an_api_key_guards_v1_and_leaves_health_and_metrics_open():
    options = ServeOptions(model="tiny-llama", port=0, max_len=256, detectors=(), api_key="s3cret")
    with ServeServer(options) as s:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"},
                        {"authorization": "Basic s3cret"}):
            response = httpx.get(s.url + "/v1/models", headers=headers)
            assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
            assert response.json()["error"]["code"] == "invalid_api_key"
        refused = httpx.post(s.url + "/v1/completions", json={"prompt": "x" * 10}, headers={"authorization": "Bearer"})
        assert refused.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            client(s, "wrong").models.list()
        answer = client(s, "s3cret").completions.create(model="tiny-llama", prompt="hi", max_tokens=3,
                                                        extra_body={"ignore_eos": True})
        assert answer.usage.completion_tokens == 3
        assert httpx.get(s.url + "/health").status_code == 200
        assert httpx.get(s.url + "/metrics").status_code == 200
