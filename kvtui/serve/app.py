"""The FastAPI application: OpenAI's completions and chat completions, /v1/models, /health, /metrics.

Every error is OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 400 bad parameters
(FastAPI's own 422 validation errors included), 400 `context_length_exceeded`, 404 unknown model or
path, 429 waiting queue full, 503 while the model loads or the server stops.

A client that disconnects, streaming or not, aborts its request: the engine frees its slot at the
next step boundary.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import secrets
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtui.engine.block_manager import salt_digest
from kvtui.events import Finish
from kvtui.scenario.prompts import chat_ids, encode_text
from kvtui.serve.bridge import Closed, EngineBridge, NotAccepting, RequestStream, TokenOut
from kvtui.serve.detok import TextStream
from kvtui.serve.metrics import CONTENT_TYPE, ServeMetrics
from kvtui.serve.protocol import ApiError, ChatCompletionRequest, CompletionRequest, sampling_params
from kvtui.serve.responses import Formatter, sse

# A passphrase as kvtui's passphrase prompts make them (WORD-WORD-NN): found in a prompt, it becomes
# the request's canary, so the canary detector can see it leak into another client's answer.
PASSPHRASE = re.compile(r"\b[A-Z]+-[A-Z]+-\d{2}\b")
_serial = itertools.count(1)  # request ids: a serial (unique in the process) and a random tail, short for the dashboard


@dataclass
class ServeContext:
    """What the handlers need once the model is loaded.

    Attributes:
        bridge: the route into the engine thread; metrics: the server's Prometheus metrics.
        tokenizer: the model's; max_len: tokens one request may hold (prompt + completion).
        model_name: the served name (`model` in requests and responses); model_id: kvtui's model id.
    """

    bridge: EngineBridge
    metrics: ServeMetrics
    tokenizer: object
    max_len: int
    model_name: str
    model_id: str


class ServerState:
    """Holds the context once loaded (None while loading, so requests get 503)."""

    def __init__(self) -> None:
        self.context: ServeContext | None = None

    def ready(self) -> ServeContext:
        """Raises ApiError 503 while the model loads."""
        if self.context is None:
            raise ApiError(503, "the model is loading; retry in a few seconds", code="model_loading")
        return self.context


class ClientGone(Exception):
    """The client closed its connection."""


def create_app(state: ServerState) -> FastAPI:
    """The application; `state.context` is set by the server once the model is loaded."""
    app = FastAPI(title="kvtui serve", docs_url=None, redoc_url=None, openapi_url=None)
    _error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        state.ready()
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict:
        ctx = state.ready()
        return {"object": "list", "data": [{"id": ctx.model_name, "object": "model", "created": 0,
                                            "owned_by": "kvtui", "root": ctx.model_id, "max_model_len": ctx.max_len}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.ready().metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        ctx = state.ready()
        body.check()
        prompt = body.single_prompt()
        text = prompt if isinstance(prompt, str) else None
        ids = encode_text(ctx.tokenizer, prompt) if text is not None else [int(t) for t in prompt]
        return await _serve(ctx, request, body, ids, text, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        ctx = state.ready()
        body.check()
        messages = body.chat()
        ids = chat_ids(ctx.tokenizer, messages)
        last_user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        return await _serve(ctx, request, body, ids, last_user, chat=True)

    return app


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = loc[0] if loc else None
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return JSONResponse(ApiError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)


async def _serve(ctx: ServeContext, request: Request, body, prompt_ids: list[int], prompt_text: str | None, *,
                 chat: bool) -> Response:
    """Submit one request and answer it, streamed or whole."""
    if body.model is not None and body.model not in (ctx.model_name, ctx.model_id):
        raise ApiError(404, f"The model `{body.model}` does not exist; this server serves `{ctx.model_name}`",
                       param="model", code="model_not_found")
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty", param="messages" if chat else "prompt")
    sampling = sampling_params(body, prompt_len=len(prompt_ids), max_len=ctx.max_len,
                               endpoint="chat" if chat else "completion")
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{next(_serial)}-{secrets.token_hex(3)}"
    metadata = {"prompt_text": prompt_text} if prompt_text is not None else {}
    found = PASSPHRASE.search(prompt_text or "")
    if found:
        metadata["passphrase"] = found.group(0)
    if body.user:
        metadata["user"] = body.user
    try:
        stream = ctx.bridge.submit(request_id, prompt_ids, sampling, metadata, tenant=_tenant(body),
                                   cache_salt=body.cache_salt)
    except NotAccepting:
        raise ApiError(503, "the server is not taking requests (loading or stopping)", code="unavailable") from None
    formatter = Formatter(chat=chat, request_id=request_id, model=ctx.model_name, tokenizer=ctx.tokenizer,
                          top_k=sampling.logprobs)
    listener = asyncio.ensure_future(_wait_disconnect(request))
    try:
        first = await _next(stream, listener)
        _check_admitted(first)
        if body.stream:
            text = TextStream(ctx.tokenizer, sampling.stop, sampling.include_stop_str_in_output)
            events = _stream(ctx, stream, first, formatter, text, include_usage=body.include_usage())
            return StreamingResponse(events, media_type="text/event-stream",
                                     background=BackgroundTask(ctx.bridge.abort, request_id))
        return JSONResponse(await _whole(stream, first, formatter, listener))
    except ClientGone:
        ctx.bridge.abort(request_id)
        return Response(status_code=499)
    except BaseException:
        ctx.bridge.abort(request_id)
        raise
    finally:
        listener.cancel()


def _tenant(body) -> str | None:
    """Who sent a request, for the prefix cache's provenance: OpenAI's `user`, else its salt's digest."""
    if body.user:
        return body.user
    return f"salt-{salt_digest(body.cache_salt)}" if body.cache_salt else None


