"""`kvtui serve` driven by the official `openai` client and plain HTTP: answers checked against
transformers on a separate model instance (greedy tokens, log_softmax logprobs), streams against the
whole answers, metrics parsed by prometheus_client, errors, disconnects, loading, shutdown, faults
across clients, the command line and the dashboard."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from helpers import make_engine, uncached_greedy
from prometheus_client.parser import text_string_to_metric_families

from kvtui.events import StepEvent
from kvtui.models import load_model
from kvtui.scenario.prompts import chat_ids, user_chat
from kvtui.serve.detok import TextStream
from kvtui.serve.server import ServeOptions, ServeServer

PASSPHRASE = "The passphrase is BISCUIT-DRAGON-67. Reply with only the passphrase."
CHEAP_DETECTORS = ("canary", "attention_flow", "slot_taint")  # the reference detector's solo reruns cost seconds
ROOT = Path(__file__).resolve().parents[2]


def client(server: ServeServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def metrics(server: ServeServer) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics as {(name, sorted labels without model_name/engine): value}."""
    text = httpx.get(server.url + "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))
            out[(s.name, labels)] = s.value
    return out


WAIT_S = 300  # subprocess and HTTP waits: generous, a loaded 2-core machine imports torch in tens of seconds


def until(predicate, timeout_s: float = 60.0, state=None) -> None:
    """Poll `predicate` every 20 ms; on timeout, fail with what `state()` (if given) returns then."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out; state: {state() if state else '-'}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def oracle_tiny():
    """tiny-llama built again: the same weights as the server's, a separate instance."""
    return load_model("tiny-llama", progress=False)


@pytest.fixture(scope="module")
def tiny_server():
    options = ServeOptions(model="tiny-llama", port=0, slots=4, max_len=2048, detectors=CHEAP_DETECTORS)
    with ServeServer(options) as server:
        yield server


def greedy_text(loaded, prompt_ids: list[int], n: int) -> tuple[list[int], str]:
    ids = uncached_greedy(loaded.model, prompt_ids, n)
    return ids, loaded.tokenizer.decode(ids, skip_special_tokens=True)


# -- answers, streams, stops (tiny-llama: random weights, random bytes, split UTF-8 characters) ----------
def test_completion_and_chat_equal_transformers_greedy_streamed_or_whole(tiny_server, oracle_tiny):
    c, tok = client(tiny_server), oracle_tiny.tokenizer
    prompt = "Once upon a time"
    ids, expected = greedy_text(oracle_tiny, tok.encode(prompt), 20)
    whole = c.completions.create(model="tiny-llama", prompt=prompt, max_tokens=20, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (expected, "length")
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == \
        (len(tok.encode(prompt)), 20, len(tok.encode(prompt)) + 20)
    chunks = list(c.completions.create(model="tiny-llama", prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    texts = [ch.choices[0].text for ch in chunks if ch.choices]
    assert "".join(texts) == expected
    assert not any(t.endswith("\ufffd") for t in texts[:-1])  # never half a character
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20

    chat = [{"role": "user", "content": "Say something."}]
    _, expected_chat = greedy_text(oracle_tiny, chat_ids(tok, chat), 16)
    whole = c.chat.completions.create(model="tiny-llama", messages=chat, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.choices[0].message.content == expected_chat and whole.choices[0].message.role == "assistant"
    stream = list(c.chat.completions.create(model="tiny-llama", messages=chat, max_tokens=16, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == expected_chat
    assert stream[-1].choices[0].finish_reason == "length"


def test_stop_strings_cut_the_text_streamed_or_whole(tiny_server, oracle_tiny):
    c, tok = client(tiny_server), oracle_tiny.tokenizer
    prompt = "The quick brown fox"
    _, full = greedy_text(oracle_tiny, tok.encode(prompt), 30)
    whole_chars = [i for i in range(2, len(full) - 3) if "\ufffd" not in full[i:i + 3]]
    assert len(whole_chars) >= 3, repr(full)
    for start in whole_chars[::len(whole_chars) // 3][:3]:
        stop = full[start:start + 3]
        cut = full[:full.find(stop)]
        for include, expected in ((False, cut), (True, cut + stop)):
            extra = {"ignore_eos": True, "include_stop_str_in_output": include}
            whole = c.completions.create(prompt=prompt, model="tiny-llama", max_tokens=30, temperature=0, stop=[stop],
                                         extra_body=extra)
            assert (whole.choices[0].text, whole.choices[0].finish_reason) == (expected, "stop"), stop
            streamed = c.completions.create(prompt=prompt, model="tiny-llama", max_tokens=30, temperature=0,
                                            stop=stop, stream=True, extra_body=extra)
            assert "".join(ch.choices[0].text for ch in streamed) == expected, stop


def test_a_stream_delivers_each_token_while_the_request_runs(tiny_server):
    """Chunks leave as tokens are sampled, not all at the end: the engine is held after the request's
    third token, and the client reads three chunks (logprobs on, so every token makes one) while the
    request is still running; then the rest follow, one chunk per token."""
    held, release, tokens = threading.Event(), threading.Event(), []

    def hold_after_three(event):  # a session listener (engine thread), after the bridge's: the token went out
        if isinstance(event, StepEvent):
            tokens.extend(r.token_id for r in event.running if r.token_id is not None)
            if len(tokens) == 3:
                held.set()
                release.wait(WAIT_S)

    tiny_server.session.listeners.append(hold_after_three)
    try:
        stream = client(tiny_server).completions.create(model="tiny-llama", prompt="go", max_tokens=12, temperature=0,
                                                        logprobs=0, stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        first = [next(chunks) for _ in range(3)]
        assert held.wait(WAIT_S)  # the engine waits in the listener: three tokens sampled, the fourth not yet
        assert len(tokens) == 3 and tiny_server.bridge.in_flight() == 1
    finally:
        release.set()
        tiny_server.session.listeners.remove(hold_after_three)
    rest = list(chunks)
    per_token = [c for c in first + rest if c.choices[0].logprobs and c.choices[0].logprobs.tokens]
    assert [len(c.choices[0].logprobs.tokens) for c in per_token] == [1] * 12
    assert rest[-1].choices[0].finish_reason == "length"


def incremental_equals_whole(tok) -> None:
    import random

    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        whole = tok.decode(ids, skip_special_tokens=True)
        stream = TextStream(tok)
        pieces = [stream.add(i) for i in ids]
        assert not any(p.endswith("\ufffd") for p in pieces)  # never half a character
        assert "".join(pieces) + stream.finish(whole) == whole


def test_incremental_text_equals_the_whole_decode_for_random_bytes(oracle_tiny):
    incremental_equals_whole(oracle_tiny.tokenizer)


@pytest.mark.smollm
def test_incremental_text_equals_the_whole_decode_for_random_smollm2_tokens(smollm2):
    incremental_equals_whole(smollm2.tokenizer)


def test_seeded_sampling_repeats_and_logprobs_have_the_openai_shapes(tiny_server, oracle_tiny):
    c = client(tiny_server)
    kwargs = dict(model="tiny-llama", prompt="abc", max_tokens=12, temperature=0.9, top_p=0.9, seed=7,
                  extra_body={"ignore_eos": True, "top_k": 50})
    a, b = c.completions.create(**kwargs), c.completions.create(**kwargs)
    assert a.choices[0].text == b.choices[0].text
    lp = c.completions.create(model="tiny-llama", prompt="abc", max_tokens=6, temperature=0, logprobs=3,
                              extra_body={"ignore_eos": True}).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    # keyed by token text: byte tokens that all read "\ufffd" share a key, so up to k + 1 keys
    assert all(len(top) <= 4 and max(top.values()) <= 0 for top in lp.top_logprobs)
    assert all(top[t] == v for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs) if t != "\ufffd")
    chat = c.chat.completions.create(model="tiny-llama", messages=user_chat("hi"), max_tokens=5, temperature=0,
                                     logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(e.top_logprobs) == 2 for e in content)
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= -1e30 for e in content)
    assert all(e.logprob <= e.top_logprobs[0].logprob + 1e-6 for e in content)  # greedy: the sampled is the top
    assert c.completions.create(model="tiny-llama", prompt="abc", max_tokens=2).choices[0].logprobs is None


def test_n_choices_each_equal_their_seeded_solo_run_streamed_or_whole(tiny_server, oracle_tiny):
    """n = 3: three choices, index 0..2, choice i sampled with seed + i (vLLM's seeding of a request's
    children), each equal to a solo engine run on a separate model instance; usage sums the choices."""
    from helpers import solo

    from kvtui.engine import SamplingParams

    c, tok = client(tiny_server), oracle_tiny.tokenizer
    prompt = "Once upon"
    ids = tok.encode(prompt)
    want = [tok.decode(solo(oracle_tiny, ids, SamplingParams(temperature=0.9, seed=11 + i, max_new_tokens=10,
                                                              ignore_eos=True)), skip_special_tokens=True)
            for i in range(3)]
    assert len(set(want)) == 3
    kwargs = dict(model="tiny-llama", prompt=prompt, max_tokens=10, temperature=0.9, seed=11, n=3,
                  extra_body={"ignore_eos": True})
    whole = c.completions.create(**kwargs)
    assert [(ch.index, ch.text, ch.finish_reason) for ch in whole.choices] == [(i, want[i], "length") for i in range(3)]
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), 30)
    chunks = list(c.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    by_index = {i: "".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == i)
                for i in range(3)}
    assert by_index == dict(enumerate(want))
    assert {ch.choices[0].index for ch in chunks if ch.choices} == {0, 1, 2}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30

    chat = [{"role": "user", "content": "Say something."}]
    _, greedy = greedy_text(oracle_tiny, chat_ids(tok, chat), 8)
    stream = list(c.chat.completions.create(model="tiny-llama", messages=chat, max_tokens=8, temperature=0, n=2,
                                            stream=True, extra_body={"ignore_eos": True}))
    roles = [ch.choices[0].index for ch in stream if ch.choices[0].delta.role == "assistant"]
    assert roles == [0, 1]
    for i in (0, 1):
        mine = [ch.choices[0] for ch in stream if ch.choices[0].index == i]
        assert "".join(ch.delta.content or "" for ch in mine) == greedy  # greedy: n copies of the one answer
        assert mine[-1].finish_reason == "length"
    assert tiny_server.bridge.in_flight() == 0


def test_structured_output_fields_constrain_the_answer_as_xgrammar_does(tiny_server, oracle_tiny):
    """response_format (json_schema, json_object), structured_outputs and guided_* each constrain the
    answer: it equals transformers' generate with xgrammar's own logits processor (separate instance)."""
    xgr = pytest.importorskip("xgrammar", reason="pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi")
    from xgrammar.contrib.hf import LogitsProcessor

    c, tok = client(tiny_server), oracle_tiny.tokenizer
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=oracle_tiny.model.get_input_embeddings().num_embeddings)
    compiler = xgr.GrammarCompiler(info)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
              compiler.compile_json_schema(json.dumps(schema, sort_keys=True))),
             ({"response_format": {"type": "json_object"}}, compiler.compile_json_schema('{"type": "object"}')),
             ({"structured_outputs": {"regex": "[0-9]{2,5}"}}, compiler.compile_regex("[0-9]{2,5}")),
             ({"guided_regex": "(ab|cd)+x"}, compiler.compile_regex("(ab|cd)+x")),
             ({"guided_choice": ["left", "right"]}, compiler.compile_grammar('root ::= "left" | "right"'))]
    prompt = "Answer:"
    ids = tok.encode(prompt)
    for extra, grammar in cases:
        with torch.inference_mode():
            out = oracle_tiny.model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                             logits_processor=[LogitsProcessor(grammar)],
                                             eos_token_id=list(oracle_tiny.eos_token_ids), pad_token_id=0)
        want = out[0, len(ids):].tolist()
        answer = c.completions.create(model="tiny-llama", prompt=prompt, max_tokens=24, temperature=0, extra_body=extra)
        assert answer.choices[0].text == tok.decode(want, skip_special_tokens=True), extra
        assert answer.choices[0].finish_reason == ("stop" if want[-1] in oracle_tiny.eos_token_ids else "length")
    choice = c.chat.completions.create(model="tiny-llama", messages=user_chat("pick"), max_tokens=8, temperature=0.7,
                                       seed=3, n=2, extra_body={"guided_choice": ["left", "right"]})
    assert {ch.message.content for ch in choice.choices} <= {"left", "right"}
    for body, param in [({"guided_regex": "(", "prompt": "x"}, "guided_regex"),
                        ({"guided_regex": "a", "guided_choice": ["b"], "prompt": "x"}, "guided_choice"),
                        ({"response_format": {"type": "xml"}, "prompt": "x"}, "response_format"),
                        ({"structured_outputs": {"json": "not json"}, "prompt": "x"}, "structured_outputs.json")]:
        response = httpx.post(f"{tiny_server.url}/v1/completions", json=body)
        assert response.status_code == 400, body
        assert response.json()["error"]["param"] == param, response.json()
    bad = httpx.post(f"{tiny_server.url}/v1/completions", json={"guided_regex": "(", "prompt": "x"}).json()["error"]
    assert bad["code"] == "invalid_structured_output" and "regex does not compile" in bad["message"]
    assert ".cc:" not in bad["message"] and not re.search(r"\[\d\d:\d\d:\d\d\]", bad["message"])  # no library log prefix
    objects = c.completions.create(model="tiny-llama", prompt="{", max_tokens=24, temperature=0.8, seed=5,
                                   extra_body={"response_format": {"type": "json_object"}, "ignore_eos": False})
    assert objects.choices[0].text.lstrip().startswith("{")  # json_object is an object, never an array


def test_penalties_bias_and_bad_words_are_honoured_per_request(tiny_server, oracle_tiny):
    """The answers equal transformers' processors (repetition penalty, bias, bad words) and the OpenAI
    formula (presence / frequency) on a separate instance, several requests in flight at once."""
    from concurrent.futures import ThreadPoolExecutor

    from test_sampling_params import hf_generate, openai_greedy

    from kvtui.engine import SamplingParams
    from kvtui.engine.sampling import bad_words_token_ids

    c, tok = client(tiny_server), oracle_tiny.tokenizer
    prompt = "go on"  # its greedy answer repeats tokens, so presence and frequency change it
    ids, x = tok.encode(prompt), tok.encode("x", add_special_tokens=False)[0]
    hf_params = SamplingParams(max_new_tokens=12, repetition_penalty=1.7, ignore_eos=True, logit_bias=((x, 8.0),),
                               bad_words_ids=bad_words_token_ids(tok, ["a", "b"]))
    openai_params = SamplingParams(max_new_tokens=12, frequency_penalty=1.5, presence_penalty=0.5)
    bodies = [dict(extra_body={"repetition_penalty": 1.7, "bad_words": ["a", "b"], "ignore_eos": True},
                   logit_bias={str(x): 8.0}),
              dict(frequency_penalty=1.5, presence_penalty=0.5, extra_body={"ignore_eos": True}),
              dict(extra_body={"ignore_eos": True})]
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda b: c.completions.create(model="tiny-llama", prompt=prompt, max_tokens=12,
                                                               temperature=0, logprobs=0, **b), bodies))
    texts = [a.choices[0].text for a in answers]
    assert texts[0] == tok.decode(hf_generate(oracle_tiny.model, ids, hf_params, None)[0], skip_special_tokens=True)
    assert texts[1] == tok.decode(openai_greedy(oracle_tiny.model, ids, openai_params), skip_special_tokens=True)
    assert texts[2] == greedy_text(oracle_tiny, ids, 12)[1]
    assert len({*texts}) == 3


