"""Every body kvtui serve sends is JSON (RFC 8259), and every error is OpenAI's error shape.

- JSON has no NaN nor infinity. `dumps` refuses them (allow_nan=False) and names the first one's place
  (`choices.0.logprobs.token_logprobs.3`); `JSONBody` (the app's response class) answers a body holding
  one with a JSON 500 `non_finite_output` instead of Starlette's plain-text 500; a stream
  (serve/app.py) ends with an `{"error": ...}` event and `[DONE]`. Whatever the cause (a model or an
  adapter computing NaN), no client ever reads a bare `NaN`.
- `InternalErrors` (ASGI middleware) turns any exception a handler did not turn into an ApiError into a
  JSON 500 `internal_error` for that request alone (one log line; the traceback at debug level), so
  the connection stays open and the server goes on; a stream that already began ends with an error
  event and `[DONE]`.
"""

from __future__ import annotations

import json
import logging
import math

from fastapi.responses import JSONResponse

from kvtui.serve.protocol import ApiError

log = logging.getLogger("kvtui.serve")


class NonFiniteNumber(ValueError):
    """A body to send holds NaN or an infinity at `where` (field names and list indexes, dot-joined)."""

    def __init__(self, where: str, value: float) -> None:
        self.where = where
        self.value = "NaN" if math.isnan(value) else "infinity" if value > 0 else "-infinity"
        super().__init__(f"{self.value} at {where}")

    def error(self) -> ApiError:
        """The JSON error a client gets instead of the body (500: the server computed the number)."""
        return ApiError(500, f"the response would hold {self.value} at {self.where}, which JSON cannot carry: the "
                        "model computed a non-finite number for this request (its weights or an adapter's hold "
                        "or produce NaN or infinity)", code="non_finite_output")


def _first_nonfinite(value, path: tuple = ()) -> tuple[str, float] | None:
    """(dotted place, value) of the first NaN or infinity in a JSON-like value, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return ".".join(str(p) for p in path) or "(the body)", value
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _first_nonfinite(item, (*path, key))
        if found:
            return found
    return None


def dumps(payload) -> str:
    """`payload` as compact JSON (UTF-8 text, not ASCII-escaped).

    Raises:
        NonFiniteNumber: it holds NaN or an infinity (JSON has neither).
    """
    try:
        return json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:
        found = _first_nonfinite(payload)
        if found is None:
            raise
        raise NonFiniteNumber(*found) from None


class JSONBody(JSONResponse):
    """A JSON response that is always JSON: a body holding NaN or an infinity is answered with the JSON
    500 of NonFiniteNumber.error() (status 500) instead, and the place logged."""

    def render(self, content) -> bytes:
        try:
            return dumps(content).encode("utf-8")
        except NonFiniteNumber as e:
            log.error("a response held %s at %s; answered 500 non_finite_output", e.value, e.where)
            error = e.error()
            self.status_code = error.status
            return dumps(error.body()).encode("utf-8")


def internal_error(e: BaseException) -> ApiError:
    """The JSON 500 of an exception no handler expected (its type and first line, no traceback)."""
    first = (str(e).splitlines() or [""])[0][:200]
    return ApiError(500, f"internal error ({type(e).__name__}{': ' + first if first else ''}); this request alone "
                    "failed, the server goes on", code="internal_error")


class InternalErrors:
    """ASGI middleware: an exception that leaves the application becomes that request's JSON 500 (see the
    module docstring), never Starlette's plain-text 500 and a reset connection.

    Args:
        app: the ASGI application inside it.
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = {"start": None, "done": False}

        async def tracked(message) -> None:
            if message["type"] == "http.response.start":
                sent["start"] = message
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                sent["done"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:  # noqa: BLE001 - any failure of one request is that request's 500
            log.error("%s %s: %s: %s (answered 500 internal_error)", scope.get("method"), scope.get("path"),
                      type(e).__name__, e)
            log.debug("traceback", exc_info=True)
            await self._answer(scope, receive, send, sent, internal_error(e))

    @staticmethod
    async def _answer(scope, receive, send, sent: dict, error: ApiError) -> None:
        """The error as the whole response, or (a stream already begun) its last event; nothing once the
        response ended."""
        if sent["done"]:
            return
        body = dumps(error.body())
        if sent["start"] is None:
            await JSONBody(error.body(), status_code=error.status)(scope, receive, send)
            return
        headers = dict(sent["start"].get("headers") or [])
        if headers.get(b"content-type", b"").startswith(b"text/event-stream"):  # a stream: its error event
            await send({"type": "http.response.body", "body": f"data: {body}\n\ndata: [DONE]\n\n".encode(),
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
