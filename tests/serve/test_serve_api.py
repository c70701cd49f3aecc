"""`kvtui serve`'s API where it follows vLLM's OpenAI server, checked with the official `openai` client and
plain HTTP against tiny-llama: a list of prompts (one choice per prompt and sequence, vLLM's numbering),
`echo`, `models.retrieve`, `created`, JSON errors, the log line for ignored fields, strict integers, and
vLLM's prompt-token counter with n > 1."""

from __future__ import annotations

import ast
import logging
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtui.remote.server_probe import parse_info
from kvtui.serve.server import ServeOptions, ServeServer

IGNORED = "The following fields were present in the request but ignored: "


@pytest.fixture(scope="module")
def server():
    started = time.time()
    with ServeServer(ServeOptions(model="tiny-llama", port=0, slots=4, max_len=512, detectors=())) as running:
        running.started_between = (int(started), int(time.time()))
        yield running


def client(server: ServeServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def counter(server: ServeServer, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)


def tokens(server: ServeServer, text: str) -> list[int]:
    from kvtui.scenario.prompts import encode_text

    return encode_text(server.loaded.tokenizer, text)


# -- a list of prompts and echo ------------------------------------------------------------------------
TEXTS = ["Once upon a time", "The quick brown fox", "Hello"]
IDS = [[5, 17, 42, 9, 77], [3, 4, 5]]


def by_index(chunks) -> list[str]:
    """Each choice's streamed text, in index order."""
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    return [texts[i] for i in range(len(texts))]


@pytest.mark.parametrize("prompts", [TEXTS, IDS], ids=["texts", "token-ids"])
def test_a_list_of_prompts_gives_one_choice_per_prompt_and_sequence_numbered_as_vllm(server, prompts):
    """Choice p * n + i is sequence i of prompt p: it equals that prompt sent alone with n = 1 and the seed
    vLLM gives sequence i (seed + i); usage counts each prompt once and every choice's tokens."""
    c, extra = client(server), {"ignore_eos": True}
    answer = c.completions.create(model="tiny-llama", prompt=prompts, n=2, max_tokens=6, temperature=1.0, seed=11,
                                  extra_body=extra)
    solo = [c.completions.create(model="tiny-llama", prompt=p, max_tokens=6, temperature=1.0, seed=11 + i,
                                 extra_body=extra).choices[0].text for p in prompts for i in range(2)]
    assert [ch.index for ch in answer.choices] == list(range(2 * len(prompts)))
    assert [ch.text for ch in answer.choices] == solo
    assert len(set(solo)) > len(prompts)  # the seeds differ, so a wrong order would show
    prompt_tokens = sum(len(tokens(server, p)) if isinstance(p, str) else len(p) for p in prompts)
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (prompt_tokens, len(prompts) * 2 * 6)

    chunks = list(c.completions.create(model="tiny-llama", prompt=prompts, n=2, max_tokens=6, temperature=1.0,
                                       seed=11, stream=True, stream_options={"include_usage": True},
                                       extra_body=extra))
    assert by_index(chunks) == solo
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == prompt_tokens
    assert {ch.id for ch in chunks} == {chunks[0].id}  # one response for all prompts


def test_echo_puts_each_prompt_before_its_choices_streamed_or_whole(server):
    c, extra = client(server), {"ignore_eos": True}
    for prompts, heads in ((TEXTS, TEXTS), (IDS, [server.loaded.tokenizer.decode(p) for p in IDS])):
        plain = c.completions.create(model="tiny-llama", prompt=prompts, max_tokens=5, temperature=0,
                                     extra_body=extra)
        echoed = c.completions.create(model="tiny-llama", prompt=prompts, max_tokens=5, temperature=0, echo=True,
                                      extra_body=extra)
        assert [ch.text for ch in echoed.choices] == [h + p.text for h, p in zip(heads, plain.choices)]
        assert echoed.usage == plain.usage  # the echo is no generated token
        chunks = list(c.completions.create(model="tiny-llama", prompt=prompts, max_tokens=5, temperature=0,
                                           echo=True, stream=True, extra_body=extra))
        assert by_index(chunks) == [ch.text for ch in echoed.choices]
        first = next(ch.choices[0].text for ch in chunks if ch.choices[0].index == 1)
        assert first.startswith(heads[1])  # the prompt comes first, in the choice's first chunk

    with pytest.raises(openai.BadRequestError) as caught:  # vLLM then returns the prompt's logprobs: not computed
        c.completions.create(model="tiny-llama", prompt="x", max_tokens=2, echo=True, logprobs=1)
    assert caught.value.body["param"] == "echo"


@pytest.mark.parametrize("prompt, message", [(["a", ""], "prompt[1] is empty"), ([], "the prompt is empty"),
                                             (["a"] * 1025, "prompt list length 1025 exceeds")])
def test_a_bad_prompt_list_is_a_400_naming_prompt(server, prompt, message):
    response = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt" and message in error["message"]


def test_a_rejected_prompt_fails_its_request_alone(server):
    """One prompt of a list over the context length: 400 for the request, nothing of it left running, and the
    next request is served."""
    c = client(server)
    with pytest.raises(openai.BadRequestError) as caught:
        c.completions.create(model="tiny-llama", prompt=["short", "x" * 510], max_tokens=8)
    assert caught.value.body["code"] == "context_length_exceeded"
    assert server.bridge.in_flight() == 0
    assert c.completions.create(model="tiny-llama", prompt="ok", max_tokens=2).usage.completion_tokens >= 1


# -- models ----------------------------------------------------------------------------------------------
def test_models_retrieve_and_created_is_the_servers_start(server):
    c = client(server)
    listed = c.models.list().data
    model = c.models.retrieve("tiny-llama")
    assert [m.id for m in listed] == [model.id] == ["tiny-llama"]
    low, high = server.started_between
    assert low <= model.created <= high and listed[0].created == model.created
    time.sleep(1.1)
    assert c.models.retrieve("tiny-llama").created == model.created  # not the time of the call
    with pytest.raises(openai.NotFoundError) as caught:
        c.models.retrieve("gpt-4")
    assert caught.value.body == {"message": "The model `gpt-4` does not exist.", "type": "NotFoundError",
                                 "param": "model", "code": 404}  # vLLM's body


# -- errors ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body", [b'{"prompt": "x", ', b"{nope}", b"not json"])
def test_unparsable_json_is_a_400_with_param_null(server, body):
    response = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, None)
    assert error["message"].startswith("the body is not valid JSON (")


