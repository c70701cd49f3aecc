"""What a handler of kvtui serve does while the engine runs its request: request ids, waiting for the
next item of a request's stream or the client's disconnect, and the HTTP error of a request the engine
refused or failed. Shared by the text endpoints (serve/app.py) and the transcription endpoint
(serve/transcribe.py)."""

from __future__ import annotations

import asyncio
import itertools

from fastapi import Request

from kvtui.events import Finish
from kvtui.serve.bridge import Closed, RequestStream
from kvtui.serve.protocol import ApiError

serial = itertools.count(1)  # request ids: a serial (unique in the process) and a random tail, short for the dashboard
# the engine's FinishCode of a rejected or failed request -> (HTTP status, OpenAI error code, param)
ENGINE_ERRORS = {"queue_full": (429, "rate_limit_exceeded", None),
                 "too_long": (400, "context_length_exceeded", "max_tokens"),
                 "empty": (400, "empty_prompt", "prompt"),
                 "out_of_vocabulary": (400, "out_of_vocabulary", "prompt"),
                 "invalid_logit_bias": (400, "invalid_logit_bias", "logit_bias"),
                 "invalid_bad_words": (400, "invalid_bad_words", "bad_words"),
                 "unsupported_input": (400, "model_not_supported", None),  # an input the model cannot take
                 "adapter_unsupported": (400, "model_not_supported", "model"),  # an adapter this engine cannot run
                 "internal_error": (500, "internal_error", None),
                 "model_not_found": (404, 404, "model"),  # an adapter unloaded after the request came in
                 "invalid_structured_output": (400, "invalid_structured_output", None)}


class ClientGone(Exception):
    """The client closed its connection."""


async def wait_disconnect(request: Request) -> None:
    """Returns once the client disconnects (the body was read already, so receive() waits for that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def next_item(stream: RequestStream, listener: asyncio.Future):
    """The request's next item, or ClientGone if the client disconnects first."""
    get = asyncio.ensure_future(stream.queue.get())
    done, _ = await asyncio.wait({get, listener}, return_when=asyncio.FIRST_COMPLETED)
    if get in done:
        return get.result()
    get.cancel()
    raise ClientGone()


def check_admitted(first) -> None:
    """Raises ApiError when the engine refused or failed the request (by its code, ENGINE_ERRORS) or
    never took it (503)."""
    if isinstance(first, Closed):
        raise ApiError(503, "the server stopped before the request started", code="unavailable")
    if isinstance(first, Finish) and first.finish_reason in ("rejected", "error"):
        raise engine_error(first)


def engine_error(finish: Finish) -> ApiError:
    """The HTTP error of a request the engine rejected or failed, chosen by its FinishCode (an unknown
    or missing code is a 500: the engine did not say why)."""
    status, code, param = ENGINE_ERRORS.get(finish.code or "", (500, finish.code or "internal_error", None))
    if finish.code == "queue_full":
        return ApiError(status, f"the engine's {finish.detail}; retry later", param=param, code=code)
    kind = "NotFoundError" if finish.code == "model_not_found" else None  # vLLM's body for an unknown model
    return ApiError(status, finish.detail or f"request {finish.finish_reason}", param=param, code=code, kind=kind)
