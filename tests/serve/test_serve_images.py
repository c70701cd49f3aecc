"""`kvtui serve --model tiny-vision`, driven by the official `openai` client: a chat with text and an
image_url part answers what a pipeline of separate instances answers (transformers' tiny-llama, a tiny
Dinov2Model, the same seeded projector, `generate(inputs_embeds=...)`); the same picture re-encoded answers
the same, another picture differently; bad images get 400 naming the part and the server keeps answering;
a text model refuses images.

The oracle's prompt ids: the tokenizer's chat template rendered over one user message whose text holds
"<image>" where the image part is, the rendered text cut at that marker, each side tokenized on its own
without special tokens (kvtui.models.projector.prompt_with_image), one placeholder position between them.
That is what the server's renderer does (kvtui/serve/embeds.py, with its own one-off marker string).
"""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
import torch

from kvtui.models import build_tiny
from kvtui.models.dinov2 import build_tiny_dinov2, image_tensor
from kvtui.models.projector import CANARY_WORDS, SeededProjector, canary_image, prompt_with_image
from kvtui.serve.server import ServeOptions, ServeServer

PIL = pytest.importorskip("PIL", reason="Pillow decodes the pictures: pip install Pillow")
CHEAP_DETECTORS = ("canary", "attention_flow", "slot_taint")
MAX_LEN = 256
N = 10  # tokens asked for


def client(server: ServeServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def data_url(picture, fmt: str = "PNG", **save) -> str:
    """A PIL picture as a data: URL, as a client sends it."""
    buffer = io.BytesIO()
    picture.save(buffer, format=fmt, **save)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def picture(k: int):
    return canary_image(CANARY_WORDS[k], 0, k)


def content(url: str, **extra) -> list[dict]:
    return [{"type": "text", "text": "Describe "}, {"type": "image_url", "image_url": {"url": url}, **extra},
            {"type": "text", "text": " briefly."}]


@pytest.fixture(scope="module")
def oracle():
    """SEPARATE instances: tiny-llama and its tokenizer, a tiny Dinov2Model and the seeded projector, from
    the seeds tiny-vision uses (kvtui/models/vision.py build_tiny_vision)."""
    lm, tok = build_tiny("tiny-llama")
    lm.set_attn_implementation("eager")
    encoder = build_tiny_dinov2()
    projector = SeededProjector(7, in_dim=encoder.config.hidden_size, out_dim=lm.config.hidden_size, tokens=1,
                                row_norm=1.0)
    return lm.eval(), tok, encoder, projector


@torch.inference_mode()
def oracle_answer(oracle, pic, n: int = N) -> tuple[str, int]:
    """transformers' greedy answer to "Describe <image> briefly." with `pic` (a PIL image), and the prompt's
    length in positions."""
    lm, tok, encoder, projector = oracle
    ids, positions = prompt_with_image(tok, "Describe <image> briefly.", 1)
    rows = projector(encoder(pixel_values=image_tensor(pic)[None]).last_hidden_state)[0]  # [1, hidden]
    embeds = lm.get_input_embeddings()(torch.tensor([ids]))[0].clone()
    embeds[positions[0]] = rows[0]
    out = lm.generate(inputs_embeds=embeds[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    new = out[0].tolist()[-n:]
    assert len(new) == n
    return tok.decode(new, skip_special_tokens=True), len(ids)


@pytest.fixture(scope="module")
def vision_server():
    options = ServeOptions(model="tiny-vision", port=0, slots=4, max_len=MAX_LEN)  # default detectors: reference too
    with ServeServer(options) as server:
        yield server


def ask(server, url: str, **extra):
    return client(server).chat.completions.create(
        model="tiny-vision", messages=[{"role": "user", "content": content(url, **extra)}], max_tokens=N,
        temperature=0, extra_body={"ignore_eos": True})


def test_text_and_image_part_equal_the_transformers_pipeline_on_separate_instances(vision_server, oracle):
    seen = []
    submit = vision_server.bridge.submit

    def spy(planned, **kwargs):
        seen.append(planned.input.request_input)  # a served upload: the RequestInput as given
        return submit(planned, **kwargs)

    vision_server.bridge.submit = spy
    try:
        for k in (0, 1):
            expected, length = oracle_answer(oracle, picture(k))
            answer = ask(vision_server, data_url(picture(k)), uuid=f"pic-{k}")
            assert answer.choices[0].message.content == expected, CANARY_WORDS[k]
            assert answer.choices[0].finish_reason == "length"
            assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (length, N)  # the image's position counted
    finally:
        vision_server.bridge.submit = submit
    first = seen[0].images[0]
    ids, positions = prompt_with_image(oracle[1], "Describe <image> briefly.", 1)
    assert (first.start, first.tokens, first.uuid) == (positions[0], 1, "pic-0")
    assert list(seen[0].prompt_ids[:first.start]) == ids[:first.start]
    assert list(seen[0].prompt_ids[first.start + 1:]) == ids[first.start + 1:]
    assert torch.equal(first.pixels, image_tensor(picture(0)))
    # streamed: the same text
    chunks = client(vision_server).chat.completions.create(
        model="tiny-vision", messages=[{"role": "user", "content": content(data_url(picture(0)))}], max_tokens=N,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == oracle_answer(oracle, picture(0))[0]


def test_the_same_picture_re_encoded_answers_the_same_and_another_picture_differently(vision_server, oracle):
    from PIL import Image

    expected = oracle_answer(oracle, picture(2))[0]
    for url in (data_url(picture(2)), data_url(picture(2), compress_level=0), data_url(picture(2), "BMP"),
                data_url(picture(2).convert("RGBA"), "PNG")):
        answer = ask(vision_server, url, )
        assert answer.choices[0].message.content == expected, url[:30]
    # "detail" is taken and ignored
    detailed = client(vision_server).chat.completions.create(
        model="tiny-vision", max_tokens=N, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "text", "text": "Describe "}, {
            "type": "image_url", "image_url": {"url": data_url(picture(2)), "detail": "high"}},
            {"type": "text", "text": " briefly."}]}])
    assert detailed.choices[0].message.content == expected
    # JPEG is lossy: the answer is the pipeline's on the decoded JPEG's pixels
    jpeg = data_url(picture(2), "JPEG", quality=70)
    decoded = Image.open(io.BytesIO(base64.b64decode(jpeg.split(",", 1)[1])))
    assert ask(vision_server, jpeg).choices[0].message.content == oracle_answer(oracle, decoded)[0]
    other = ask(vision_server, data_url(picture(3))).choices[0].message.content
    assert other == oracle_answer(oracle, picture(3))[0] and other != expected


