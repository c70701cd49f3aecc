"""The first contact with a target server, and the one wording for an answer kvtui cannot read as JSON.

Every command that takes a server's URL (`kvtui run --target` and its `--reference-target`, `kvtui audit
--target`, `kvtui audit --timing --target`, `kvtui conformance --target`) asks GET /v1/models through
`first_model` (or `probe`, its blocking form) before anything slow is set up or any request is sent, so an
unreachable URL, a wrong base URL (a 404 page) or a server that does not answer JSON is refused with the
same one line (`TargetError`; the CLI exits 2). A later answer read whole as JSON goes through `json_body`,
and a stream that carries no JSON events is a `BadAnswer` naming the endpoint, status and content type
(never a JSONDecodeError's "Expecting value: line 1 column 1").
"""

from __future__ import annotations

import asyncio
import json

import httpx

try:  # a dependency; an install from before it was one reads JSON with the standard library
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the install
    _orjson = None


class TargetError(Exception):
    """The target cannot be used at all (unreachable, not an HTTP server, not answering JSON). One line for
    the user."""


class BadAnswer(ValueError):
    """One answer of a server that kvtui cannot read (not JSON, not a stream of JSON events, an error event):
    the request it belongs to fails with this message; the run goes on."""


def excerpt(text: str, limit: int = 60) -> str:
    """`text` on one line, cut to `limit` characters, quoted (what the start of an answer was)."""
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= limit else flat[: limit - 1] + "…")


def _text(payload: bytes | str) -> str:
    """A stream line's bytes as the text they were read as before (UTF-8, undecodable bytes replaced)."""
    return payload.decode("utf-8", "replace").strip() if isinstance(payload, bytes) else payload


def content_type(response: httpx.Response) -> str:
    """The answer's media type without parameters ("text/html"), or "no content type"."""
    return response.headers.get("content-type", "").split(";")[0].strip() or "no content type"


def answered(response: httpx.Response, body: str | None = None, instead: str = "not JSON") -> str:
    """`answered 404 Not Found (text/html), not JSON: '<!DOCTYPE html>…'`: what came back instead of JSON.
    `body`: the answer's text when it was read already (a stream); else the response's own text. `instead`:
    what it is not ("not a stream of server-sent events" for a stream)."""
    text = response.text if body is None else body
    start = f": {excerpt(text)}" if text.strip() else " (empty)"
    return f"answered {response.status_code} {response.reason_phrase} ({content_type(response)}), {instead}{start}"


def is_json(response: httpx.Response) -> bool:
    """Whether the answer's body parses as JSON."""
    try:
        response.json()
    except ValueError:
        return False
    return True


def json_body(response: httpx.Response) -> object:
    """The answer's JSON.

    Raises:
        TargetError: it is not JSON; the message names the request (method and URL), status and content type.
    """
    try:
        return response.json()
    except ValueError:
        request = response.request
        raise TargetError(f"{request.method} {request.url} {answered(response)}") from None


def models_error(response: httpx.Response, url: str, served_model: str | None) -> str | None:
    """The one line for a /v1/models answer no run can start from, else None: a 404 when no model is named
    (a wrong base URL), or any answer that is not JSON."""
    where = f"{url}/v1/models"
    if response.status_code == 404 and served_model is None:
        said = "answered 404 Not Found" if is_json(response) else answered(response)
        return (f"{where} {said}: is {url} the server's base URL? Give http://HOST:PORT (kvtui adds /v1/...), "
                "or name the model with --served-model if the server has no /v1/models")
    if response.status_code == 404 or is_json(response):
        return None
    return (f"{where} {answered(response)}: is {url} an OpenAI-compatible server's base URL? Give "
            "http://HOST:PORT (kvtui adds /v1/...)")


def listed_first(response: httpx.Response) -> dict:
    """The first entry of a /v1/models answer ({} when it lists none or answers otherwise)."""
    try:
        first = response.json()["data"][0] if response.status_code == 200 else {}
    except (ValueError, KeyError, IndexError, TypeError):
        first = {}
    return first if isinstance(first, dict) else {}


async def first_model(client: httpx.AsyncClient, url: str, served_model: str | None,
                      flag: str = "--target") -> dict:
    """The first entry of the server's /v1/models ({} when it lists none, or has no /v1/models and a
    served model is named).

    Args:
        client: a client whose base URL is `url`. url: the server's base URL (for the message).
        served_model: the model the user named (--served-model), or None. flag: the option that gave `url`.

    Raises:
        TargetError: the server cannot be reached, /v1/models is not found and no served model is named (the
            URL is probably not the server's base URL), or it does not answer JSON (models_error).
    """
    try:
        response = await client.get("/v1/models", timeout=10.0)
    except httpx.HTTPError as e:
        raise TargetError(f"cannot reach {url} ({type(e).__name__}: {e}); "
                          f"check {flag} (http://HOST:PORT) and that the server is up") from None
    problem = models_error(response, url, served_model)
    if problem is not None:
        raise TargetError(problem)
    return listed_first(response)


def probe(url: str, served_model: str | None = None, *, transport: httpx.AsyncBaseTransport | None = None,
          flag: str = "--target") -> dict:
    """first_model from blocking code (a fresh client and event loop): the check every command makes before
    anything slow.

    Raises:
        TargetError: as first_model.
    """
    async def ask() -> dict:
        async with httpx.AsyncClient(base_url=url.rstrip("/"), transport=transport) as client:
            return await first_model(client, url, served_model, flag)

    return asyncio.run(ask())


def loads(payload: bytes | str):
    """JSON text (str, or UTF-8 bytes) as json.loads reads it, through orjson where orjson takes it (several
    times faster). What orjson refuses goes to the standard library, which reads NaN, Infinity, integers
    past 64 bits and lone surrogates, and gets bytes decoded as text with undecodable bytes replaced and
    whitespace stripped (what a stream line decoded as text gave before).

    Raises:
        ValueError: it is not JSON (json.JSONDecodeError).
    """
    if _orjson is not None:
        try:
            return _orjson.loads(payload)
        except _orjson.JSONDecodeError:
            pass
    if isinstance(payload, bytes):
        payload = payload.decode("utf-8", "replace").strip()
    return json.loads(payload)


def stream_event(payload: bytes | str) -> dict:
    """One server-sent event's data (what follows `data:`, stripped) as a JSON object.

    Raises:
        BadAnswer: it is not a JSON object, or it is an error event (`{"error": ...}` without choices).
    """
    try:
        data = loads(payload)
    except ValueError:
        raise BadAnswer(f"a stream event that is not JSON: {excerpt(_text(payload))}") from None
    if not isinstance(data, dict):
        raise BadAnswer(f"a stream event that is not a JSON object: {excerpt(_text(payload))}")
    if "error" in data and not data.get("choices"):
        raise BadAnswer(f"server error in stream: {json.dumps(data['error'])[:300]}")
    return data