# -- metrics --------------------------------------------------------------------------------------------
def test_metrics_parse_and_count_the_requests(tiny_server):
    c = client(tiny_server)
    before = metrics(tiny_server)
    for n in (3, 5):
        c.completions.create(model="tiny-llama", prompt="count me", max_tokens=n, temperature=0,
                             extra_body={"ignore_eos": True})
    after = metrics(tiny_server)
    reason = ("finished_reason", "length")

    def grew(name, labels=()):
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert grew("vllm:request_success_total", (reason,)) == 2
    assert grew("vllm:generation_tokens_total") == 8
    assert grew("vllm:prompt_tokens_total") == 2 * len("count me")  # tiny-llama: one token per byte
    assert grew("vllm:time_to_first_token_seconds_count") == 2
    assert grew("vllm:e2e_request_latency_seconds_count") == 2
    assert grew("vllm:inter_token_latency_seconds_count") == 2 + 4
    assert grew("vllm:request_time_per_output_token_seconds_count") == 2
    assert after[("vllm:num_requests_running", ())] == 0 and after[("vllm:num_requests_waiting", ())] == 0
    text = httpx.get(tiny_server.url + "/metrics").text
    for name, kind in (("vllm:num_requests_running", "gauge"), ("vllm:kv_cache_usage_perc", "gauge"),
                       ("vllm:prompt_tokens_total", "counter"), ("vllm:request_success_total", "counter"),
                       ("vllm:time_to_first_token_seconds", "histogram"),
                       ("vllm:inter_token_latency_seconds", "histogram"),
                       ("vllm:e2e_request_latency_seconds", "histogram")):
        assert f"# TYPE {name} {kind}" in text
    assert 'model_name="tiny-llama"' in text and "_created" not in text
    # the engine thread's step time, and the part of it spent off the CPU (GIL waits, preemption)
    stepped, waited = grew("kvtui:engine_step_seconds_total"), grew("kvtui:engine_step_wait_seconds_total")
    assert stepped > 0 and 0 <= waited <= stepped


