"""`kvtui serve --enable-prompt-embeds`, driven by the official `openai` client: the answers to prompt
embeddings (completions' `prompt_embeds`, chat's prompt_embeds content parts) equal transformers' own
greedy `generate(inputs_embeds=...)` on a separate tiny-llama instance; every bad tensor gets 400 naming
prompt_embeds and the server keeps answering; pickled code is never run; the flag off refuses them."""

from __future__ import annotations

import base64
import io
import json
import os

import httpx
import openai
import pytest
import torch

from kvtui.models import build_tiny
from kvtui.serve.server import ServeOptions, ServeServer

CHEAP_DETECTORS = ("canary", "attention_flow", "slot_taint")
MAX_LEN = 256
HIDDEN = 64  # tiny-llama's


def b64(obj) -> str:
    """base64 of torch.save bytes, as a client sends them."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def client(server: ServeServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oracle():
    """tiny-llama built again (same weights, a separate instance) and its tokenizer."""
    return build_tiny("tiny-llama")


@pytest.fixture(scope="module")
def embeds_server():
    options = ServeOptions(model="tiny-llama", port=0, slots=4, max_len=MAX_LEN, detectors=CHEAP_DETECTORS,
                           enable_prompt_embeds=True)
    with ServeServer(options) as server:
        yield server


def generate(model, inputs_embeds: torch.Tensor, n: int) -> list[int]:
    """transformers' greedy generate from inputs_embeds [T, hidden], never stopping early."""
    with torch.no_grad():
        out = model.generate(inputs_embeds=inputs_embeds[None], attention_mask=torch.ones(1, len(inputs_embeds),
                                                                                          dtype=torch.long),
                             max_new_tokens=n, do_sample=False, eos_token_id=None)
    ids = out[0].tolist()
    assert len(ids) == n
    return ids


