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
        tokens: per generated token, when the server returned logprobs (else empty). A stream's logprobs are
            kept as the server sent them and made into TokenInfo when `tokens` is first read (the reference
            check reads them; most requests' never are): see `token_ids` for the ids alone.
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
    tokens: list[TokenInfo] = field(default_factory=list, repr=False)  # repr: left unparsed
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    status: int | None = None
    timed_out: bool = False
    _unparsed: list = field(default_factory=list, repr=False, compare=False)  # chunks' logprobs, not yet parsed

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def add_logprobs(self, logprobs) -> None:
        """One chunk's `logprobs` (either shape), after those of the chunks before it. Kept unparsed when
        parsing it later cannot fail; anything else is parsed now, so that it fails the request as before
        (KeyError, TypeError, AttributeError: a malformed chunk)."""
        if not logprobs:
            return
        if _well_formed(logprobs):
            self._unparsed.append(logprobs)
        else:
            self.tokens.extend(parse_logprobs(logprobs))

    def token_ids(self) -> tuple:
        """The generated tokens' ids, when the server gave one for every token (llama.cpp does); else ()
        (no logprobs, or a token without an id). Reads the kept logprobs without parsing them."""
        ids = [t.id for t in self.__dict__["_tokens"]]
        for logprobs in self._unparsed:
            content = logprobs.get("content")
            if isinstance(content, list):
                ids += [e.get("id") for e in content]
            else:  # the legacy shape carries no ids
                tokens, tops = logprobs.get("tokens") or [], logprobs.get("top_logprobs")
                if (min(len(tokens), len(tops)) if tops else len(tokens)) > 0:
                    return ()
        return tuple(ids) if ids and all(i is not None for i in ids) else ()

    @property
    def output_tokens(self) -> int:
        """The server's completion token count, else the chunks that carried text or a token."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        return len(self.tokens) or sum(1 for p in self.pieces if p)


def _get_tokens(self: StreamResult) -> list[TokenInfo]:
    tokens = self.__dict__["_tokens"]
    unparsed = self.__dict__.get("_unparsed")
    if unparsed:
        self.__dict__["_unparsed"] = []
        for logprobs in unparsed:
            tokens.extend(parse_logprobs(logprobs))
    return tokens


def _set_tokens(self: StreamResult, tokens: list[TokenInfo]) -> None:
    self.__dict__["_tokens"] = tokens
    self.__dict__["_unparsed"] = []


# `tokens` parses the kept logprobs on first read (a dataclass field with a property over it: the
# constructor, ==, repr and pickling, e.g. to a Ray driver, go through it)
StreamResult.tokens = property(_get_tokens, _set_tokens, doc="per generated token (StreamResult's docstring)")


def _well_formed(logprobs) -> bool:
    """Whether parse_logprobs(logprobs) cannot raise: a JSON object of either shape whose entries, and
    their top lists' entries, are objects (what servers send). Exact types (JSON gives no subclasses):
    a dict subclass is parsed at once, as anything else not known to be safe."""
    if type(logprobs) is not dict:
        return False
    content = logprobs.get("content")
    if type(content) is list:
        return _content_well_formed(content)
    tokens, tops = logprobs.get("tokens") or [], logprobs.get("top_logprobs")
    if type(tokens) is not list:
        return False
    if not tops:
        return True
    if type(tops) is not list:
        return False
    for top in tops[:len(tokens)]:
        if top and type(top) is not dict:
            return False
    return True


def _content_well_formed(content: list) -> bool:
    """The chat shape's `content`: objects, each one's `top_logprobs` a list of objects (or empty)."""
    for e in content:
        if type(e) is not dict:
            return False
        top = e.get("top_logprobs")
        if top:
            if type(top) is not list:
                return False
            for t in top:
                if type(t) is not dict:
                    return False
    return True


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
                         on_chunk: ChunkCallback | None = None, headers: dict | None = None,
                         on_first: Callable[[StreamResult], None] | None = None) -> StreamResult:
    """Send one streaming request and read it to the end. Never raises for a server or network
    failure: the result then has finish_reason "error" and the error text.

    Args:
        timeout_s: the whole request's limit (seconds), None for none; its expiry is an error.
        clock: the time source (seconds); the result's times are on it.
        result: the StreamResult to fill (its sent_s is reset to the send time), so a caller that
            cancels the request keeps what arrived; a new one when None.
        on_chunk: called after each chunk with the result so far and the chunk's text (every event is
            then parsed as it arrives: for a caller that acts in the middle of an answer, e.g. cuts it).
        headers: more request headers (the request-id audit's x-request-id).
        on_first: called once with the result when its first chunk has been read (first_s set).

    Without `on_chunk`, the events after the first chunk are not parsed as they arrive: each data line's
    bytes are kept with the time it was read (the chunk's time) and parsed when the answer ends, stops or
    fails (`_fold`), so that reading a stream costs little more than the reading itself. The result is the
    same as parsing each event as it comes: an event that is not JSON fails the request with the same
    error, and the chunks before it are kept.

    `client` is an httpx.AsyncClient (the request then goes out with `Connection: close`: llama.cpp's
    server closes the connection after every stream, so an httpx pooled connection reused at once fails, see
    kvtui.remote.llama_server) or a kvtui.remote.wire.WirePool (the load's pooled keep-alive connections).
    """
    result = result if result is not None else StreamResult(sent_s=0.0)
    result.sent_s = clock()
    try:
        await asyncio.wait_for(_read_stream(client, path, body, result, clock, on_chunk, on_first, headers or {}),
                               timeout_s)
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


async def _read_stream(client, path: str, body: dict, result: StreamResult, clock: Callable[[], float],
                       on_chunk: ChunkCallback | None, on_first, headers: dict) -> None:
    if isinstance(client, WirePool):
        payload = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
        async with client.post(path, payload, headers) as response:
            await _read_answer(response, response.byte_lines(), None, result, clock, on_chunk, on_first)
            await response.finish(DRAIN_S)  # the body's end after [DONE]: the connection can be reused
        return
    async with client.stream("POST", path, json=body, headers={**headers, "Connection": "close"}) as response:
        await _read_answer(response, response.aiter_lines(), response.request.url.path, result, clock, on_chunk,
                           on_first)


async def _read_answer(response, lines, path: str | None, result: StreamResult, clock: Callable[[], float],
                       on_chunk: ChunkCallback | None, on_first=None) -> None:
    """Fold an answer's server-sent events into `result` (an httpx response's text lines, or a
    kvtui.remote.wire response's byte lines): kvtui.remote.openai._Events."""
    result.status = response.status_code
    if response.status_code != 200:
        detail = (await response.aread()).decode("utf-8", "replace").strip()
        _failed(result, f"HTTP {response.status_code}: {detail[:300]}")
        return
    events = _Events(result, clock, on_chunk, on_first)
    try:
        async for line in lines:
            if events.read(line):
                return
    finally:
        if events.later:
            _fold(events.later, result)
    if not events.count:  # e.g. a 200 text/html page: no server-sent event at all
        raise BadAnswer(f"POST {path if path is not None else response.path} "
                        f"{answered(response, ' '.join(events.other), 'not a stream of server-sent events')}")


class _Events:
    """An answer's lines as they are read. Up to the first chunk (and throughout, with `on_chunk`) each
    event is parsed as it comes; after it, each data line is kept with its read time (`later`), for
    `_fold` at the end.

    Attributes:
        count: data lines read. other: the start of the other lines before the first data line (what came
            instead of a stream). later: (read time, payload) of the lines kept.
    """

    def __init__(self, result: StreamResult, clock: Callable[[], float], on_chunk: ChunkCallback | None,
                 on_first) -> None:
        self.result, self.clock, self.on_chunk, self.on_first = result, clock, on_chunk, on_first
        self.count, self.other, self.later = 0, [], []
        self.keep = False  # past the first chunk, without on_chunk: keep the lines instead of parsing them

    def read(self, line: bytes | str) -> bool:
        """One line; True at the stream's end (`data: [DONE]`).

        Raises:
            as _read_event, and whatever `on_chunk` raises.
        """
        if not line:  # the blank line that ends each event
            return False
        if not line.startswith(b"data:" if isinstance(line, bytes) else "data:"):
            self._other(line)
            return False
        self.count += 1
        if self.keep:
            payload = line[5:].strip()
            if _is_done(payload):
                return True
            self.later.append((self.clock(), payload))
            return False
        result = self.result
        chunks = len(result.chunk_times_s)
        if _read_event(line, result, self.clock):
            return True
        if len(result.chunk_times_s) > chunks:
            if self.on_chunk is not None:
                self.on_chunk(result, result.pieces[-1])
            else:
                self.keep = True
                if self.on_first is not None:
                    self.on_first(result)
        return False

    def _other(self, line: bytes | str) -> None:
        if self.count:
            return
        if isinstance(line, bytes):
            line = line.decode("utf-8", "replace")
        if line.strip() and sum(map(len, self.other)) < 200:
            self.other.append(line)


def _fold(later: list, result: StreamResult) -> None:
    """The kept data lines, in order, into `result`, each chunk at the time its line was read.

    Raises:
        BadAnswer, KeyError, TypeError, IndexError: as _read_event, at the first bad event (the ones before
            it are folded).
    """
    for t, payload in later:
        _fold_event(stream_event(payload), result, t)


def _is_done(payload: bytes | str) -> bool:
    """The stream's end marker (`data: [DONE]`), the payload stripped."""
    if isinstance(payload, bytes):
        return payload == b"[DONE]" or (b"[DONE]" in payload and payload.decode("utf-8", "replace").strip() == "[DONE]")
    return payload == "[DONE]"


def _failed(result: StreamResult, error: str) -> StreamResult:
    result.finish_reason, result.error = "error", error
    return result


def _read_event(line: bytes | str, result: StreamResult, clock: Callable[[], float]) -> bool:
    """Fold one SSE line into `result`; True at `data: [DONE]`. Comments and other fields are skipped.

    Raises:
        BadAnswer: a data line that is not a JSON object, or an error event; KeyError/TypeError/IndexError: a
            malformed chunk.
    """
    if not line.startswith(b"data:" if isinstance(line, bytes) else "data:"):
        return False
    payload = line[5:].strip()
    if _is_done(payload):
        return True
    data = stream_event(payload)
    _fold_event(data, result, clock() if data.get("choices") else 0.0)
    return False


def _fold_event(data: dict, result: StreamResult, t: float) -> None:
    """One event's JSON object into `result`; a chunk (an event with a choice) at time `t`."""
    if data.get("choices"):
        _add_chunk(data["choices"][0], result, t)
    usage = data.get("usage")
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
        result.completion_tokens = usage.get("completion_tokens", result.completion_tokens)
    cached = cached_tokens(data)
    if cached is not None:
        result.cached_tokens = cached


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
    result.add_logprobs(choice.get("logprobs"))
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