# -- errors ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body, status, param, code", [
    ("completions", {"prompt": "x", "n": 17}, 400, "n", None),
    ("completions", {"prompt": "x", "n": 0}, 400, "n", None),
    ("completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens", None),  # FastAPI's 422, as 400
    ("completions", {"prompt": "x", "temperature": -1}, 400, "temperature", None),
    ("completions", {}, 400, "prompt", None),
    ("completions", {"prompt": "x", "max_tokens": 2048}, 400, "max_tokens", "context_length_exceeded"),
    ("completions", {"prompt": "x" * 2040}, 400, "max_tokens", "context_length_exceeded"),
    ("completions", {"prompt": ["a", ""]}, 400, "prompt", None),
    ("completions", {"prompt": "x", "frequency_penalty": 2.5}, 400, "frequency_penalty", None),
    ("completions", {"prompt": "x", "presence_penalty": -3}, 400, "presence_penalty", None),
    ("completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", None),
    ("completions", {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias", None),
    ("completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias", None),
    ("completions", {"prompt": "x", "logit_bias": {"9999999": 1}}, 400, "logit_bias", "invalid_logit_bias"),
    ("completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens", None),
    ("completions", {"prompt": "x", "bad_words": "x"}, 400, "bad_words", None),
    ("completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", 404),  # vLLM's NotFoundError body
    ("chat/completions", {"messages": []}, 400, "messages", None),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs",
     None),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs", None),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream_options": {}}, 400,
     "stream_options", None),
])
def test_errors_are_openai_shaped(tiny_server, path, body, status, param, code):
    response = httpx.post(f"{tiny_server.url}/v1/{path}", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code)


