"""Every body `kvtui serve` sends is JSON and every error OpenAI's shape (kvtui/serve/jsonsafe.py): a model that
computes NaN gets its logprobs request a JSON 500 `non_finite_output` (whole) or an error event then `[DONE]`
(streamed), never Starlette's plain-text 500 nor a bare `NaN`; an exception no handler expected is that request's
JSON 500 on a connection that stays open; a logprob of -inf is vLLM's -9999.0. Checked with the official `openai`
client and with a raw HTTP/1.1 connection kept alive across requests."""

from __future__ import annotations

import http.client
import json
import math

import openai
import pytest

from kvtui.serve.server import ServeOptions, ServeServer

NAN_TOKEN = 7


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity (Python's json takes them; JSON does not)."""
    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def nan_server():
    """tiny-llama (a separate instance) whose lm_head row of token 7 is NaN: every logit row holds a NaN,
    so log_softmax (the logprobs) is NaN throughout, whatever the batch."""
    from kvtui.models import load_model

    loaded = load_model("tiny-llama", progress=False)
    loaded.model.lm_head.weight.data[NAN_TOKEN] = math.nan
    with ServeServer(ServeOptions(model="tiny-llama", port=0, detectors=()), load=lambda options: loaded) as server:
        yield server


def connection(server: ServeServer) -> http.client.HTTPConnection:
    host, port = server.url.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=120)


def post(conn: http.client.HTTPConnection, path: str, body: dict) -> tuple[int, str, str]:
    """(status, content type, body text) of one request on the kept-alive connection `conn`; a connection the
    server closed raises here (http.client.RemoteDisconnected)."""
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, response.getheader("content-type"), response.read().decode()


NON_FINITE = {"error": {"message": "the response would hold NaN at choices.0.logprobs.token_logprobs.0, which JSON "
                                   "cannot carry: the model computed a non-finite number for this request (its "
                                   "weights or an adapter's hold or produce NaN or infinity)",
                        "type": "server_error", "param": None, "code": "non_finite_output"}}


def test_nan_logprobs_are_a_json_500_whole_and_an_error_event_streamed(nan_server):
    """They were a plain-text 500 ("Out of range float values are not JSON compliant") and, streamed, a bare
    NaN in a data line. The connection stays open: the next request on it is answered."""
    conn = connection(nan_server)
    body = {"prompt": [5, 6, 8], "max_tokens": 3, "logprobs": 2, "temperature": 0}
    status, kind, text = post(conn, "/v1/completions", body)
    assert (status, kind, strict_json(text)) == (500, "application/json", NON_FINITE)
    status, kind, text = post(conn, "/v1/completions", {**body, "stream": True})
    assert status == 200 and kind.startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert events[-1] == "[DONE]" and [strict_json(e) for e in events[:-1]] == [NON_FINITE]
    status, _, text = post(conn, "/v1/completions", {"prompt": [5, 6, 8], "max_tokens": 3, "temperature": 0})
    assert status == 200 and strict_json(text)["usage"]["completion_tokens"] == 3  # no float to carry: answered


def test_the_openai_client_reads_the_json_errors(nan_server):
    client = openai.OpenAI(base_url=nan_server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError) as caught:
        client.completions.create(model="tiny-llama", prompt=[5, 6, 8], max_tokens=3, logprobs=2, temperature=0)
    assert caught.value.status_code == 500 and caught.value.body["code"] == "non_finite_output"
    with pytest.raises(openai.APIError) as caught:
        for _ in client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3, logprobs=True, top_logprobs=2, stream=True):
            pass
    assert caught.value.body["code"] == "non_finite_output"
    assert "choices.0.logprobs.content.0.logprob" in caught.value.body["message"]
    answer = client.completions.create(model="tiny-llama", prompt=[5, 6, 8], max_tokens=2, temperature=0)
    assert answer.usage.completion_tokens == 2


def test_an_unexpected_exception_is_a_json_500_and_the_connection_stays_open(nan_server, monkeypatch):
    """Anything a handler did not turn into an ApiError was Starlette's plain-text 500, a traceback, and (once
    the response was out) a reset connection."""
    import kvtui.serve.app as app

    def broken(*args):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(app, "_encode_prompts", broken)
    conn = connection(nan_server)
    status, kind, text = post(conn, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert (status, kind) == (500, "application/json")
    assert strict_json(text) == {"error": {"message": "internal error (ZeroDivisionError: division by zero); this "
                                                      "request alone failed, the server goes on",
                                           "type": "server_error", "param": None, "code": "internal_error"}}
    monkeypatch.undo()
    status, _, text = post(conn, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert status == 200 and strict_json(text)["usage"]["completion_tokens"] == 2


def test_a_logprob_of_minus_infinity_is_vllms_minus_9999():
    """A token of probability 0: vLLM writes max(logprob, -9999.0); JSON has no -Infinity."""
    from kvtui.models.tiny import build_tiny_tokenizer
    from kvtui.serve.jsonsafe import dumps
    from kvtui.serve.responses import Formatter

    entry = ((5, -math.inf), (6, -0.5), (5, -math.inf))
    for chat in (False, True):
        formatter = Formatter(chat=chat, request_id="x", model="m", tokenizer=build_tiny_tokenizer(), top_k=2)
        logprobs = strict_json(dumps(formatter.logprobs([entry])))
        if chat:
            assert [e["logprob"] for e in [logprobs["content"][0], *logprobs["content"][0]["top_logprobs"]]] == \
                [-9999.0, -0.5, -9999.0]
        else:
            assert logprobs["token_logprobs"] == [-9999.0] and sorted(logprobs["top_logprobs"][0].values()) == \
                [-9999.0, -0.5]