async def _wait_disconnect(request: Request) -> None:
    """Returns once the client disconnects (the body was read already, so receive() waits for that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _next(stream: RequestStream, listener: asyncio.Future):
    """The request's next item, or ClientGone if the client disconnects first."""
    get = asyncio.ensure_future(stream.queue.get())
    done, _ = await asyncio.wait({get, listener}, return_when=asyncio.FIRST_COMPLETED)
    if get in done:
        return get.result()
    get.cancel()
    raise ClientGone()


def _check_admitted(first) -> None:
    """Raises ApiError when the engine refused the request (queue full: 429) or never took it (503)."""
    if isinstance(first, Closed):
        raise ApiError(503, "the server stopped before the request started", code="unavailable")
    if isinstance(first, Finish) and first.finish_reason == "rejected":
        if "queue full" in first.detail:
            raise ApiError(429, f"the engine's {first.detail}; retry later", code="rate_limit_exceeded")
        raise ApiError(400, f"request rejected: {first.detail}", code="context_length_exceeded")


async def _whole(stream: RequestStream, item, formatter: Formatter, listener: asyncio.Future) -> dict:
    entries = []
    while isinstance(item, TokenOut):
        if item.logprobs:
            entries.append(item.logprobs)
        item = await _next(stream, listener)
    if isinstance(item, Closed):
        raise ApiError(503, "the server stopped before the request finished", code="unavailable")
    return formatter.whole(item.output_text, entries, item.finish_reason, len(item.prompt_ids), len(item.output_ids),
                           stream.cached_tokens)


async def _stream(ctx: ServeContext, stream: RequestStream, item, formatter: Formatter, text: TextStream, *,
                  include_usage: bool):
    """The server-sent events of a streamed response; a client that goes away aborts the request."""
    finished = False
    try:
        if formatter.chat:
            yield sse(formatter.role_chunk())
        while True:
            if isinstance(item, TokenOut):
                delta, entries = text.add(item.token_id), [item.logprobs] if item.logprobs else []
                if delta or entries:
                    yield sse(formatter.chunk(delta, entries))
            else:
                finished = True
                done = item if isinstance(item, Finish) else None
                rest = text.finish(done.output_text) if done else ""
                yield sse(formatter.chunk(rest, [], done.finish_reason if done else "abort"))
                if include_usage and done:
                    yield sse(formatter.usage_chunk(len(done.prompt_ids), len(done.output_ids), stream.cached_tokens))
                break
            item = await stream.queue.get()
        yield sse("[DONE]")
    finally:
        if not finished:
            ctx.bridge.abort(stream.request_id)