@pytest.mark.parametrize("path, body, param, message", [
    ("completions", {"prompt_embeds": 5}, "prompt_embeds", "prompt_embeds: Input should be a valid string or a valid list"),
    ("completions", {"prompt_embeds": [5]}, "prompt_embeds", "prompt_embeds[0]: Input should be a valid string"),
    ("completions", {"prompt": "x", "stop": [1]}, "stop", "stop[0]: Input should be a valid string"),
    ("completions", {"prompt": [1.5]}, "prompt",
     "prompt[0]: Input should be a valid integer or a valid string or a valid list"),
    ("completions", {"prompt": [[[1]]]}, "prompt", "prompt[0][0]: Input should be a valid integer"),
    ("completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias",
     'logit_bias["5"]: Input should be less than or equal to 100'),
    ("completions", {"prompt": "x", "bad_words": [1]}, "bad_words", "bad_words[0]: Input should be a valid string"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages",
     "messages[0].content: Input should be a valid string or a valid list"),
])
def test_a_mistyped_field_is_named_as_the_request_wrote_it(tiny_server, path, body, param, message):
    """Pydantic's names for a union's branches (`prompt_embeds.str`, `prompt.list[int]`) never reach the client:
    the message names the field and index the request wrote, and what the value sent should be."""
    response = httpx.post(f"{tiny_server.url}/v1/{path}", json=body)
    assert response.status_code == 400
    assert response.json()["error"] == {"message": message, "type": "invalid_request_error", "param": param,
                                        "code": None}