def test_bad_images_get_400_naming_the_part_and_the_server_keeps_answering(vision_server, oracle):
    png = data_url(picture(4))
    raw = base64.b64decode(png.split(",", 1)[1])
    truncated = "data:image/png;base64," + base64.b64encode(raw[: len(raw) // 2]).decode()
    cases = [
        ("http", "http://example.com/cat.png", "fetches nothing over the network"),
        ("https", "https://example.com/cat.png", "fetches nothing over the network"),
        ("garbage base64", "data:image/png;base64,@@@not base64!!", "not valid base64"),
        ("not an image", "data:image/png;base64," + base64.b64encode(b"hello, not a picture").decode(),
         "not a picture"),
        ("truncated", truncated, "could not be decoded as a complete PNG picture"),
        ("svg", "data:image/svg+xml;base64," + base64.b64encode(b"<svg/>").decode(), "not an accepted image type"),
        ("not base64", "data:image/png,rawbytes", "not base64 data"),
    ]
    for name, url, words in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            ask(vision_server, url)
        error = caught.value.body
        assert error["param"] == "messages[0].content[1].image_url.url", (name, error)
        assert words in error["message"] and "data:image/png;base64," in error["message"], (name, error)
    # the part's shape: image_url missing, a uuid that is not a string; the part in the second message
    response = httpx.post(vision_server.url + "/v1/chat/completions", timeout=60, json={"max_tokens": 2, "messages": [
        {"role": "system", "content": "hi"}, {"role": "user", "content": [{"type": "image_url"}]}]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages[1].content[0].image_url"
    with pytest.raises(openai.BadRequestError) as caught:
        ask(vision_server, png, uuid=5)
    assert caught.value.body["param"] == "messages[0].content[1].uuid"
    # too many base64 characters: 413 before decoding (the body limit raised so the image check is reached)
    from kvtui.serve.images import MAX_IMAGE_CHARS, decode_image
    from kvtui.serve.protocol import ApiError

    with pytest.raises(ApiError) as too_big:
        decode_image("data:image/png;base64," + "A" * (MAX_IMAGE_CHARS + 4), "p")
    assert (too_big.value.status, too_big.value.param) == (413, "p")
    # a good request is still answered, as the pipeline answers it
    assert ask(vision_server, png).choices[0].message.content == oracle_answer(oracle, picture(4))[0]


def png_header_only(width: int, height: int) -> str:
    """A data: URL of a PNG that declares width x height (8-bit greyscale) and holds one empty row of data: what
    its header says is all that is read before the size checks."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    raw = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(b"\x00" * (width + 1))) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(raw).decode()


@pytest.mark.parametrize("size, said", [
    ((1, 39_000_000), "1 x 39000000"), ((20_000, 1), "20000 x 1"), ((101, 100), "101 x 100")])
def test_a_picture_past_a_pixel_limit_is_refused_from_its_header_before_decoding(monkeypatch, size, said):
    """A 75 kB PNG of 1 x 39,000,000 pixels (under the 40 M total) cost 12 s of server CPU, holding the GIL so
    /health waited 5 s: each side is bounded too, checked from the header before Pillow decodes a pixel."""
    from PIL import Image, ImageFile

    from kvtui.serve import images
    from kvtui.serve.protocol import ApiError

    if size == (101, 100):  # the total bound, lowered so that a small picture passes it
        monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 100 * 100)
    loads = []
    real_load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: loads.append(self.size) or real_load(self))
    with pytest.raises(ApiError) as caught:
        images.decode_image(png_header_only(*size), "p")
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, "p", "image_too_large")
    assert caught.value.message == (
        f"p is {said} pixels; at most {images.MAX_IMAGE_SIDE} pixels a side and {images.MAX_IMAGE_PIXELS} in all are "
        "taken per picture (it is resized to 224 x 224 anyway): send a smaller picture")
    assert loads == []  # refused from the header: no pixel decoded
    assert images.decode_image(data_url(Image.new("RGB", (100, 100))), "p").size == (100, 100)


def test_a_picture_past_the_side_limit_gets_400_over_http_and_health_stays_up(vision_server):
    response = httpx.post(vision_server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": content(png_header_only(1, 39_000_000))}], "max_tokens": 2})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("messages[0].content[1].image_url.url", "image_too_large")
    assert "1 x 39000000 pixels; at most 16384 pixels a side" in error["message"]
    assert httpx.get(vision_server.url + "/health", timeout=10).status_code == 200


def test_a_text_model_refuses_images_and_names_the_image_model():
    options = ServeOptions(model="tiny-llama", port=0, slots=2, max_len=MAX_LEN, detectors=CHEAP_DETECTORS)
    with ServeServer(options) as server:
        c = client(server)
        with pytest.raises(openai.BadRequestError) as caught:
            c.chat.completions.create(model="tiny-llama", max_tokens=2,
                                      messages=[{"role": "user", "content": content(data_url(picture(0)))}])
        error = caught.value.body
        assert error["param"] == "messages[0].content[1]" and error["code"] == "model_not_supported"
        assert "takes no images" in error["message"] and "kvtui serve --model dinov2-smollm2" in error["message"]
        text = c.chat.completions.create(model="tiny-llama", max_tokens=2,
                                         messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
        assert text.usage.completion_tokens >= 1


@pytest.mark.smollm
def test_dinov2_smollm2_served_answers_each_canary_picture_with_its_word():
    from kvtui.models import ModelLoadError
    from kvtui.models.dinov2 import dinov2_onnx_path

    try:
        dinov2_onnx_path()
    except ModelLoadError as e:
        pytest.skip(str(e))
    options = ServeOptions(model="dinov2-smollm2", port=0, slots=2, max_len=MAX_LEN, detectors=CHEAP_DETECTORS)
    with ServeServer(options) as server:
        for k in (0, 3):
            answer = client(server).chat.completions.create(
                model="dinov2-smollm2", max_tokens=8, temperature=0, messages=[{"role": "user", "content": [
                    {"type": "text", "text": "Repeat the word in the picture: "},
                    {"type": "image_url", "image_url": {"url": data_url(picture(k))}}]}])
            assert CANARY_WORDS[k] in answer.choices[0].message.content.lower(), answer.choices[0].message.content
