"""OpenAI's `POST /v1/audio/transcriptions` for a speech model (Whisper): a multipart upload in, a transcript out.

Form fields, as OpenAI's API: `file` (required; WAV, FLAC, OGG or MP3, see serve/audio.py), `model` (the served name or
kvtui's model id), `response_format` `json` (default: `{"text"}`), `text` (plain text) or
`verbose_json` (`{"task", "language", "duration", "text", "segments": [one segment of the whole
clip], "usage"}`; the model has no timestamp tokens, so the segment spans the whole clip),
`language` (only `en`: Whisper tiny.en is English-only), `temperature` (0 greedy, the default, as
OpenAI's), `prompt` (text conditioning the decoder: Whisper's `<|startofprev|>` prompt). `srt`, `vtt`,
`timestamp_granularities[]` and `stream` need timestamps and are refused with a 400 naming the field.

The request runs in the engine like any other (an upload named like a spoken passphrase clip,
`word-word-nn.wav`, carries that passphrase as its canary, for the server's canary detector): its audio's log-mel features go in with it (the
request's typed input, RequestInput.audio), the encoder runs once at admission (its cross-attention K/V
are shared with other requests of the same audio through the encoder cache), and its decoder steps
are batched with the other running requests. Errors are OpenAI's shape (serve/protocol.py ApiError).
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import secrets

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from kvtui.engine.inputs import RequestInput
from kvtui.engine.request import SamplingParams
from kvtui.models.whisper import SAMPLE_RATE
from kvtui.request import Canary, GivenInput, PlannedRequest
from kvtui.serve.audio import AudioError, decode_audio
from kvtui.serve.bridge import NotAccepting
from kvtui.serve.jsonsafe import JSONBody
from kvtui.serve.protocol import ApiError

FORMATS = ("json", "text", "verbose_json")
# An upload named as kvtui's spoken passphrase clips (scenarios/audio/silver-rabbit-19.wav): the server's
# canary detector then looks for its words and number in other clients' transcripts, as a WORD-WORD-NN
# passphrase in a text prompt (serve/app.py PASSPHRASE).
SPOKEN_CLIP = re.compile(r"([a-z]+-[a-z]+-\d{2})\.wav", re.I)
TIMESTAMP_FORMATS = ("srt", "vtt")  # OpenAI's, needing timestamps this model has no tokens for
FIELDS = ("file", "model", "response_format", "language", "temperature", "prompt", "timestamp_granularities[]",
          "stream", "chunking_strategy", "include[]")


def is_speech(ctx) -> bool:
    """Whether the served model is a speech model (it has a feature extractor: Whisper)."""
    return getattr(ctx, "feature_extractor", None) is not None


def add_transcription_route(app: FastAPI, state) -> None:
    """Register `POST /v1/audio/transcriptions` on `app`, answering from `state` (serve/app.py ServerState)."""

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request) -> Response:
        ctx = state.ready()
        form = await _form(request)
        fields = _fields(form, ctx)
        upload = form.get("file")
        data = await upload.read()
        try:
            samples = await state.off_loop(decode_audio, data, f"file {upload.filename or '(unnamed)'}")
        except AudioError as e:
            raise ApiError(400, str(e), param="file", code="invalid_audio") from None
        from kvtui.engine.encoder_cache import audio_input
        from kvtui.scenario.plan import decoder_prompt

        features = await state.off_loop(audio_input, samples, ctx.feature_extractor, upload.filename or "upload")
        prompt_ids = decoder_prompt(ctx.tokenizer, fields["prompt"])
        if len(prompt_ids) >= ctx.max_len // 2:
            raise ApiError(400, f"prompt: {len(prompt_ids)} tokens, at most {ctx.max_len // 2 - 1} (half of the "
                           f"model's {ctx.max_len} decoder positions)", param="prompt", code="context_length_exceeded")
        finish = await _run(ctx, request, prompt_ids, features, fields["temperature"])
        return _answer(finish, fields, duration_s=samples.size / SAMPLE_RATE)


async def _form(request: Request):
    """The multipart form, or a 400 when the body is not one (a 500 when python-multipart is missing)."""
    kind = request.headers.get("content-type", "")
    if not kind.startswith("multipart/form-data"):
        raise ApiError(400, f"the body is {kind or 'without a content type'}: send multipart/form-data with the "
                       "audio in the field `file` (as the OpenAI client does)", param="file")
    if importlib.util.find_spec("python_multipart") is None:  # FastAPI's form parser
        raise ApiError(500, "this server cannot read uploads: its Python lacks python-multipart "
                       "(pip install python-multipart), then restart it", code="internal_error")
    try:
        return await request.form()
    except Exception as e:  # python-multipart's parse errors, a body cut short
        raise ApiError(400, f"the multipart body cannot be parsed ({e})", param="file") from None


def _fields(form, ctx) -> dict:
    """The checked form fields {"format", "temperature", "prompt"}; ApiError 400/404 naming the field at fault."""
    if not is_speech(ctx):
        raise ApiError(400, f"model `{ctx.model_name}` is a text model and does not transcribe audio; serve a speech "
                       "model (kvtui serve --model whisper-tiny.en)", param="model", code="model_not_supported")
    upload = form.get("file")
    if upload is None or isinstance(upload, str):
        raise ApiError(400, "file: required, the audio as a file upload (WAV, FLAC, OGG or MP3)", param="file")
    model = form.get("model")
    if not model:
        raise ApiError(400, "model: required (this server serves `" + ctx.model_name + "`)", param="model")
    if model not in (ctx.model_name, ctx.model_id):
        from kvtui.serve.lora import not_found

        raise not_found(model)
    unknown = next((k for k in form.keys() if k not in FIELDS), None)
    if unknown is not None:
        raise ApiError(400, f"{unknown}: unknown field; the fields are {', '.join(FIELDS[:6])}", param=unknown)
    fmt = form.get("response_format") or "json"
    if fmt in TIMESTAMP_FORMATS:
        raise ApiError(400, f"response_format: {fmt} needs timestamps, which this model has no tokens for; use json, "
                       "text or verbose_json", param="response_format")
    if fmt not in FORMATS:
        raise ApiError(400, f"response_format: {fmt!r} is not one of json, text, verbose_json", param="response_format")
    for field in ("timestamp_granularities[]", "stream", "chunking_strategy", "include[]"):
        value = form.get(field)
        if value not in (None, "", "false", "False"):
            raise ApiError(400, f"{field}: not supported by this server (no timestamps, no streaming); leave it out",
                           param=field)
    language = form.get("language") or "en"
    if language.lower() != "en":
        raise ApiError(400, f"language: {language!r} is not supported; {ctx.model_name} is English-only (use en)",
                       param="language", code="unsupported_language")
    return {"format": fmt, "temperature": _temperature(form.get("temperature")), "prompt": form.get("prompt") or ""}


def _temperature(value: str | None) -> float:
    """The `temperature` field: a number in [0, 1] (OpenAI's range for transcriptions); 0 when absent."""
    if value in (None, ""):
        return 0.0
    try:
        t = float(value)
    except ValueError:
        raise ApiError(400, f"temperature: {value!r} is not a number", param="temperature") from None
    if not 0.0 <= t <= 1.0:
        raise ApiError(400, f"temperature: {t} is outside [0, 1]", param="temperature")
    return t


async def _run(ctx, request: Request, prompt_ids: list[int], features, temperature: float):
    """Submit the transcription and wait for its Finish; ApiError when the engine refused or failed it."""
    from kvtui.serve.bridge import Closed, TokenOut
    from kvtui.serve.waiting import ClientGone, check_admitted, engine_error, next_item, serial, wait_disconnect

    request_id = f"trsc-{next(serial)}-{secrets.token_hex(3)}"
    sampling = SamplingParams(temperature=temperature, seed=secrets.randbelow(2**31),
                              max_new_tokens=ctx.max_len - len(prompt_ids))
    named = SPOKEN_CLIP.fullmatch(features.label)
    # a spoken passphrase clip (word-word-nn.wav): its passphrase is the request's canary
    canary = Canary(named.group(1).upper(), spoken=True) if named else None
    planned = PlannedRequest(request_id, 0.0, GivenInput(RequestInput(tuple(prompt_ids), audio=features)), sampling,
                             text=f"[audio {features.label}]", canary=canary)
    try:
        stream = ctx.bridge.submit(planned)
    except NotAccepting:
        raise ApiError(503, "the server is not taking requests (loading or stopping)", code="unavailable") from None
    listener = asyncio.ensure_future(wait_disconnect(request))
    try:
        item = await next_item(stream, listener)
        check_admitted(item)
        while isinstance(item, TokenOut):
            item = await next_item(stream, listener)
        if isinstance(item, Closed):
            raise ApiError(503, "the server stopped before the request finished", code="unavailable")
        if item.finish_reason == "error":
            raise engine_error(item)
        return item
    except ClientGone:
        ctx.bridge.abort(request_id)
        raise ApiError(499, "the client closed the connection") from None
    except BaseException:
        ctx.bridge.abort(request_id)
        raise
    finally:
        listener.cancel()


def _answer(finish, fields: dict, *, duration_s: float) -> Response:
    """The transcript in the asked response_format."""
    text = finish.output_text.strip()
    if fields["format"] == "text":
        return PlainTextResponse(text + "\n")
    usage = {"type": "duration", "seconds": round(duration_s, 3)}
    if fields["format"] == "json":
        return JSONBody({"text": text, "usage": usage})
    segment = {"id": 0, "seek": 0, "start": 0.0, "end": round(duration_s, 3), "text": text,
               "tokens": list(finish.output_ids), "temperature": fields["temperature"], "avg_logprob": None,
               "compression_ratio": None, "no_speech_prob": None}
    return JSONBody({"task": "transcribe", "language": "english", "duration": round(duration_s, 3),
                         "text": text, "segments": [segment], "usage": usage})
