"""Which server and release a conformance run was against (kvtui/remote/identity.py), as the servers say it.

The answers below are the servers' own, as measured: vLLM CPU 0.32.0's `GET /version` and `server: uvicorn`;
llama-server (commit 0c1e57098, built by scripts/build-llama-server.sh) `GET /props` with `build_info` and
`Server: llama.cpp`, a 404 for /version; transformers serve lists the model's owner in owned_by and has neither
endpoint, so its release comes from the install kvtui started it from. A release the user gives
(--server-release) is taken whole, and what the server says beside it is noted. The whole-command tests
(tests/remote/test_conformance_servers.py, tests/conformance/test_conformance.py) check the `server` entry of
`--json` against the real servers.
"""

from __future__ import annotations

import httpx

from kvtui.remote.identity import identify


def transport(routes: dict[str, tuple[int, dict]], server: str) -> httpx.MockTransport:
    """A server answering `routes` (path -> (status, JSON)) and 404 elsewhere, with this `server` header."""
    def handle(request: httpx.Request) -> httpx.Response:
        status, body = routes.get(request.url.path, (404, {"error": "not found"}))
        return httpx.Response(status, json=body, headers={"server": server} if server else {})

    return httpx.MockTransport(handle)


def test_vllm_says_its_release_at_version():
    found = identify("http://h:1", "vllm", transport=transport({"/version": (200, {"version": "0.32.0"})}, "uvicorn"))
    assert (found.name, found.version) == ("vLLM", "0.32.0")
    assert found.source == "name: /v1/models owned_by; version: GET /version" and found.server_header == "uvicorn"
    assert found.line == "vLLM 0.32.0"


def test_llama_server_says_its_build_in_props():
    routes = {"/props": (200, {"build_info": "b0-0c1e57098", "total_slots": 4})}
    found = identify("http://h:1", "llamacpp", transport=transport(routes, "llama.cpp"))
    assert (found.name, found.version, found.server_header) == ("llama.cpp", "b0-0c1e57098", "llama.cpp")
    assert found.source == "name: GET /props; version: GET /props build_info"


def test_a_server_that_says_nothing_takes_the_release_kvtui_started_and_the_http_library_is_no_name():
    silent = transport({}, "uvicorn")
    assert identify("http://h:1", "HuggingFaceTB", transport=silent).as_dict() == {
        "name": None, "version": None, "source": "nothing said", "server_header": "uvicorn"}
    found = identify("http://h:1", "HuggingFaceTB", known=("transformers-serve", "5.25.0"), transport=silent)
    assert (found.name, found.version) == ("transformers-serve", "5.25.0")
    assert found.source == "name: the install kvtui started; version: the install kvtui started"
    # the server's own word wins over the caller's; a server header that names a server is a name
    named = identify("http://h:1", None, known=("x", "9"), transport=transport({"/version": (200, {"version": "1.2"})},
                                                                                "sglang/0.5"))
    assert (named.name, named.version) == ("sglang/0.5", "1.2")


def test_an_unreachable_server_is_not_identified_and_does_not_raise():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    found = identify("http://h:1", None, transport=httpx.MockTransport(refuse))
    assert (found.name, found.version, found.line) == (None, None, "server not identified")


def test_a_release_the_user_gives_is_taken_whole_and_what_the_server_says_is_noted():
    kvtui_serve = transport({"/version": (200, {"version": "0.9.1"})}, "uvicorn")
    found = identify("http://h:1", "kvtui", release=("vllm", "0.9.1"), transport=kvtui_serve)
    assert found.as_dict() == {"name": "vllm", "version": "0.9.1", "server_header": "uvicorn",
                               "source": "name and version: --server-release (the server says kvtui 0.9.1)"}
    # the server agrees (case aside): nothing to note
    agrees = identify("http://h:1", "vllm", release=("VLLM", "0.9.1"), transport=kvtui_serve)
    assert (agrees.name, agrees.version, agrees.source) == ("VLLM", "0.9.1", "name and version: --server-release")
    # the server says neither: nothing to note, and the user's release is no fallback but the answer
    silent = identify("http://h:1", "HuggingFaceTB", release=("transformers-serve", "5.25.0"),
                      transport=transport({}, "uvicorn"))
    assert (silent.line, silent.source) == ("transformers-serve 5.25.0", "name and version: --server-release")
    # only the version differs
    older = identify("http://h:1", "vllm", release=("vLLM", "0.8.0"), transport=kvtui_serve)
    assert older.source == "name and version: --server-release (the server says vLLM 0.9.1)"
