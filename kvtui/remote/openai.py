"""One streamed request to an OpenAI-compatible server, timed as vLLM's `bench serve` times it.

The request body is built from a planned request (kvtui.scenario.PlannedRequest): the chat API sends
the prompt's text as the user message (or the scenario's chat messages), the completions API sends the
text, or the token ids when the prompt has none (synthetic prompts); a prompt sent as embedding rows
goes as `prompt_embeds` (kvtui/remote/embeds.py). Every request streams
(`stream: true`, `stream_options: {include_usage: true}`) and, when asked, requests the top 5
logprobs of each generated token.

Timing follows vllm/benchmarks/lib/endpoint_request_func.py: the clock starts just before the request
is sent; each server-sent event that carries a `choices` entry is a chunk, timestamped when parsed;
TTFT is the first chunk's time minus the send time, ITL the gaps between chunks, and the request ends
at its last chunk (the trailing `usage`-only event carries no token and does not move the end). The
output token count is the server's `usage.completion_tokens`, else the number of chunks that carried
text or a token.

Logprobs come in two shapes, both read here: the chat shape (llama.cpp and vLLM chat, llama.cpp
completions) `logprobs.content[] = {id?, token, logprob, top_logprobs: [{token, logprob}, ...]}`, and
the legacy completions shape (vLLM, OpenAI) `logprobs = {tokens, token_logprobs, top_logprobs: [{token:
logprob}]}`. Natural-log probabilities: differences of logprobs at one position equal differences of logits.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from kvtui.remote.reach import BadAnswer, answered, stream_event
from kvtui.remote.wire import WirePool

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
TOP_LOGPROBS = 5  # alternatives per token: a near tie of three still shows both runs' choices
NEG_INF = float("-inf")
DRAIN_S = 0.5  # after `data: [DONE]`, how long the rest of the body may take before the connection is dropped


@dataclass(frozen=True)
class TokenInfo:
    """One generated token as the server reported it in its logprobs.

    Attributes:
        token: its text (or the server's token string).
        id: its token id when the server gives one (llama.cpp does), else None.
        top: the server's most likely tokens at that position, as (key, logprob) pairs, most likely
            first (key: the id when given, else the token text; logprob in nats); () when not returned.
    """

    token: str
    id: int | None
    top: tuple[tuple[int | str, float], ...] = ()

    @property
    def key(self) -> int | str:
        """What two runs' tokens are compared by: the id when known, else the token string."""
        return self.id if self.id is not None else self.token

    @property
    def top2_gap(self) -> float | None:
        """Top-1 minus top-2 logprob (nats; equal to the top-1 minus top-2 logit); None without two."""
        return self.top[0][1] - self.top[1][1] if len(self.top) >= 2 else None

    def below_top(self, key: int | str) -> float | None:
        """How far below this position's most likely token `key` was (nats): 0 for the top token; None
        when `key` is not among the returned top tokens (it was further below than the last of them)."""
        found = next((lp for k, lp in self.top if k == key), None)
        return None if found is None or not self.top else self.top[0][1] - found


@dataclass
class StreamResult:
    """What one streamed request gave. Times are seconds on the caller's clock.

    Attributes:
        sent_s: when the request was sent; first_s / end_s: the first and the last chunk (None if none).
        chunk_times_s: every chunk that carried a choice, in order (TTFT, ITL, TPOT come from these).
        pieces: the text each chunk added ("" for a chunk without text).
        tokens: per generated token, when the server returned logprobs (else empty).
        finish_reason: the server's (stop, length, ...), or "error" with `error` set.
        prompt_tokens / completion_tokens: the server's `usage`, None when it sent none.
        cached_tokens: prompt tokens the server took from its prefix cache (KV it had computed before),
            from `usage.prompt_tokens_details.cached_tokens` (vLLM with --enable-prompt-tokens-details,
            llama.cpp, OpenAI) or llama.cpp's `timings.cache_n`; None when the server said nothing.
        status: the HTTP status of the response, None when none came (no answer, a refused connection).
        timed_out: the answer did not end within the request's limit (the request was given up).
    """

    sent_s: float
    first_s: float | None = None
    end_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    tokens: list[TokenInfo] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    status: int | None = None
    timed_out: bool = False

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def output_tokens(self) -> int:
        """The server's completion token count, else the chunks that carried text or a token."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        return len(self.tokens) or sum(1 for p in self.pieces if p)


def penalty_fields(s) -> dict:
    """The request's penalties, bias and bans in the OpenAI API's names (`frequency_penalty`,
    `presence_penalty`, `logit_bias` keyed by token-id strings) and vLLM's (`repetition_penalty`,
    `min_tokens`, `bad_words`), only those set (a server that knows none of them sees a plain body)."""
    fields = {"frequency_penalty": s.frequency_penalty, "presence_penalty": s.presence_penalty,
              "repetition_penalty": s.repetition_penalty if s.repetition_penalty != 1.0 else 0,
              "logit_bias": {str(t): b for t, b in s.logit_bias}, "min_tokens": s.min_tokens,
              "bad_words": list(s.bad_words)}
    return {k: v for k, v in fields.items() if v}


def request_body(planned, api: str, model: str | None, *, logprobs: bool, messages: list | None = None,
                 temperature: float | None = None, prompt_embeds: str | None = None) -> tuple[str, dict]:
    """The path and JSON body for one planned request.

    Args:
        planned: a PlannedRequest (prompt ids, its `text` when the prompt has text, sampling).
        api: "chat" or "completions".
        model: the served model name, or None to leave `model` out.
        logprobs: ask for the top-2 logprobs of each token.
        messages: chat messages to send instead of one user message with the prompt text.
        temperature: overrides the planned sampling temperature (the reference check sends 0).
        prompt_embeds: completions only: base64 torch.save rows sent as `prompt_embeds` in place of the
            prompt (kvtui/remote/embeds.py), `prompt` then left out.
    """
    s = planned.sampling
    text = planned.text
    body: dict = {"max_tokens": s.max_new_tokens, "stream": True, "stream_options": {"include_usage": True},
                  "temperature": s.temperature if temperature is None else temperature}
    if model:
        body["model"] = model
    if body["temperature"] > 0:
        body.update(top_p=s.top_p, seed=s.seed % (1 << 31))
        if s.top_k:
            body["top_k"] = s.top_k
    if s.stop:
        body["stop"] = list(s.stop)
    if s.ignore_eos:
        body["ignore_eos"] = True
    body.update(penalty_fields(s))
    if api == "chat":
        body["messages"] = messages or [{"role": "user", "content": text if text is not None else ""}]
        if logprobs:
            body.update(logprobs=True, top_logprobs=TOP_LOGPROBS)
        return CHAT_PATH, body
    if prompt_embeds is not None:
        body["prompt_embeds"] = prompt_embeds
    else:
        body["prompt"] = text if text is not None else list(planned.prompt_ids)
    if logprobs:
        body["logprobs"] = TOP_LOGPROBS
    return COMPLETIONS_PATH, body


ChunkCallback = Callable[[StreamResult, str], None]


async def stream_request(client: httpx.AsyncClient, path: str, body: dict, *, timeout_s: float | None,
                         clock: Callable[[], float] = time.perf_counter, result: StreamResult | None = None,
                         on_chunk: ChunkCallback | None = None, headers: dict | None = None) -> StreamResult:
    """Send one streaming request and read it to the end. Never raises for a server or network
    failure: the result then has finish_reason "error" and the error text.

    Args:
        timeout_s: the whole request's limit (seconds), None for none; its expiry is an error.
        clock: the time source (seconds); the result's times are on it.
        result: the StreamResult to fill (its sent_s is reset to the send time), so a caller that
            cancels the request keeps what arrived; a new one when None.
        on_chunk: called after each chunk with the result so far and the chunk's text.
        headers: more request headers (the request-id audit's x-request-id).

    `client` is an httpx.AsyncClient (the request then goes out with `Connection: close`: llama.cpp's
    server closes the connection after every stream, so an httpx pooled connection reused at once fails, see
    kvtui.remote.llama_server) or a kvtui.remote.wire.WirePool (the load's pooled keep-alive connections).
    """
    result = result if result is not None else StreamResult(sent_s=0.0)
    result.sent_s = clock()
    try:
        await asyncio.wait_for(_read_stream(client, path, body, result, clock, on_chunk, headers or {}), timeout_s)
    except asyncio.TimeoutError:
        result.timed_out = True
        return _failed(result, f"timeout: no complete answer within {timeout_s:g} s")
    except BadAnswer as e:  # its message says what came back (not JSON, an error event)
        return _failed(result, str(e))
    except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        return _failed(result, f"{type(e).__name__}: {e}".strip())
    if result.error is None and result.finish_reason is None:
        return _failed(result, "the stream ended without a finish_reason")
    return result


async def _read_stream(client, path: str, body: dict, result: StreamResult,
                       clock: Callable[[], float], on_chunk: ChunkCallback | None, headers: dict) -> None:
    if isinstance(client, WirePool):
        payload = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
        async with client.post(path, payload, headers) as response:
            await _read_answer(response, response.lines(), None, result, clock, on_chunk)
            await response.finish(DRAIN_S)  # the body's end after [DONE]: the connection can be reused
        return
    async with client.stream("POST", path, json=body, headers={**headers, "Connection": "close"}) as response:
        await _read_answer(response, response.aiter_lines(), response.request.url.path, result, clock, on_chunk)


async def _read_answer(response, lines, path: str | None, result: StreamResult, clock: Callable[[], float],
                       on_chunk: ChunkCallback | None) -> None:
    """Fold an answer's server-sent events into `result` (an httpx or a kvtui.remote.wire response)."""
    result.status = response.status_code
    if response.status_code != 200:
        detail = (await response.aread()).decode("utf-8", "replace").strip()
        _failed(result, f"HTTP {response.status_code}: {detail[:300]}")
        return
    events, other = 0, []  # data lines read; the start of anything else (what came instead of a stream)
    async for line in lines:
        if not line.startswith("data:"):
            if not events and line.strip() and sum(map(len, other)) < 200:
                other.append(line)
            continue
        events += 1
        chunks = len(result.chunk_times_s)
        if _read_event(line, result, clock):
            return
        if on_chunk is not None and len(result.chunk_times_s) > chunks:
            on_chunk(result, result.pieces[-1])
    if not events:  # e.g. a 200 text/html page: no server-sent event at all
        raise BadAnswer(f"POST {path if path is not None else response.path} "
                        f"{answered(response, ' '.join(other), 'not a stream of server-sent events')}")


def _failed(result: StreamResult, error: str) -> StreamResult:
    result.finish_reason, result.error = "error", error
    return result


def _read_event(line: str, result: StreamResult, clock: Callable[[], float]) -> bool:
    """Fold one SSE line into `result`; True at `data: [DONE]`. Comments and other fields are skipped.

    Raises:
        BadAnswer: a data line that is not a JSON object, or an error event; KeyError/TypeError/IndexError: a
            malformed chunk.
    """
    if not line.startswith("data:"):
        return False
    payload = line[5:].strip()
    if payload == "[DONE]":
        return True
    data = stream_event(payload)
    if data.get("choices"):
        _add_chunk(data["choices"][0], result, clock())
    usage = data.get("usage")
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
        result.completion_tokens = usage.get("completion_tokens", result.completion_tokens)
    cached = cached_tokens(data)
    if cached is not None:
        result.cached_tokens = cached
    return False


def cached_tokens(data: dict) -> int | None:
    """Prompt tokens a response (or stream chunk) says came from the server's prefix cache: OpenAI's
    `usage.prompt_tokens_details.cached_tokens` (vLLM fills it when started with
    --enable-prompt-tokens-details; llama.cpp always), else llama.cpp's `timings.cache_n`; None when
    neither is there."""
    details = (data.get("usage") or {}).get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return details["cached_tokens"]
    timings = data.get("timings")
    if isinstance(timings, dict) and isinstance(timings.get("cache_n"), int):
        return timings["cache_n"]
    return None


def _add_chunk(choice: dict, result: StreamResult, now: float) -> None:
    if result.first_s is None:
        result.first_s = now
    result.end_s = now
    result.chunk_times_s.append(now)
    delta = choice.get("delta")
    piece = (delta.get("content") if isinstance(delta, dict) else choice.get("text")) or ""
    result.pieces.append(piece)
    result.tokens.extend(parse_logprobs(choice.get("logprobs")))
    if choice.get("finish_reason"):
        result.finish_reason = choice["finish_reason"]


def parse_logprobs(logprobs) -> list[TokenInfo]:
    """Tokens of one chunk's (or one response's) `logprobs`, in either shape; [] for none."""
    if not logprobs:
        return []
    if isinstance(logprobs.get("content"), list):
        return [TokenInfo(e.get("token", ""), e.get("id"), _ranked(
            (t.get("id") if t.get("id") is not None else t.get("token", ""), t.get("logprob"))
            for t in e.get("top_logprobs") or ())) for e in logprobs["content"]]
    tokens = logprobs.get("tokens") or []
    tops = logprobs.get("top_logprobs") or [None] * len(tokens)
    return [TokenInfo(tok, None, _ranked((top or {}).items())) for tok, top in zip(tokens, tops)]


def _ranked(pairs) -> tuple[tuple[int | str, float], ...]:
    """(key, logprob) pairs with a finite logprob, most likely first."""
    kept = [(k, float(v)) for k, v in pairs if isinstance(v, (int, float)) and v > NEG_INF]
    return tuple(sorted(kept, key=lambda kv: -kv[1]))
