"""What every HTTP request passes before it reaches a handler: the API key and the body size limit.

- API key (`--api-key`, or the KVTUI_API_KEY environment variable; vLLM's `--api-key` works the same
  way): every path under /v1 needs `Authorization: Bearer <key>`, else 401; /health and /metrics stay
  open, so probes and Prometheus need no key.
- Body size (`--max-request-bytes`): a body past the limit gets 413 before the JSON parser or the
  tokenizer sees it. A declared Content-Length past the limit is refused before a byte of the body is
  read; a chunked body is counted as it arrives and refused at the limit, never held whole.

Both answer in OpenAI's error shape. This is a plain ASGI middleware (a few lines) so that it works
with every FastAPI and Starlette version kvtui supports.
"""

from __future__ import annotations

import secrets

from starlette.datastructures import Headers

from kvtui.serve import DEFAULT_MAX_REQUEST_BYTES
from kvtui.serve.jsonsafe import JSONBody
from kvtui.serve.protocol import ApiError

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "RequestGuard"]


class RequestGuard:
    """ASGI middleware: the API key on /v1/*, then the body size limit (see the module docstring).

    Args:
        app: the ASGI application behind it.
        api_key: the Bearer token /v1/* needs; None or "" leaves the API open.
        max_request_bytes: the most bytes a request body may hold.
    """

    def __init__(self, app, *, api_key: str | None, max_request_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refused = self._refusal(scope, headers)
        if refused is None and headers.get("content-length") is None and scope["method"] in ("POST", "PUT", "PATCH"):
            receive, refused = await self._read_chunked(receive)
        if refused is not None:
            extra = {"www-authenticate": "Bearer"} if refused.status == 401 else None
            await JSONBody(refused.body(), status_code=refused.status, headers=extra)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refusal(self, scope, headers: Headers) -> ApiError | None:
        """The error for a request its headers already refuse: no or a wrong key, a body declared too big."""
        if self.api_key is not None and scope["path"].startswith("/v1"):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.api_key):
                return ApiError(401, "Incorrect or missing API key: send the header `Authorization: Bearer <key>` "
                                "with the key this server was started with (--api-key or KVTUI_API_KEY)",
                                code="invalid_api_key")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_request_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> ApiError:
        return ApiError(413, f"The request body is larger than this server's limit of {self.max_request_bytes} "
                        "bytes (--max-request-bytes); send a shorter prompt or start the server with a higher limit",
                        code="request_too_large")

    async def _read_chunked(self, receive):
        """Read a body of unknown length up to the limit. Returns (a receive that replays it, then goes
        on to the connection's, None) or (receive, the 413 error) once it passes the limit."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                first = message
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_request_bytes:
                return receive, self._too_large()
            if not message.get("more_body", False):
                first = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return first
            return await receive()

        return replay, None
