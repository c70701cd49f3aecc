"""What every HTTP request passes before it reaches a handler: the API key and the body size limit.

- API key (`--api-key`, or the KVTUI_API_KEY environment variable; vLLM's `--api-key` works the same
  way): every path under /v1 needs `Authorization: Bearer <key>`, else 401; /health, /version and /metrics
  stay open, so probes and Prometheus need no key.
- Body size (`--max-request-bytes`): a body past the limit gets 413 before the JSON parser or the
  tokenizer sees it. A declared Content-Length past the limit is refused after at most its first
  PEEK_BYTES are read; a chunked body is counted as it arrives and refused at the limit, never held whole.
  Where those first bytes carry prompt embeddings (`"prompt_embeds"`: completions' field or a chat
  part's type), the 413 names them, the rows that fit as float32 and as bfloat16, and the flag: float32
  rows are the usual way past the limit, and bfloat16 halves them.

Both answer in OpenAI's error shape. This is a plain ASGI middleware (a few lines) so that it works
with every FastAPI and Starlette version kvtui supports.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable

from starlette.datastructures import Headers

from kvtui.serve import DEFAULT_MAX_REQUEST_BYTES
from kvtui.serve.jsonsafe import JSONBody
from kvtui.serve.protocol import ApiError

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "RequestGuard"]

PEEK_BYTES = 64 * 1024  # of a body declared too big, read to see whether it carries prompt embeddings
EMBEDS_MARK = re.compile(rb'(?<!\\)"prompt_embeds"')  # the field or the part type, not text quoting it


class RequestGuard:
    """ASGI middleware: the API key on /v1/*, then the body size limit (see the module docstring).

    Args:
        app: the ASGI application behind it.
        api_key: the Bearer token /v1/* needs; None or "" leaves the API open.
        max_request_bytes: the most bytes a request body may hold.
        embeds_width: the served model's prompt-embedding row width (its hidden size), or None where the model
            is loading or takes no prompt embeddings (asked when a body too big carries them).
    """

    def __init__(self, app, *, api_key: str | None, max_request_bytes: int,
                 embeds_width: Callable[[], int | None] = lambda: None) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_request_bytes = max_request_bytes
        self.embeds_width = embeds_width

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refused = self._refusal(scope, headers)
        if refused is None and headers.get("content-length") is None and scope["method"] in ("POST", "PUT", "PATCH"):
            receive, refused = await self._read_chunked(receive)
        elif refused is not None and refused.status == 413:
            refused = self._too_large(await _peek(receive))
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

    def _too_large(self, start: bytes = b"") -> ApiError:
        """The 413; `start`: the body's first bytes read (PEEK_BYTES at most), which may show prompt embeddings."""
        limit = f"The request body is larger than this server's limit of {self.max_request_bytes} bytes (--max-request-bytes)"
        if EMBEDS_MARK.search(start[:PEEK_BYTES]) is None:
            return ApiError(413, f"{limit}; send a shorter prompt or start the server with a higher limit",
                            code="request_too_large")
        width = self.embeds_width()
        if width:
            row32, row16 = -(-width * 16 // 3), -(-width * 8 // 3)  # base64 bytes of a row: 4 chars per 3 bytes
            fit = (f"a row of {width} float32 values is {row32} bytes of base64, so about "
                   f"{self.max_request_bytes // row32} rows fit; send the tensor as bfloat16 ({row16} bytes a row, "
                   f"about {self.max_request_bytes // row16} rows; the server casts it to its dtype)")
        else:
            fit = "send the tensor as bfloat16 (half the bytes of float32; the server casts it to its dtype)"
        return ApiError(413, f"{limit} and carries prompt_embeds: {fit} or start the server with a higher "
                        "--max-request-bytes", param="prompt_embeds", code="request_too_large")

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
                return receive, self._too_large(b"".join(chunks)[:PEEK_BYTES])
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


async def _peek(receive) -> bytes:
    """The first PEEK_BYTES (or fewer: the body's end, or the client left) of a request body, read and kept."""
    start = b""
    while len(start) < PEEK_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            break
        start += message.get("body", b"")
        if not message.get("more_body", False):
            break
    return start[:PEEK_BYTES]