def test_the_openai_client_raises_its_own_errors(tiny_server):
    c = client(tiny_server)
    with pytest.raises(openai.BadRequestError) as caught:
        c.completions.create(model="tiny-llama", prompt="x", n=17)
    assert caught.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="x")
    response = httpx.get(tiny_server.url + "/v2/nothing")
    assert response.status_code == 404 and set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert [m.id for m in c.models.list().data] == ["tiny-llama"]


def test_a_full_waiting_queue_answers_429():
    options = ServeOptions(model="tiny-llama", port=0, slots=1, max_len=2048, max_waiting=0, detectors=())
    with ServeServer(options) as server:
        c = client(server)
        long = c.completions.create(model="tiny-llama", prompt="a", max_tokens=2000, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
        next(iter(long))  # running: it holds the only slot
        with pytest.raises(openai.RateLimitError) as caught:
            c.completions.create(model="tiny-llama", prompt="b", max_tokens=2)
        assert caught.value.status_code == 429 and caught.value.body["code"] == "rate_limit_exceeded"
        long.close()
        until(lambda: server.session.engine.pool.num_free == 1)
        assert c.completions.create(model="tiny-llama", prompt="b", max_tokens=2).choices[0].finish_reason


# -- disconnects, loading, shutdown ---------------------------------------------------------------------
def test_a_client_that_disconnects_aborts_its_request_and_frees_its_slot(tiny_server):
    engine = tiny_server.session.engine
    body = {"prompt": "go on", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}  # seconds of decoding
    before = metrics(tiny_server).get(("vllm:request_success_total", (("finished_reason", "abort"),)), 0)

    def state():
        running = {r.request_id: (r.status.name, len(r.generated_ids)) for r in list(engine.scheduler.running)}
        return dict(running=running, waiting=engine.num_waiting, free=engine.pool.num_free,
                    in_flight=tiny_server.bridge.in_flight())

    with httpx.stream("POST", tiny_server.url + "/v1/completions", json={**body, "stream": True}) as response:
        first = json.loads(next(line for line in response.iter_lines() if line.startswith("data: "))[6:])
        until(lambda: first["id"] in state()["running"], state=state)  # this request, mid-decode
    until(lambda: engine.num_running == 0 and engine.pool.num_free == engine.pool.num_slots, state=state)

    # not streamed: the client sends its request and hangs up at once
    payload = json.dumps(body).encode()
    with socket.create_connection((tiny_server.options.host, tiny_server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        until(lambda: engine.num_running == 1, state=state)
    until(lambda: engine.num_running == 0 and engine.pool.num_free == engine.pool.num_slots, state=state)
    aborted = metrics(tiny_server)[("vllm:request_success_total", (("finished_reason", "abort"),))]
    assert aborted - before == 2
    assert tiny_server.bridge.in_flight() == 0


def test_503_while_the_model_loads_then_200(oracle_tiny):
    release = threading.Event()

    def slow_load(options):
        release.wait(WAIT_S)
        return load_model("tiny-llama", progress=False)

    server = ServeServer(ServeOptions(model="tiny-llama", port=0, detectors=()), load=slow_load)
    server.start_http()
    try:
        loading = threading.Thread(target=lambda: (server.load(), server.start_engine()))
        loading.start()
        for path, method in (("/health", "GET"), ("/v1/models", "GET"), ("/v1/completions", "POST")):
            response = httpx.request(method, server.url + path, json={"prompt": "x"})
            assert response.status_code == 503 and response.json()["error"]["code"] == "model_loading"
        release.set()
        loading.join(WAIT_S)
        assert httpx.get(server.url + "/health").status_code == 200
        assert client(server).completions.create(model="tiny-llama", prompt="x", max_tokens=2).usage.completion_tokens
    finally:
        release.set()
        server.stop()


def test_stop_aborts_requests_in_flight_and_writes_the_summary(tmp_path):
    record = tmp_path / "serve.jsonl"
    server = ServeServer(ServeOptions(model="tiny-llama", port=0, max_len=2048, record=record, detectors=()))
    server.__enter__()
    lines: list[str] = []
    first = threading.Event()

    def read():
        with httpx.stream("POST", server.url + "/v1/completions", timeout=WAIT_S,
                          json={"prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    first.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert first.wait(WAIT_S)
    t0 = time.monotonic()
    server.stop()
    reader.join(WAIT_S)
    assert not reader.is_alive() and time.monotonic() - t0 < 120  # bounded: a stop never hangs
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort" and lines[-1] == "data: [DONE]"
    recorded = [json.loads(line) for line in record.read_text().splitlines()]
    assert recorded[-1]["type"] == "summary" and recorded[-1]["finish_reasons"] == {"abort": 1}
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=2)


# -- faults across clients ------------------------------------------------------------------------------
def test_stale_slot_leaks_across_http_clients_and_the_servers_detectors_count_it():
    options = ServeOptions(model="tiny-llama", port=0, slots=1, max_len=160, faults=("stale_slot",),
                           detectors=("slot_taint", "attention_flow"))
    with ServeServer(options) as server:
        c = client(server)
        for prompt in ("first client's secret", "second client"):
            c.completions.create(model="tiny-llama", prompt=prompt, max_tokens=4, temperature=0,
                                 extra_body={"ignore_eos": True})
        counted = {labels: v for (name, labels), v in metrics(server).items()
                   if name == "kvtui:contamination_events_total"}
    assert counted.get((("detector", "slot_taint"), ("kind", "cross_request")), 0) >= 1


# -- SmolLM2 ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_server(smollm2):
    options = ServeOptions(model="default", port=0, slots=4, max_len=256, detectors=CHEAP_DETECTORS)
    with ServeServer(options, load=lambda _: smollm2) as server:
        yield server


@pytest.fixture(scope="module")
def smol_oracle(smollm2):
    """SmolLM2 loaded again: a separate instance for transformers' own logits."""
    return load_model("default", progress=False)


@pytest.mark.smollm
def test_smollm2_answers_the_passphrase_streamed_or_whole(smol_server):
    c = client(smol_server)
    messages = user_chat(PASSPHRASE)
    whole = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, temperature=0, max_tokens=32)
    assert whole.choices[0].message.content == "The passphrase is BISCUIT-DRAGON-67."
    assert whole.choices[0].finish_reason == "stop"
    stream = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, temperature=0,
                                       max_tokens=32, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == "The passphrase is BISCUIT-DRAGON-67."
    cut = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, temperature=0, max_tokens=32,
                                    stop=["DRAGON"])
    assert (cut.choices[0].message.content, cut.choices[0].finish_reason) == ("The passphrase is BISCUIT-", "stop")
    streamed_cut = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, temperature=0,
                                             max_tokens=32, stop=["DRAGON"], stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed_cut) == "The passphrase is BISCUIT-"


@pytest.mark.smollm
@torch.inference_mode()
def test_smollm2_logprobs_equal_log_softmax_of_transformers_logits(smol_server, smol_oracle):
    c, tok = client(smol_server), smol_oracle.tokenizer
    messages = user_chat(PASSPHRASE)
    response = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, temperature=0,
                                         max_tokens=32, logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    prompt = chat_ids(tok, messages)
    generated = uncached_greedy(smol_oracle.model, prompt, len(content))
    logits = smol_oracle.model(input_ids=torch.tensor([prompt + generated]), use_cache=False).logits[0].float()
    expected = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    for i, entry in enumerate(content):
        assert entry.token == tok.decode([generated[i]])
        assert abs(entry.logprob - float(expected[i, generated[i]])) < 1e-4
        top = torch.topk(expected[i], 3)
        assert [e.token for e in entry.top_logprobs] == [tok.decode([t]) for t in top.indices.tolist()]
        assert all(abs(e.logprob - float(v)) < 1e-4 for e, v in zip(entry.top_logprobs, top.values.tolist()))


@pytest.mark.smollm
def test_smollm2_concurrent_requests_each_get_their_own_answer(smol_server, smol_oracle):
    phrases = ["AMBER-CASTLE-21", "TIGER-LEMON-58", "CORAL-ROCKET-33", "HONEY-RIVER-74"]
    tok = smol_oracle.tokenizer
    answers: dict[str, str] = {}

    def ask(phrase):
        text = PASSPHRASE.replace("BISCUIT-DRAGON-67", phrase)
        r = client(smol_server).chat.completions.create(model="SmolLM2-135M-Instruct", messages=user_chat(text),
                                                        temperature=0, max_tokens=24)
        answers[phrase] = r.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(p,)) for p in phrases]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for phrase in phrases:
        prompt = chat_ids(tok, user_chat(PASSPHRASE.replace("BISCUIT-DRAGON-67", phrase)))
        solo = uncached_greedy(smol_oracle.model, prompt, 24)
        eos = next((i for i, t in enumerate(solo) if t in smol_oracle.eos_token_ids), len(solo))
        assert answers[phrase] == tok.decode(solo[:eos], skip_special_tokens=True)
        assert phrase in answers[phrase]


