"""The FastAPI application: OpenAI's completions and chat completions, /v1/models and /v1/models/{id},
/health, /version (kvtui's release, vLLM's shape), /metrics, and for a speech model
/v1/audio/transcriptions (serve/transcribe.py; the text endpoints then answer 400). LoRA adapters (serve/lora.py): a request's `model` names the adapter it runs under, and
with runtime LoRA updating /v1/load_lora_adapter and /v1/unload_lora_adapter load and unload them. A /v1/completions list of prompts runs one engine request per prompt, read as one
(serve/fanout.py).

Every error is OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 400 bad parameters
(FastAPI's own 422 validation errors included; unparsable JSON and a body that is no object with `param`
null, as OpenAI and vLLM answer), 400 `context_length_exceeded`,
400 `out_of_vocabulary`, 400 `invalid_logit_bias`, 401 `invalid_api_key`, 404 unknown path, 404 unknown model
(vLLM's body: type NotFoundError, code 404), 413 `request_too_large`,
429 waiting queue full, 500 `internal_error` (the request alone failed inside the engine), 503 while
the model loads or the server stops. The engine's rejections and errors reach HTTP by their
FinishCode (ENGINE_ERRORS), never by their text. A request that fails after its stream began ends
with an `{"error": ...}` event, then `[DONE]`, as vLLM streams its errors.

Tokenizing and chat templating run in a small thread pool (TOKENIZE_WORKERS), never on the event
loop, so a long prompt delays only its own request, never /health or other clients' streams.

A client that disconnects, streaming or not, aborts its request: the engine frees its slot at the
next step boundary.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtui import __version__
from kvtui.engine.block_manager import salt_digest
from kvtui.events import Finish
from kvtui.request import Canary, GivenInput, InputSpec, PlannedRequest, TokenPrompt
from kvtui.scenario.prompts import chat_ids, encode_text
from kvtui.serve.bridge import Closed, EngineBridge, NotAccepting, TokenOut
from kvtui.serve.detok import TextStream
from kvtui.serve.embeds import ENABLE_HINT, EmbedsSpec, chat_input, completion_input, has_embeds
from kvtui.serve.fanout import Choices
from kvtui.serve.guard import DEFAULT_MAX_REQUEST_BYTES, RequestGuard
from kvtui.serve.images import has_images, refuse_images
from kvtui.serve.jsonsafe import InternalErrors, JSONBody, NonFiniteNumber
from kvtui.serve.lora import ServedAdapters, add_lora_routes, not_found
from kvtui.serve.metrics import CONTENT_TYPE, ServeMetrics
from kvtui.serve.protocol import ApiError, ChatCompletionRequest, CompletionRequest, LoneSurrogate, sampling_params
from kvtui.serve.responses import Formatter, sse
from kvtui.serve.transcribe import add_transcription_route, is_speech
from kvtui.serve.waiting import ClientGone, engine_error
from kvtui.serve.waiting import check_admitted as _check_admitted
from kvtui.serve.waiting import next_item as _next
from kvtui.serve.waiting import serial as _serial
from kvtui.serve.waiting import wait_disconnect as _wait_disconnect

# A passphrase as kvtui's passphrase prompts make them (WORD-WORD-NN): found in a prompt, it becomes
# the request's canary, so the canary detector can see it leak into another client's answer.
PASSPHRASE = re.compile(r"\b[A-Z]+-[A-Z]+-\d{2}\b")
TOKENIZE_WORKERS = 2  # threads that tokenize prompts and render chat templates (requests queue for them)
# The id a client may give its request. kvtui routes answers by its own ids (`chatcmpl-<n>-<hex>`) and hands
# this one to the bridge only for the fault request_id_keyed (serve/bridge.py).
CLIENT_ID_HEADER = "x-request-id"
log = logging.getLogger("kvtui.serve")


@dataclass
class ServeContext:
    """What the handlers need once the model is loaded.

    Attributes:
        bridge: the route into the engine thread; metrics: the server's Prometheus metrics.
        tokenizer: the model's; max_len: tokens one request may hold (prompt + completion).
        model_name: the served name (`model` in requests and responses); model_id: kvtui's model id.
        feature_extractor: a speech model's (serve/transcribe.py), None for a text model.
        prompt_embeds: what prompt embeddings the model takes (serve/embeds.py) under
            --enable-prompt-embeds; None: requests carrying them get 400.
        image_tokens: prompt positions one image takes for an image model (dinov2-smollm2, tiny-vision:
            serve/images.py); None: a model without an image encoder, image parts get 400.
        adapters: the LoRA adapters served (serve/lora.py ServedAdapters); loaded: the loaded model.
    """

    bridge: EngineBridge
    metrics: ServeMetrics
    tokenizer: object
    max_len: int
    model_name: str
    model_id: str
    feature_extractor: object = None  # speech models (Whisper): audio -> log-mel features; None: a text model
    prompt_embeds: EmbedsSpec | None = None
    image_tokens: int | None = None
    adapters: ServedAdapters | None = None
    loaded: object = None

    def adapter_of(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names: None for the base model (its served name, kvtui's
        id, or no model). Raises ApiError 404 (vLLM's body) for a name the server does not serve."""
        if not model or model in (self.model_name, self.model_id):
            return None
        if self.adapters is not None and model in self.adapters.names():
            return model
        raise not_found(model)


