"""Which server answered, and which release: recorded with a conformance run (`kvtui conformance --json`) so
that two runs of the same checks, on two releases or two servers, can be told apart and compared.

A server says its name and release in one of a few places; `identify` asks them in this order and keeps
the first that answers, naming where each part came from:

- `GET /version` -> `{"version": "0.32.0"}` (vLLM);
- `GET /props` -> `build_info` (llama-server: `b<build>-<commit>`, e.g. `b0-0c1e57098` for a source build);
- the `server` response header when it names the server (`llama.cpp`), not the HTTP library under it
  (`uvicorn`, `hypercorn`);
- `/v1/models`' `owned_by` (kvtui.remote.session.SERVER_KINDS: vllm, llamacpp, sglang, kvtui) for the name;
- what the caller knows (`known`): the package of a `kvtui serve` this process started, or the pinned
  install a server was started from (its venv's release), for a server that says neither (transformers
  serve lists the model's owner in `owned_by` and has no version endpoint).

A release the user gives (`release`: `kvtui conformance --server-release 'NAME VERSION'`) is not asked
about: name and version are the user's, and `source` adds what the server itself says where that differs
(`name and version: --server-release (the server says kvtui 0.9.1)`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import httpx

# `server` header values that name the HTTP library, not the inference server
HTTP_LIBRARIES = ("uvicorn", "hypercorn", "gunicorn", "werkzeug", "aiohttp")


@dataclass(frozen=True)
class ServerIdentity:
    """A server's name and release as far as it (or the caller) says them.

    Attributes:
        name: e.g. "vLLM", "llama.cpp", "kvtui", "transformers serve"; None when nothing says it.
        version: e.g. "0.32.0", "b0-0c1e57098"; None when nothing says it.
        source: where each came from, e.g. "name: /v1/models owned_by; version: GET /version".
        server_header: the raw `server` response header ("" when absent).
    """

    name: str | None
    version: str | None
    source: str
    server_header: str = ""

    def as_dict(self) -> dict:
        """The identity as a JSON object (the `server` entry of `kvtui conformance --json`)."""
        return asdict(self)

    @property
    def line(self) -> str:
        """'vLLM 0.32.0', 'llama.cpp b0-0c1e57098', or 'server not identified'."""
        text = " ".join(part for part in (self.name, self.version) if part)
        return text or "server not identified"


def _json(response: httpx.Response) -> dict:
    try:
        data = response.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def identify(url: str, owned_by: str | None = None, known: tuple[str, str] | None = None,
             timeout_s: float = 10.0, transport: httpx.BaseTransport | None = None, *,
             release: tuple[str, str] | None = None) -> ServerIdentity:
    """Ask the server at `url` for its name and release (the module's order); never raises.

    Args:
        url: the server's base URL (http://HOST:PORT).
        owned_by: its /v1/models' first entry's `owned_by` (None: not asked).
        known: (name, version) the caller knows (the kvtui package it serves with, a pinned install): used
            for what the server does not say itself.
        timeout_s: each GET's limit (seconds). transport: an httpx transport (tests).
        release: (name, version) the user gave (--server-release): taken over whatever the server says, and
            `source` notes what the server says where it differs (name or version, case aside).
    """
    said = _asked(url, owned_by, known if release is None else None, timeout_s, transport)
    if release is None:
        return said
    pairs = [(mine, theirs) for mine, theirs in zip(release, (said.name, said.version)) if theirs is not None]
    note = (f" (the server says {said.line})"
            if any(mine.casefold() != theirs.casefold() for mine, theirs in pairs) else "")
    return ServerIdentity(release[0], release[1], f"name and version: --server-release{note}", said.server_header)


def _asked(url: str, owned_by: str | None, known: tuple[str, str] | None, timeout_s: float,
           transport: httpx.BaseTransport | None) -> ServerIdentity:
    """What the server says (the module's order), the caller's `known` filling what it does not."""
    from kvtui.remote.session import SERVER_KINDS

    name = version = None
    name_from = version_from = ""
    header = ""
    try:
        with httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s, transport=transport) as client:
            for path in ("/version", "/props"):
                try:
                    response = client.get(path)
                except httpx.HTTPError:
                    continue
                header = header or response.headers.get("server", "")
                if response.status_code != 200:
                    continue
                data = _json(response)
                if path == "/version" and isinstance(data.get("version"), str):
                    version, version_from = data["version"], "GET /version"
                    break
                if path == "/props" and isinstance(data.get("build_info"), str):
                    version, version_from = data["build_info"], "GET /props build_info"
                    name, name_from = "llama.cpp", "GET /props"
                    break
    except httpx.HTTPError:
        pass
    if name is None and owned_by in SERVER_KINDS:
        name, name_from = SERVER_KINDS[owned_by], "/v1/models owned_by"
    if name is None and header and header.split("/")[0].lower() not in HTTP_LIBRARIES:
        name, name_from = header, "server header"
    if known is not None:
        if name is None:
            name, name_from = known[0], "the install kvtui started"
        if version is None:
            version, version_from = known[1], "the install kvtui started"
    source = "; ".join(f"{part}: {where}" for part, where in (("name", name_from), ("version", version_from)) if where)
    return ServerIdentity(name, version, source or "nothing said", header)
