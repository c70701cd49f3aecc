"""One transcription request to an OpenAI-compatible server (`POST /v1/audio/transcriptions`), timed.

A planned speech request (kvtui.request.PlannedRequest whose input is an AudioClip: a 16 kHz WAV clip)
is uploaded as OpenAI's client uploads it: multipart/form-data with the fields `file`, `model`,
`response_format=json` and `temperature`. The endpoint does not stream: the request ends when the
JSON answer `{"text": ...}` arrives, so it is one chunk at that moment (TTFT is the whole request's
latency). The transcript is split into words as its pieces, so a solo check that finds a
difference names the first differing word (kvtui.remote.solo_check compares pieces without logprobs).

Servers that take this: `kvtui serve --model whisper-tiny.en`, vLLM serving a Whisper model, OpenAI.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path

import httpx

from kvtui.remote.openai import StreamResult
from kvtui.remote.reach import answered, excerpt
from kvtui.request import AudioClip

TRANSCRIPTIONS_PATH = "/v1/audio/transcriptions"


def is_audio(planned) -> bool:
    """Whether a planned request is a transcription (it names an audio clip)."""
    return isinstance(planned.input, AudioClip)


def transcription_form(planned, model: str | None, *, temperature: float | None = None) -> dict[str, str]:
    """The form fields (besides `file`) for one planned speech request; `temperature` overrides the plan's."""
    form = {"response_format": "json",
            "temperature": str(planned.sampling.temperature if temperature is None else temperature)}
    if model:
        form["model"] = model
    return form


async def transcribe_request(client: httpx.AsyncClient, planned, form: dict[str, str], *, timeout_s: float | None,
                             clock: Callable[[], float], result: StreamResult | None = None) -> StreamResult:
    """Upload the planned request's clip and read its transcript. Never raises for a server, network or
    file failure: the result then has finish_reason "error" and the error text.

    Args:
        form: transcription_form's fields; timeout_s: the whole request's limit (seconds), None for none.
        clock: the time source (seconds); result: the StreamResult to fill (a new one when None).
    """
    result = result if result is not None else StreamResult(sent_s=0.0)
    path = Path(planned.input.path)
    try:
        data = path.read_bytes()
    except OSError as e:
        return _failed(result, f"cannot read {path}: {e.strerror or e}")
    result.sent_s = clock()
    try:
        response = await asyncio.wait_for(
            client.post(TRANSCRIPTIONS_PATH, data=form, files={"file": (path.name, data, "audio/wav")},
                        headers={"Connection": "close"}), timeout_s)
    except asyncio.TimeoutError:
        return _failed(result, f"timeout: no answer within {timeout_s:g} s")
    except httpx.HTTPError as e:
        return _failed(result, f"{type(e).__name__}: {e}".strip())
    now = clock()
    if response.status_code != 200:
        return _failed(result, f"HTTP {response.status_code}: {response.text.strip()[:300]}")
    try:
        data = response.json()
    except ValueError:
        return _failed(result, f"POST {TRANSCRIPTIONS_PATH} {answered(response)}")
    text = data.get("text") if isinstance(data, dict) else None
    if not isinstance(text, str):
        return _failed(result, f"POST {TRANSCRIPTIONS_PATH} answered JSON without a `text` string (not a "
                               f"transcription): {excerpt(response.text)}")
    result.pieces = re.findall(r"\s*\S+", text.strip()) or [""]
    result.first_s = result.end_s = now
    result.chunk_times_s = [now]  # one answer, not streamed: a single chunk
    result.finish_reason = "stop"
    return result


def _failed(result: StreamResult, error: str) -> StreamResult:
    result.finish_reason, result.error = "error", error
    return result