def rows(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


def test_completion_prompt_embeds_equal_transformers_generate(embeds_server, oracle):
    model, tok = oracle
    c = client(embeds_server)
    embeds = rows(1, 7)
    expected = tok.decode(generate(model, embeds, 20), skip_special_tokens=True)
    whole = c.completions.create(model="tiny-llama", prompt="", max_tokens=20, temperature=0,
                                 extra_body={"prompt_embeds": b64(embeds), "ignore_eos": True})
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (expected, "length")
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (7, 20)
    # prompt omitted, a list of one, a leading batch dimension of 1, streamed: the same answer
    omitted = httpx.post(embeds_server.url + "/v1/completions", timeout=120, json={
        "prompt_embeds": [b64(embeds[None])], "max_tokens": 20, "temperature": 0, "ignore_eos": True}).json()
    assert omitted["choices"][0]["text"] == expected
    chunks = list(c.completions.create(model="tiny-llama", prompt="", max_tokens=20, temperature=0, stream=True,
                                       extra_body={"prompt_embeds": b64(embeds), "ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == expected
    # other rows, another answer (the rows are read, not the placeholder ids)
    other = c.completions.create(model="tiny-llama", prompt="", max_tokens=20, temperature=0,
                                 extra_body={"prompt_embeds": b64(rows(2, 7)), "ignore_eos": True})
    assert other.choices[0].text == tok.decode(generate(model, rows(2, 7), 20), skip_special_tokens=True)
    assert other.choices[0].text != expected


def test_half_precision_rows_are_cast_to_the_models_dtype(embeds_server, oracle):
    model, tok = oracle
    for dtype in (torch.float16, torch.bfloat16):
        embeds = rows(3, 5).to(dtype)
        expected = tok.decode(generate(model, embeds.to(torch.float32), 12), skip_special_tokens=True)
        answer = client(embeds_server).completions.create(
            model="tiny-llama", prompt="", max_tokens=12, temperature=0,
            extra_body={"prompt_embeds": b64(embeds), "ignore_eos": True})
        assert answer.choices[0].text == expected, dtype


def test_chat_text_and_prompt_embeds_parts_equal_generate_on_the_spliced_embeddings(embeds_server, oracle):
    model, tok = oracle
    first, second = rows(4, 3), rows(5, 4)
    # the oracle: HF's chat template over the text with '@' bytes where the parts go, tokenized by HF, embedded
    # by the model's own table, and the '@' positions overwritten by the parts' rows in order
    text = "Describe " + "@" * 3 + " and " + "@" * 4 + " briefly."
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=False)
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    at = tok.convert_tokens_to_ids("@")
    spots = [i for i, t in enumerate(ids) if t == at]
    assert len(spots) == 7
    with torch.no_grad():
        spliced = model.get_input_embeddings()(torch.tensor(ids)).clone()
    spliced[spots] = torch.cat([first, second])
    expected = tok.decode(generate(model, spliced, 16), skip_special_tokens=True)
    content = [{"type": "text", "text": "Describe "}, {"type": "prompt_embeds", "data": b64(first)},
               {"type": "text", "text": " and "}, {"type": "prompt_embeds", "data": b64(second)},
               {"type": "text", "text": " briefly."}]
    answer = client(embeds_server).chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": content}], max_tokens=16, temperature=0,
        extra_body={"ignore_eos": True})
    assert answer.choices[0].message.content == expected
    assert answer.usage.prompt_tokens == len(ids)


def _evil_pickle(marker: str) -> str:
    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    return b64({"rows": Evil()})


def bad_cases(tmp_marker: str) -> list[tuple[str, object, str]]:
    """(name, prompt_embeds value, words the message must hold)."""
    return [
        ("not base64", "!!not base64!!", "base64"),
        ("not a torch file", base64.b64encode(b"hello world, not a zip").decode(), "torch.save"),
        ("a dict", b64({"a": rows(0, 2)}), "dict"),
        ("pickled code", _evil_pickle(tmp_marker), "other than tensors"),
        ("1-D", b64(torch.zeros(HIDDEN)), "shape"),
        ("3-D", b64(torch.zeros(2, 3, HIDDEN)), "shape"),
        ("integers", b64(torch.zeros(3, HIDDEN, dtype=torch.int64)), "int64"),
        ("no values (meta device)", b64(torch.empty(3, HIDDEN, device="meta")), "device meta"),
        ("float64", b64(torch.zeros(3, HIDDEN, dtype=torch.float64)), "float64"),
        ("too narrow", b64(torch.zeros(3, 32)), f"hidden size is {HIDDEN}"),
        ("no rows", b64(torch.zeros(0, HIDDEN)), "no rows"),
        ("NaN", b64(torch.full((3, HIDDEN), float("nan"))), "NaN"),
        ("inf", b64(torch.full((3, HIDDEN), float("inf"))), "inf"),
        ("too long", b64(torch.zeros(MAX_LEN + 1, HIDDEN)), "at most"),
        ("two tensors", [b64(rows(0, 2)), b64(rows(1, 2))], "one per request"),
        ("not a string", 5, "prompt_embeds"),
    ]


def test_bytes_that_are_no_torch_file_are_said_in_the_clients_terms(embeds_server):
    """torch.load's own words leaked ("(101)": a KeyError's bare number; miniz's central directory): the
    message says what the bytes are instead."""
    saved = base64.b64decode(b64(rows(0, 2)))
    expected = f"expected a (num_tokens, {HIDDEN}) float32, bfloat16 or float16 tensor"
    for raw, message in (
            (b"hello world, not a zip", "prompt_embeds decodes to 22 bytes that are not a torch.save file (torch.save "
                                        "writes a zip archive, starting PK; these start b'hello wo')"),
            (saved[:300], "prompt_embeds decodes to a zip archive of 300 bytes that torch.load cannot read (cut short "
                          "or damaged)")):
        response = httpx.post(embeds_server.url + "/v1/completions", timeout=60,
                              json={"prompt_embeds": base64.b64encode(raw).decode(), "max_tokens": 2})
        assert response.status_code == 400
        assert response.json()["error"] == {"message": f"{message}; {expected}", "type": "invalid_request_error",
                                            "param": "prompt_embeds", "code": None}


def test_every_bad_tensor_gets_400_naming_prompt_embeds_and_the_server_goes_on(embeds_server, oracle, tmp_path):
    marker = tmp_path / "pwned"
    url = embeds_server.url + "/v1/completions"
    for name, value, words in bad_cases(str(marker)):
        response = httpx.post(url, json={"prompt_embeds": value, "max_tokens": 4}, timeout=60)
        assert response.status_code == 400, (name, response.text)
        error = response.json()["error"]
        assert error["param"] == "prompt_embeds" and words in error["message"], (name, error)
    # the same tensors as chat parts
    for name, value, words in bad_cases(str(marker))[:-2]:
        content = [{"type": "text", "text": "x"}, {"type": "prompt_embeds", "data": value}]
        response = httpx.post(embeds_server.url + "/v1/chat/completions", timeout=60,
                              json={"messages": [{"role": "user", "content": content}], "max_tokens": 4})
        assert response.status_code == 400, (name, response.text)
        error = response.json()["error"]
        assert error["param"] == "prompt_embeds" and words in error["message"], (name, error)
    assert not marker.exists()  # weights_only: the pickled os.system never ran
    # too big to decode: refused on its length
    response = httpx.post(url, json={"prompt_embeds": "A" * (MAX_LEN * HIDDEN * 6 + 70_000), "max_tokens": 4},
                          timeout=60)
    assert response.status_code == 413 and response.json()["error"]["param"] == "prompt_embeds"
    # prompt and prompt_embeds both; a chat part without data
    response = httpx.post(url, json={"prompt": "hi", "prompt_embeds": b64(rows(0, 2))}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    response = httpx.post(embeds_server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": [{"type": "prompt_embeds"}]}]})
    assert response.status_code == 400 and "data" in response.json()["error"]["message"]
    # and a good request is still answered, as transformers answers it
    model, tok = oracle
    with pytest.raises(openai.BadRequestError) as caught:
        client(embeds_server).completions.create(model="tiny-llama", prompt="", extra_body={"prompt_embeds": "!"})
    assert caught.value.body["param"] == "prompt_embeds"
    good = client(embeds_server).completions.create(model="tiny-llama", prompt="", max_tokens=8, temperature=0,
                                                    extra_body={"prompt_embeds": b64(rows(6, 4)), "ignore_eos": True})
    assert good.choices[0].text == tok.decode(generate(model, rows(6, 4), 8), skip_special_tokens=True)


def test_a_body_past_the_limit_carrying_prompt_embeds_names_them_the_limit_and_bfloat16(oracle):
    """float32 rows past --max-request-bytes got the generic 413 ("send a shorter prompt"): the 413 of a body
    carrying prompt_embeds names them, the limit, the rows that fit in float32 and bfloat16, and the flag;
    the same rows in bfloat16 are then answered as transformers answers them."""
    options = ServeOptions(model="tiny-llama", port=0, slots=2, max_len=MAX_LEN, detectors=CHEAP_DETECTORS,
                           enable_prompt_embeds=True, max_request_bytes=100_000)
    words = ("The request body is larger than this server's limit of 100000 bytes (--max-request-bytes) and carries "
             "prompt_embeds: a row of 64 float32 values is 342 bytes of base64, so about 292 rows fit; send the "
             "tensor as bfloat16 (171 bytes a row, about 584 rows; the server casts it to its dtype) or start the "
             "server with a higher --max-request-bytes")
    big = rows(3, 240)  # twice over as float32: 164 kB of base64, past the limit; once as bfloat16: 41 kB
    model, tok = oracle
    with ServeServer(options) as server:
        url = server.url + "/v1/completions"
        body = json.dumps({"model": "tiny-llama", "prompt_embeds": b64(torch.cat([big, big])), "max_tokens": 4})
        declared = httpx.post(url, content=body.encode(), headers={"content-type": "application/json"}, timeout=60)
        chunked = httpx.post(url, content=iter([body.encode()[i:i + 8192] for i in range(0, len(body), 8192)]),
                             headers={"content-type": "application/json"}, timeout=60)
        content = [{"type": "text", "text": "x" * 3000}, {"type": "prompt_embeds", "data": b64(torch.cat([big, big]))}]
        chat = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": content}], "max_tokens": 4})
        for response in (declared, chunked, chat):
            assert response.status_code == 413, response.text[:300]
            assert response.json() == {"error": {"message": words, "type": "invalid_request_error",
                                                  "param": "prompt_embeds", "code": "request_too_large"}}
        half = client(server).completions.create(model="tiny-llama", prompt="", max_tokens=4, temperature=0,
                                                 extra_body={"prompt_embeds": b64(big.to(torch.bfloat16)),
                                                             "ignore_eos": True})
        plain = httpx.post(url, json={"prompt": "x" * 200_000}, timeout=60)
    assert half.choices[0].text == tok.decode(generate(model, big.to(torch.bfloat16).float(), 4),
                                              skip_special_tokens=True)
    assert plain.status_code == 413 and "prompt_embeds" not in plain.json()["error"]["message"]


def test_without_the_flag_prompt_embeds_get_400_naming_the_flag(oracle):
    options = ServeOptions(model="tiny-llama", port=0, slots=2, max_len=MAX_LEN, detectors=CHEAP_DETECTORS)
    with ServeServer(options) as server:
        c = client(server)
        with pytest.raises(openai.BadRequestError) as caught:
            c.completions.create(model="tiny-llama", prompt="", extra_body={"prompt_embeds": b64(rows(0, 3))})
        assert caught.value.body["param"] == "prompt_embeds"
        assert "--enable-prompt-embeds" in caught.value.body["message"]
        content = [{"type": "text", "text": "x"}, {"type": "prompt_embeds", "data": b64(rows(0, 3))}]
        with pytest.raises(openai.BadRequestError) as caught:
            c.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": content}])
        assert "--enable-prompt-embeds" in caught.value.body["message"]
        # text still served
        assert c.completions.create(model="tiny-llama", prompt="hi", max_tokens=2).choices[0].text is not None