# -- command line and dashboard ----------------------------------------------------------------------------
class Lines:
    """Every line of a process's text stream, read by a thread, so a wait has a deadline and never hangs."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self.ended = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line)
        self.ended.set()

    def wait_for(self, pattern: str, timeout_s: float = WAIT_S) -> re.Match:
        """The first line matching `pattern`; fails after `timeout_s` or when the stream ends first."""
        deadline, seen = time.monotonic() + timeout_s, 0
        while True:
            for line in self.lines[seen:]:
                found = re.search(pattern, line)
                if found:
                    return found
            seen = len(self.lines)
            if self.ended.is_set():
                pytest.fail(f"the stream ended before a line matching {pattern!r}: {self.lines[-5:]}")
            assert time.monotonic() < deadline, f"no line matching {pattern!r} within {timeout_s} s"
            time.sleep(0.02)

    def text(self, timeout_s: float = WAIT_S) -> str:
        """Everything, once the stream ended (the process exited)."""
        assert self.ended.wait(timeout_s), f"the stream did not end within {timeout_s} s"
        return "".join(self.lines)


def test_the_command_serves_until_sigterm_then_writes_the_summary_and_exits_0(tmp_path):
    """With a request in flight: it is aborted, the summary written, exit 0 and no traceback. The API key
    comes from KVTUI_API_KEY."""
    record = tmp_path / "cli.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "KVTUI_API_KEY": "from-env"}
    process = subprocess.Popen([sys.executable, "-m", "kvtui.cli", "serve", "--model", "tiny-llama", "--port", "0",
                                "--record", str(record), "--detectors", "none", "--threads", "1", "--max-len", "4096"],
                               cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = Lines(process.stdout), Lines(process.stderr)
    try:
        found = stderr.wait_for(r"serving tiny-llama at (http://[\d.:]+)/v1")
        url, key = found.group(1), {"authorization": "Bearer from-env"}
        body = {"prompt": "hi", "max_tokens": 3, "ignore_eos": True}
        assert httpx.post(url + "/v1/completions", json=body, timeout=WAIT_S).status_code == 401
        r = httpx.post(url + "/v1/completions", json=body, headers=key, timeout=WAIT_S)
        assert r.json()["usage"]["completion_tokens"] == 3
        with httpx.stream("POST", url + "/v1/completions", headers=key, timeout=WAIT_S,
                          json={**body, "max_tokens": 4000, "stream": True}) as long:
            lines = long.iter_lines()
            assert next(lines).startswith("data: {")  # in flight
            process.send_signal(signal.SIGTERM)
            last = [line for line in lines if line]
        process.wait(WAIT_S)
        out, err = stdout.text(), stderr.text()
    finally:
        process.kill()
    assert process.returncode == 0 and "Traceback" not in err, err[-2000:]
    assert "decode steps: eager: compile off (--compile turns it on)" in err  # the start log says which runs
    assert "decode attention: kvtui's C++ kernel (forced by $KVTUI_DECODE_ATTENTION)" in err  # the suite forces it
    assert json.loads(last[-2][6:])["choices"][0]["finish_reason"] == "abort" and last[-1] == "data: [DONE]"
    assert "kvtui serve on tiny-llama" in out and f"recording: {record}" in out
    recorded = [json.loads(line) for line in record.read_text().splitlines()]
    assert recorded[0]["type"] == "header" and recorded[-1]["type"] == "summary"
    assert recorded[-1]["finish_reasons"] == {"length": 1, "abort": 1}
    # a server plans no requests, so its summary counts none "not submitted" (it said "0 requests not submitted")
    assert "not submitted" not in out


def test_the_command_refuses_bad_input_in_one_line():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "kvtui.cli", "serve", "--model", "tiny-gpt2", "--max-len", "100000",
                        "--port", "0"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=WAIT_S)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: --max-len")


def test_the_dashboard_shows_the_served_engine(tmp_path):
    from kvtui.tui.app import KvtuiApp
    from kvtui.tui.live import LiveSource

    server = ServeServer(ServeOptions(model="tiny-llama", port=0, detectors=CHEAP_DETECTORS, faults=("stale_slot",)))
    server.start_http()
    server.load()
    source = LiveSource(server.make_session)
    answers = []

    def ask():
        for prompt in ("The passphrase is AMBER-CASTLE-21.", "hello"):
            answers.append(client(server).completions.create(model="tiny-llama", prompt=prompt, max_tokens=4,
                                                             extra_body={"ignore_eos": True}))

    async def run():
        app = KvtuiApp(source)
        async with app.run_test(size=(160, 45)) as pilot:
            asker = threading.Thread(target=ask)
            asker.start()
            deadline = time.monotonic() + WAIT_S
            while len(answers) < 2 and time.monotonic() < deadline:
                await pilot.pause(0.05)
            asker.join(WAIT_S)
            await pilot.press("q")

    try:
        asyncio.run(run())
    finally:
        server.bridge.close_intake()
        source.shutdown()
        server.stop_http()
    assert [a.usage.completion_tokens for a in answers] == [4, 4]
    assert {a.id for a in answers} <= set(source.state.requests)
    assert source.summary is not None and source.summary.requests_finished == 2
    assert any(e.detector == "slot_taint" for e in source.session.contamination)


# -- the engine's log-probabilities ------------------------------------------------------------------------
@torch.inference_mode()
def test_engine_reports_logprobs_only_when_asked(tiny, oracle_tiny):
    from kvtui.engine import SamplingParams

    engine = make_engine(tiny["tiny-llama"].model, num_slots=2, max_len=64)
    prompt = [5, 17, 42, 9]
    engine.submit("on", prompt, SamplingParams(max_new_tokens=4, logprobs=5))
    engine.submit("off", prompt, SamplingParams(max_new_tokens=4))
    reports = engine.run_until_done()
    entries = [r.logprobs for report in reports for r in report.running if r.request_id == "on"]
    assert all(r.logprobs is None for report in reports for r in report.running if r.request_id == "off")
    tokens = [pairs[0][0] for pairs in entries]
    logits = oracle_tiny.model(input_ids=torch.tensor([prompt + tokens]), use_cache=False).logits[0].float()
    expected = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    for i, ((token, logprob), *top) in enumerate(entries):
        assert abs(logprob - float(expected[i, token])) < 1e-4
        values, ids = torch.topk(expected[i], 5)
        assert [t for t, _ in top] == ids.tolist()
        assert max(abs(lp - float(v)) for (_, lp), v in zip(top, values.tolist())) < 1e-4


def test_a_snapshot_that_arrives_while_the_dashboard_closes_is_ignored():
    """A served session publishes snapshots until the very end: one can reach the app after its
    widgets are gone (seen at quit in test_the_dashboard_shows_the_served_engine)."""
    from kvtui.tui.app import KvtuiApp
    from kvtui.tui.snapshot_build import build_snapshot
    from kvtui.tui.sources import SnapshotReady, Source
    from kvtui.tui.state import DashboardState
    from kvtui.tui.widgets import HeaderBar

    async def run():
        app = KvtuiApp(Source())
        async with app.run_test(size=(100, 30)) as pilot:
            await app.query_one(HeaderBar).remove()
            app.post_message(SnapshotReady(build_snapshot(DashboardState()), "CLOSING"))
            await pilot.pause(0.1)
            assert app.frames == 1

    asyncio.run(run())


def test_a_missing_model_path_is_relative_to_the_current_folder_for_serve():
    """kvtui serve has no scenario file: a missing --model path is explained against the current folder."""
    from kvtui.serve.server import ServeOptions, serve_scenario

    with pytest.raises(ValueError) as raised:
        serve_scenario(ServeOptions(model="./models/nothing-here", port=0))
    message = str(raised.value)
    assert "--model" in message and "does not exist" in message and "relative to the current folder" in message
    assert "scenario file" not in message


def test_the_default_step_budget_is_the_one_measured_on_both_peers_workloads():
    """256 tokens per step (SERVE_MAX_TOKENS_PER_STEP), measured against 2048 on the Poisson and the
    saturation workload (docs/performance.md); at least max_batch_size; a given budget is kept."""
    from kvtui.serve.server import ServeOptions, serve_scenario

    assert serve_scenario(ServeOptions(model="tiny-llama", port=0)).engine.max_tokens_per_step == 256
    assert serve_scenario(ServeOptions(model="tiny-llama", port=0, slots=300, max_batch_size=300,
                                       max_len=64)).engine.max_tokens_per_step == 300
    assert serve_scenario(ServeOptions(model="tiny-llama", port=0, max_tokens_per_step=2048)
                          ).engine.max_tokens_per_step == 2048
