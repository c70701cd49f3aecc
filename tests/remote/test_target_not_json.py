"""A target that does not answer JSON: every command that takes a server's URL (run --target and its
--reference-target, audit --target, audit --timing --target, conformance --target) refuses it with the same
one line and exit 2 before anything slow; a later answer that is not JSON (a 200 text/html page where a
stream or a JSON body was due) fails its own request with a line naming the endpoint, status and content
type, never a JSONDecodeError, and the run goes on."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fake_openai import FakeHTTPServer, FakeOpenAI, PageServer
from typer.testing import CliRunner

from kvtui.cli import app
from kvtui.models import build_tiny_tokenizer
from kvtui.remote.openai import CHAT_PATH, StreamResult, stream_request
from kvtui.remote.reach import TargetError, json_body
from kvtui.remote.session import TargetOptions, TargetSession
from kvtui.scenario import parse_scenario, plan_requests

TOK = build_tiny_tokenizer()
START = "'<!DOCTYPE html> <html><head><title>Not Found</title></head>…'"  # PAGE on one line, cut to 60 characters
SCENARIO = ("name: not-json\nseed: 3\nmax_requests: 3\nmodel: tiny-llama\narrivals: {process: burst, size: 3, "
            "every_s: 9}\nprompts: {kind: passphrase}\noutput_tokens: 6\nsampling: {temperature: 0.0}\n")


def wrong_url_line(url: str, status: int) -> str:
    if status == 404:
        return (f"error: {url}/v1/models answered 404 Not Found (text/html), not JSON: {START}: is {url} the "
                "server's base URL? Give http://HOST:PORT (kvtui adds /v1/...), or name the model with --served-model "
                "if the server has no /v1/models")
    return (f"error: {url}/v1/models answered {status} OK (text/html), not JSON: {START}: is {url} an "
            "OpenAI-compatible server's base URL? Give http://HOST:PORT (kvtui adds /v1/...)")


COMMANDS = {
    "run": lambda s, page, good: ["run", s, "--target", page, "--headless"],
    "run --reference-target": lambda s, page, good: ["run", s, "--target", good, "--reference-target", page,
                                                     "--headless"],
    "audit": lambda s, page, good: ["audit", s, "--target", page],
    "audit --timing": lambda s, page, good: ["audit", s, "--timing", "--target", page],
    "conformance": lambda s, page, good: ["conformance", "--target", page, "--model", "tiny-llama"],
}


@pytest.mark.parametrize("status", [404, 200])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_target_command_refuses_a_server_that_does_not_answer_json_in_one_line(tmp_path, command, status):
    path = tmp_path / "s.yaml"
    path.write_text(SCENARIO)
    fake = FakeOpenAI()
    with PageServer(status) as page, FakeHTTPServer(fake) as good:
        result = CliRunner().invoke(app, COMMANDS[command](str(path), page, good))
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [wrong_url_line(page, status)]
    assert fake.requests == []  # refused before any request was sent


def test_a_later_page_instead_of_a_stream_fails_that_request_alone_and_says_what_came():
    spec = parse_scenario(SCENARIO)
    phrases = [p.passphrase for p in plan_requests(spec, TOK)]
    fake = FakeOpenAI(html=(phrases[0],))
    session = TargetSession(spec, TOK, TargetOptions(url="http://fake", transport=fake.transport()),
                            detectors=("canary",))
    summary = session.run()
    errors = {r.error for r in session.results.values() if r.finish_reason == "error"}
    assert errors == {f"POST {CHAT_PATH} answered 200 OK (text/html), not a stream of server-sent events: {START}"}
    assert summary.finish_reasons == {"error": 1, "stop": 2}


def test_a_stream_event_that_is_not_json_fails_its_request_with_its_start():
    fake = FakeOpenAI(html=("ALPHA-BRAVO-01",), html_as="event")

    async def send() -> StreamResult:
        async with httpx.AsyncClient(base_url="http://fake", transport=fake.transport()) as client:
            body = {"messages": [{"role": "user", "content": "say ALPHA-BRAVO-01"}], "stream": True}
            return await stream_request(client, CHAT_PATH, body, timeout_s=5)

    result = asyncio.run(send())
    # the page's first line is the event's data (an SSE data line ends at its newline)
    assert (result.finish_reason, result.error) == ("error", "a stream event that is not JSON: '<!DOCTYPE html>'")


def test_a_json_answer_that_is_a_page_names_the_request_status_and_type():
    page = httpx.Response(502, headers={"content-type": "text/html"}, text="<html><body>Bad Gateway</body></html>",
                          request=httpx.Request("POST", "http://host:8000/v1/chat/completions"))
    with pytest.raises(TargetError) as caught:
        json_body(page)
    assert str(caught.value) == ("POST http://host:8000/v1/chat/completions answered 502 Bad Gateway (text/html), "
                                 "not JSON: '<html><body>Bad Gateway</body></html>'")