class ServerState:
    """Holds the context once loaded (None while loading, so requests get 503), and the threads that
    tokenize (shut down by `close`)."""

    def __init__(self) -> None:
        self.context: ServeContext | None = None
        self.started = int(time.time())  # the server's start (Unix seconds): /v1/models' `created`
        self.tokenize_pool = ThreadPoolExecutor(TOKENIZE_WORKERS, thread_name_prefix="kvtui-tokenize")

    async def off_loop(self, fn, *args):
        """`fn(*args)` in the tokenizing threads; the event loop serves everyone else meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)

    def close(self) -> None:
        """Stop the tokenizing threads (queued work is dropped; running work finishes on its own)."""
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    def ready(self) -> ServeContext:
        """Raises ApiError 503 while the model loads."""
        if self.context is None:
            raise ApiError(503, "the model is loading; retry in a few seconds", code="model_loading")
        return self.context


def _add_version_route(app: FastAPI) -> None:
    """GET /version: kvtui's release in vLLM's shape, `{"version": "0.1.0"}` (what a conformance run records
    as the server's release); it answers while the model loads too."""

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}


def create_app(state: ServerState, *, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, runtime_lora: bool = False) -> FastAPI:
    """The application; `state.context` is set by the server once the model is loaded. `api_key`: the
    Bearer token /v1/* needs (None: open); `max_request_bytes`: the largest body taken (413 past it);
    `runtime_lora`: serve /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's runtime LoRA updating)."""
    app = FastAPI(title="kvtui serve", docs_url=None, redoc_url=None, openapi_url=None,
                  default_response_class=JSONBody)
    app.add_middleware(RequestGuard, api_key=api_key, max_request_bytes=max_request_bytes,
                       embeds_width=lambda: state.context.prompt_embeds.hidden_size
                       if state.context is not None and state.context.prompt_embeds is not None else None)
    app.add_middleware(InternalErrors)  # outermost: any exception left is its request's JSON 500
    _error_handlers(app)
    add_transcription_route(app, state)
    _add_version_route(app)
    if runtime_lora:
        add_lora_routes(app, state)

    @app.get("/health")
    async def health() -> Response:
        state.ready()
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict:
        ctx = state.ready()
        adapters = ctx.adapters.model_cards(state.started) if ctx.adapters is not None else []
        return {"object": "list", "data": [_model_card(state), *adapters]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        ctx = state.ready()
        if ctx.adapter_of(model) is not None:
            card = next((c for c in ctx.adapters.model_cards(state.started) if c["id"] == model), None)
            if card is None:  # unloaded meanwhile
                raise not_found(model)
            return card
        return _model_card(state)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.ready().metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        ctx = text_model(state.ready(), "completions")
        _log_ignored(body)
        body.check()
        prompts = await _completion_prompts(state, ctx, body)
        await state.off_loop(_precompile, ctx, body)
        return await _serve(ctx, request, body, prompts, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        ctx = text_model(state.ready(), "chat/completions")
        _log_ignored(body)
        body.check()
        images = has_images(body.messages)
        if images and ctx.image_tokens is None:
            refuse_images(ctx.model_name, body.messages)
        if images or has_embeds(body.messages):
            embeds = _embeds_spec(ctx, "messages") if has_embeds(body.messages) else None
            spliced = await state.off_loop(partial(chat_input, ctx.tokenizer, body.messages, embeds,
                                                   image_tokens=ctx.image_tokens, max_len=ctx.max_len))
            await state.off_loop(_precompile, ctx, body)
            prompt = Prompt(GivenInput(spliced.input), spliced.text)
            return await _serve(ctx, request, body, [prompt], chat=True)
        messages = body.chat()
        ids = await state.off_loop(_chat_prompt, ctx.tokenizer, messages)
        await state.off_loop(_precompile, ctx, body)
        last_user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        return await _serve(ctx, request, body, [Prompt(TokenPrompt(tuple(ids)), last_user)], chat=True)

    return app


def _model_card(state: ServerState) -> dict:
    """The served model as /v1/models lists it (vLLM's ModelCard fields); `created` is the server's start."""
    ctx = state.ready()
    return {"id": ctx.model_name, "object": "model", "created": state.started, "owned_by": "kvtui",
            "root": ctx.model_id, "max_model_len": ctx.max_len}


def text_model(ctx: ServeContext, endpoint: str) -> ServeContext:
    """`ctx`, or ApiError 400 when the served model is a speech model (it takes audio, not text)."""
    if is_speech(ctx):
        raise ApiError(400, f"model `{ctx.model_name}` is a speech model and takes audio: use "
                       f"/v1/audio/transcriptions, not /v1/{endpoint}", param="model", code="model_not_supported")
    return ctx


async def _completion_prompts(state: ServerState, ctx: ServeContext, body: CompletionRequest) -> list:
    """/v1/completions' Prompts: its text or token-id prompts tokenized, or its prompt_embeds (one prompt).

    Raises:
        ApiError: 400 for prompt_embeds with a prompt or echo, or without --enable-prompt-embeds.
    """
    if body.prompt_embeds is None:
        return await state.off_loop(_encode_prompts, ctx.tokenizer, body.prompts(), body.echo)
    embeds = _embeds_spec(ctx, "prompt_embeds")
    if body.prompt not in (None, "", [], [""]):
        raise ApiError(400, "send either prompt or prompt_embeds, not both (one prompt per request)", param="prompt")
    if body.echo:
        raise ApiError(400, "echo repeats a prompt's text, and prompt_embeds have none: drop echo", param="echo")
    given = await state.off_loop(completion_input, body.prompt_embeds, embeds)
    return [Prompt(GivenInput(given))]


def _embeds_spec(ctx: ServeContext, param: str) -> EmbedsSpec:
    """The served model's EmbedsSpec, or ApiError 400 when the server runs without --enable-prompt-embeds."""
    if ctx.prompt_embeds is None:
        raise ApiError(400, f"{ENABLE_HINT} (it is off on this server)", param=param)
    return ctx.prompt_embeds


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONBody:
        return JSONBody(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONBody:
        first = e.errors()[0] if e.errors() else {}
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, LoneSurrogate):
            error = ApiError(400, str(cause), param=cause.path[0] if cause.path else None, code="invalid_unicode")
            return JSONBody(error.body(), status_code=400)
        return JSONBody(_invalid_body(e.errors(), e.body).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONBody:
        return JSONBody(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)


def _invalid_body(errors: list[dict], body) -> ApiError:
    """The 400 for FastAPI's validation errors: `param` names the top-level field at fault, or null when the
    body itself is (unparsable JSON, not an object), as OpenAI and vLLM answer. The message names the
    field as the request wrote it (`messages[0].content`, `logit_bias["5"]`), never pydantic's names for
    the branches of a union (`prompt.str`, `prompt.list[int]`); of a union's errors it keeps those that
    reached deepest into the value sent (the branch the value fits), their wants joined."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        where = first.get("loc", ("body", 0))[-1]
        why = (first.get("ctx") or {}).get("error", "")
        return ApiError(400, f"the body is not valid JSON ({why} at character {where}); send a JSON object")
    loc = tuple(first.get("loc", ()))
    if len(loc) < 2 or not isinstance(loc[1], str):  # the body itself (not an object)
        return ApiError(400, f"body: {first.get('msg', 'invalid request')}")
    param = loc[1]
    same = [(_user_path(e.get("loc", ())[1:], body), e.get("msg", "invalid")) for e in errors
            if tuple(e.get("loc", ()))[:2] == loc[:2]]
    deepest = max(len(path) for path, _ in same)
    paths = [path for path, _ in same if len(path) == deepest]
    wants = list(dict.fromkeys(msg for path, msg in same if path == paths[0]))
    return ApiError(400, f"{_path_text(paths[0])}: {_joined(wants)}", param=param)


def _user_path(loc: tuple, body) -> tuple:
    """The parts of a pydantic error location that are keys and indexes of the request `body` itself (union
    branch tags such as `str` or `list[int]` left out)."""
    path, value = [], body
    for part in loc:
        if isinstance(value, dict) and isinstance(part, str) and part in value:
            value = value[part]
        elif isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value):
            value = value[part]
        else:
            continue
        path.append(part)
    return tuple(path)


def _path_text(path: tuple) -> str:
    """`messages[0].content`, `logit_bias["5"]`: a field's place as JSON paths write it."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part.isidentifier():
            text += f".{part}" if text else part
        else:
            text += "[" + json.dumps(part) + "]"
    return text or "body"


def _joined(wants: list[str]) -> str:
    """"Input should be a valid string or a valid list": several wants at one place, said once."""
    prefix = "Input should be "
    if len(wants) > 1 and all(w.startswith(prefix) for w in wants):
        return prefix + " or ".join(w[len(prefix):] for w in wants)
    return "; or ".join(wants)


def _precompile(ctx: ServeContext, body) -> None:
    """Structured output: compile the request's grammar here (a tokenizing thread), not in the engine's
    step. Raises ApiError 400 naming the field when it does not compile, 503 while no session runs."""
    spec = body.structured()
    if spec is None:
        return
    try:
        ctx.bridge.precompile(spec)
    except ValueError as e:
        raise ApiError(400, f"structured output: {e}", param=body.structured_param(),
                       code="invalid_structured_output") from None
    except NotAccepting:
        raise ApiError(503, "the server is not taking requests (loading or stopping)", code="unavailable") from None


def _chat_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """The chat's prompt ids (tokenizing thread).

    Raises:
        ApiError: 400 when the model's chat template refuses the messages (an unknown role, turns out of
            order): the template's own words, as vLLM answers them.
    """
    from jinja2 import TemplateError

    try:
        return chat_ids(tokenizer, messages)
    except (TemplateError, ValueError, TypeError, KeyError) as e:
        raise ApiError(400, f"messages: the model's chat template cannot render them ({e})", param="messages") \
            from None


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request: what it feeds the model (an InputSpec, kvtui/request.py: a TokenPrompt,
    or a GivenInput for prompt embeddings or images), its text (None when it came as ids or embeddings),
    and the text `echo` puts before its choices."""

    input: InputSpec
    text: str | None = None
    echo: str = ""

    @property
    def ids(self) -> list[int]:
        """Its prompt token ids."""
        return list(self.input.ids)


def _encode_prompts(tokenizer, prompts: list, echo: bool) -> list[Prompt]:
    """The Prompts of /v1/completions' text or token-id prompts (tokenizing thread); with `echo`, a token-id
    prompt's echo is its decoded text, as vLLM's."""
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            out.append(Prompt(TokenPrompt(tuple(encode_text(tokenizer, prompt))), prompt, echo=prompt if echo else ""))
        else:
            out.append(Prompt(TokenPrompt(tuple(prompt)), echo=tokenizer.decode(list(prompt)) if echo else ""))
    return out


def _log_ignored(body) -> None:
    """The log line vLLM writes for fields a request held that the server does not read."""
    ignored = body.ignored_fields()
    if ignored:
        log.warning("The following fields were present in the request but ignored: %s", set(ignored))


async def _serve(ctx: ServeContext, request: Request, body, prompts: list[Prompt], *, chat: bool) -> Response:
    """Submit a request's prompts (one engine request each) and answer them, streamed or whole."""
    adapter = ctx.adapter_of(body.model)
    if any(not p.ids for p in prompts):
        raise ApiError(400, "the prompt is empty", param="messages" if chat else "prompt")
    samplings = [sampling_params(body, prompt_len=len(p.ids), max_len=ctx.max_len, endpoint="chat" if chat
                                 else "completion", tokenizer=ctx.tokenizer) for p in prompts]
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{next(_serial)}-{secrets.token_hex(3)}"
    choices = _submit(ctx, body, request_id, prompts, samplings, request.headers.get(CLIENT_ID_HEADER), adapter)
    formatter = Formatter(chat=chat, request_id=request_id, model=adapter or ctx.model_name, tokenizer=ctx.tokenizer,
                          top_k=samplings[0].logprobs)
    echo = [p.echo for p in prompts]
    listener = asyncio.ensure_future(_wait_disconnect(request))
    try:
        first = await _next(choices, listener)
        try:
            _check_admitted(first)
        except ApiError as e:
            if e.code == "invalid_structured_output":  # name the field the grammar came in
                e.param = body.structured_param()
            raise
        if body.stream:
            sampling = samplings[0]
            texts = [TextStream(ctx.tokenizer, sampling.stop, sampling.include_stop_str_in_output,
                                sampling.min_tokens) for _ in range(choices.total)]
            events = _stream(ctx, choices, first, formatter, texts, echo, include_usage=body.include_usage())
            return StreamingResponse(events, media_type="text/event-stream",
                                     background=BackgroundTask(choices.abort, ctx.bridge))
        answer = await _whole(choices, first, formatter, listener, echo)
        choices.close()
        return JSONBody(answer)
    except ClientGone:
        choices.abort(ctx.bridge)
        return Response(status_code=499)
    except BaseException:
        choices.abort(ctx.bridge)
        raise
    finally:
        listener.cancel()


def _submit(ctx: ServeContext, body, request_id: str, prompts: list[Prompt], samplings: list,
            client_id: str | None, adapter: str | None = None) -> Choices:
    """Submit one engine request per prompt (ids `request_id`, or `request_id-p` for a list of prompts, as
    vLLM suffixes its own; the client's id `client_id` likewise, for the fault request_id_keyed), each
    under LoRA adapter `adapter` (None: the base model).

    Raises:
        ApiError: 503 while the server takes no requests (what was submitted already is aborted).
    """
    if len(prompts) == 1:
        ids, keys = [request_id], [client_id]
    else:
        ids = [f"{request_id}-{p}" for p in range(len(prompts))]
        keys = [None if client_id is None else f"{client_id}-{p}" for p in range(len(prompts))]
    streams = []
    try:
        for engine_id, key, prompt, sampling in zip(ids, keys, prompts, samplings):
            planned = PlannedRequest(engine_id, 0.0, prompt.input, sampling, text=prompt.text,
                                     canary=served_canary(prompt.text), tenant=_tenant(body),
                                     cache_salt=body.cache_salt, adapter=adapter)
            streams.append(ctx.bridge.submit(planned, client_key=key))
    except NotAccepting:
        for stream in streams:
            ctx.bridge.abort(stream.request_id)
        raise ApiError(503, "the server is not taking requests (loading or stopping)", code="unavailable") from None
    return Choices(streams, [len(p.ids) for p in prompts])


def served_canary(text: str | None) -> Canary | None:
    """A served prompt's canary: the first passphrase in its text (kvtui's WORD-WORD-NN form), or None."""
    found = PASSPHRASE.search(text or "")
    return Canary(found.group(0)) if found else None


def _tenant(body) -> str | None:
    """Who sent a request, for the prefix cache's provenance: OpenAI's `user`, else its salt's digest."""
    if body.user:
        return body.user
    return f"salt-{salt_digest(body.cache_salt)}" if body.cache_salt else None


async def _whole(choices: Choices, item, formatter: Formatter, listener: asyncio.Future, echo: list[str]) -> dict:
    """The whole response: every choice's text once its sequence finished (prompts x n of them), each after
    its prompt's echo."""
    entries: list[list] = [[] for _ in range(choices.total)]
    done: dict[int, Finish] = {}
    while True:
        if isinstance(item, TokenOut):
            if item.logprobs:
                entries[item.index].append(item.logprobs)
        elif isinstance(item, Closed):
            raise ApiError(503, "the server stopped before the request finished", code="unavailable")
        elif item.finish_reason in ("error", "rejected"):
            raise engine_error(item)
        else:
            done[choices.index_of(item.request_id)] = item
            if len(done) == choices.total:
                break
        item = await _next(choices, listener)
    finished = [done[i] for i in range(choices.total)]
    return formatter.whole([(echo[choices.prompt_of(i)] + f.output_text, entries[i], f.finish_reason)
                            for i, f in enumerate(finished)],
                           choices.prompt_tokens, sum(len(f.output_ids) for f in finished), choices.cached_tokens)


async def _stream(ctx: ServeContext, choices: Choices, item, formatter: Formatter, texts: list[TextStream],
                  echo: list[str], *, include_usage: bool):
    """The server-sent events of a streamed response, each chunk with its choice's index (a choice's first
    chunk begins with its prompt's echo), then `[DONE]`; a client that goes away aborts the request. A
    chunk that would hold NaN or an infinity (JSON has neither) ends the stream with a non_finite_output
    error event instead, and aborts the request."""
    finished: list[bool] = [False]  # set once the request ended on its own (nothing to abort)
    try:
        try:
            async for event in _chunks(choices, item, formatter, texts, echo, include_usage, finished):
                yield event
        except NonFiniteNumber as e:
            log.error("a stream chunk held %s at %s; the stream ends with a non_finite_output error", e.value,
                      e.where)
            yield sse(e.error().body())
        yield sse("[DONE]")
    finally:
        if not finished[0]:
            choices.abort(ctx.bridge)
        choices.close()


async def _chunks(choices: Choices, item, formatter: Formatter, texts: list[TextStream], echo: list[str],
                  include_usage: bool, finished: list[bool]):
    """_stream's events before `[DONE]`; sets finished[0] once the request ended (all choices, an error, or
    the server closing)."""
    done, heads = {}, _Heads(choices, echo)
    if formatter.chat:
        for index in range(choices.total):
            yield sse(formatter.role_chunk(index))
    while True:
        if isinstance(item, TokenOut):
            delta, entries = texts[item.index].add(item.token_id), [item.logprobs] if item.logprobs else []
            head = heads.take(item.index)
            if head or delta or entries:
                yield sse(formatter.chunk(head + delta, entries, index=item.index))
        elif isinstance(item, Finish) and item.finish_reason in ("error", "rejected"):  # vLLM's way: an error
            finished[0] = True  # event, then [DONE]
            yield sse(engine_error(item).body())
            return
        elif isinstance(item, Finish):
            index = choices.index_of(item.request_id)
            done[index] = item
            yield sse(formatter.chunk(heads.take(index) + texts[index].finish(item.output_text), [],
                                      item.finish_reason, index=index))
        else:  # Closed: every choice still open ends as aborted
            for index in sorted(set(range(choices.total)) - set(done)):
                yield sse(formatter.chunk(heads.take(index), [], "abort", index=index))
        if isinstance(item, Closed) or len(done) == choices.total:
            finished[0] = True
            if include_usage and len(done) == choices.total:
                yield sse(formatter.usage_chunk(choices.prompt_tokens, sum(len(f.output_ids) for f in done.values()),
                                                choices.cached_tokens))
            return
        item = await choices.queue.get()


class _Heads:
    """Each choice's echo, handed out once: the prompt's text before the choice's first streamed text."""

    def __init__(self, choices: Choices, echo: list[str]) -> None:
        self.choices, self.echo, self.sent = choices, echo, set()

    def take(self, index: int) -> str:
        if index in self.sent:
            return ""
        self.sent.add(index)
        return self.echo[self.choices.prompt_of(index)]