def test_a_body_that_is_not_an_object_is_a_400_with_param_null(server):
    response = httpx.post(server.url + "/v1/completions", json=[1, 2])
    assert response.status_code == 400 and response.json()["error"]["param"] is None


@pytest.mark.parametrize("path, field, value", [
    ("completions", "max_tokens", 3.0), ("completions", "max_tokens", "3"), ("completions", "max_tokens", True),
    ("completions", "n", 2.0), ("completions", "seed", 1.5), ("completions", "top_k", 1.0),
    ("completions", "min_tokens", 1.0), ("completions", "logprobs", 1.0), ("completions", "best_of", 1.0),
    ("completions", "prompt", [1.0, 2.0]), ("chat/completions", "max_completion_tokens", 3.0),
    ("chat/completions", "top_logprobs", 1.0)])
def test_integer_fields_take_json_integers_only(server, path, field, value):
    body = {"prompt": "x"} if path == "completions" else {"messages": [{"role": "user", "content": "x"}],
                                                            "logprobs": True}
    response = httpx.post(f"{server.url}/v1/{path}", json={**body, "max_tokens": 2, field: value})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}")


def test_the_openai_client_gets_a_400_for_a_decimal_max_tokens(server):
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).completions.create(model="tiny-llama", prompt="x", max_tokens=3.0)
    assert caught.value.body["param"] == "max_tokens"


def test_ignored_fields_are_named_in_vllms_log_line(server, caplog):
    c = client(server)
    with caplog.at_level(logging.WARNING, logger="kvtui.serve"):
        c.completions.create(model="tiny-llama", prompt="x", max_tokens=2, extra_body={"foo": 1, "best_of_n": 2})
        c.chat.completions.create(model="tiny-llama", max_tokens=2, messages=[{"role": "user", "content": "x",
                                                                               "name": "ann"}])
        c.completions.create(model="tiny-llama", prompt="x", max_tokens=2, stream=True,
                             stream_options={"include_usage": True}).close()
    lines = [r.getMessage() for r in caplog.records if r.name == "kvtui.serve"]
    assert [line[:len(IGNORED)] for line in lines] == [IGNORED, IGNORED]  # the third held no unknown field
    assert [ast.literal_eval(line[len(IGNORED):]) for line in lines] == [{"foo", "best_of_n"}, {"messages[0].name"}]


# -- metrics ---------------------------------------------------------------------------------------------
def test_cache_config_info_has_no_block_size_under_slot_kv(server):
    info = parse_info(httpx.get(server.url + "/metrics").text)["vllm:cache_config_info"]
    assert info == {"enable_prefix_caching": "False"}


PROMPT = "count my prompt once per sequence, please"


def _counts_each_sequence(target: ServeServer, length: int) -> None:
    for _ in range(2):  # the second time from the prefix cache where there is one
        before = counter(target, "vllm:prompt_tokens_total")
        answer = client(target).completions.create(model="tiny-llama", prompt=PROMPT, n=4, max_tokens=3,
                                                   extra_body={"ignore_eos": True})
        assert answer.usage.prompt_tokens == length
        assert counter(target, "vllm:prompt_tokens_total") - before == 4 * length


@pytest.mark.parametrize("engine", [{}, {"slots": 2}, {"slots": 2, "kv": "paged", "prefix_caching": True}])
def test_prompt_tokens_count_each_sequences_prompt_as_vllm_does(server, engine):
    """vLLM's v1 IterationStats adds a request's prompt length at its first token, once per child request: n
    times for n > 1, however the prompt was computed. Here 4 sequences forked from one prefill on 4 slots, 4
    on 2 slots (2 of them prefill again) and 4 on a paged server whose prefix cache holds the prompt the
    second time all count it 4 times; usage counts it once."""
    length = len(tokens(server, PROMPT))
    if not engine:
        _counts_each_sequence(server, length)
        before = counter(server, "vllm:prompt_tokens_total")
        client(server).completions.create(model="tiny-llama", prompt=[PROMPT, "short"], n=2, max_tokens=2)
        assert counter(server, "vllm:prompt_tokens_total") - before == 2 * (length + len(tokens(server, "short")))
        return
    with ServeServer(ServeOptions(model="tiny-llama", port=0, max_len=512, detectors=(), **engine)) as other:
        _counts_each_sequence(other, length)


def test_version_is_kvtuis_release_in_vllms_shape_and_identify_reads_it(server):
    """GET /version answers as vLLM's does, and a conformance run's identity reads the release from it (a
    remote kvtui serve has no install of this process to take it from)."""
    from kvtui import __version__
    from kvtui.remote.identity import identify

    response = httpx.get(server.url + "/version", timeout=30)
    assert response.status_code == 200 and response.json() == {"version": __version__}
    found = identify(server.url, "kvtui")
    assert (found.name, found.version, found.server_header) == ("kvtui", __version__, "uvicorn")
    assert found.source == "name: /v1/models owned_by; version: GET /version"
