"""A mock OpenAI-compatible server for timing load generators (`kvtui bench --part loadgen`).

It answers every streamed completion with the same `tokens` tokens: the first `first_token_s` seconds after
the request arrived, then one every `gap_s`, each timed from the arrival (absolute deadlines, so a late
wake-up does not push the later tokens back). No model, no tokenizer: whatever TTFT a client measures
above `first_token_s` was added by the client (or by this process being starved of CPU).

A raw asyncio HTTP/1.1 server (keep-alive, chunked server-sent events; `Connection: close` honoured), fast
enough not to be the bottleneck at a few hundred requests per second on one core:

- `GET /v1/models`: one model, `mock`.
- `POST /v1/completions`, `POST /v1/chat/completions`: streamed (`stream: true`) or one JSON answer;
  logprobs when asked (the chat shape for chat, the legacy shape for completions); `usage` at the end
  when `stream_options.include_usage` is set.
- `GET /mock/arrivals`: the arrival log, `{"arrivals": [...]}`: time.monotonic() (seconds, one clock for
  every process of the machine) when each completion request's head was read, in order.
- anything else: 404 (so clients stop asking for /metrics, /slots or /tokenize).

Run it in a process of its own: `python -m kvtui.remote.mock_openai --port 0`; it prints
`mock-openai listening on PORT` once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

MODEL = "mock"
PIECE = " tok"


def _event(data: dict) -> bytes:
    """One server-sent event as an HTTP/1.1 chunk (size line, data, CRLF)."""
    line = b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(line), line)


DONE = b"data: [DONE]\n\n"
DONE_CHUNK = b"%x\r\n%s\r\n" % (len(DONE), DONE)
LAST_CHUNK = b"0\r\n\r\n"


class Answers:
    """The pre-encoded chunks of one answer shape (chat or completions, with or without logprobs).

    Args:
        tokens: tokens per answer (>= 1).
    """

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self._cache: dict[tuple[bool, bool, bool], tuple[list[bytes], bytes | None]] = {}

    def stream(self, chat: bool, logprobs: bool, usage: bool) -> tuple[list[bytes], bytes | None]:
        """(one chunk per token, the usage chunk or None), encoded once per shape."""
        key = (chat, logprobs, usage)
        if key not in self._cache:
            chunks = [_event(self._chunk(chat, logprobs, k)) for k in range(self.tokens)]
            tail = _event({"id": "mock", "object": self._object(chat), "model": MODEL, "choices": [],
                           "usage": self._usage()}) if usage else None
            self._cache[key] = (chunks, tail)
        return self._cache[key]

    def whole(self, chat: bool) -> bytes:
        """A non-streamed answer's JSON body."""
        text = PIECE * self.tokens
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"} if chat
                  else {"index": 0, "text": text, "finish_reason": "length"})
        return json.dumps({"id": "mock", "object": "chat.completion" if chat else "text_completion", "model": MODEL,
                           "choices": [choice], "usage": self._usage()}).encode()

    @staticmethod
    def _object(chat: bool) -> str:
        return "chat.completion.chunk" if chat else "text_completion"

    def _usage(self) -> dict:
        return {"prompt_tokens": 1, "completion_tokens": self.tokens, "total_tokens": 1 + self.tokens}

    def _chunk(self, chat: bool, logprobs: bool, k: int) -> dict:
        last = k == self.tokens - 1
        choice: dict = {"index": 0, "finish_reason": "length" if last else None}
        if chat:
            choice["delta"] = {"content": PIECE}
        else:
            choice["text"] = PIECE
        if logprobs:
            top = [(PIECE, -0.1), (" tak", -2.5), (" tik", -3.0), (" tuk", -3.5), (" tek", -4.0)]
            choice["logprobs"] = ({"content": [{"token": PIECE, "logprob": -0.1, "top_logprobs": [
                {"token": t, "logprob": lp} for t, lp in top]}]} if chat else
                {"tokens": [PIECE], "token_logprobs": [-0.1], "top_logprobs": [dict(top)]})
        return {"id": "mock", "object": self._object(chat), "model": MODEL, "choices": [choice]}


class MockServer:
    """The server's state: its timing and the arrival log.

    Args:
        first_token_s: seconds from a request's arrival to its first token.
        gap_s: seconds between two tokens.
        tokens: tokens per answer.
    """

    def __init__(self, first_token_s: float = 0.020, gap_s: float = 0.005, tokens: int = 32) -> None:
        if first_token_s < 0 or gap_s < 0 or tokens < 1:
            raise ValueError("first_token_s and gap_s must be >= 0 and tokens >= 1")
        self.first_token_s, self.gap_s = first_token_s, gap_s
        self.answers = Answers(tokens)
        self.arrivals: list[float] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one connection's requests in turn until the client closes it or asks to."""
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                arrived = time.monotonic()
                lines = head.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ")[:2]
                headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:] if h)}
                length = int(headers.get("content-length", "0") or 0)
                body = await reader.readexactly(length) if length else b""
                close = headers.get("connection", "").lower() == "close"
                await self._answer(method, path.split("?")[0], body, arrived, writer, close)
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()

    async def _answer(self, method: str, path: str, body: bytes, arrived: float, writer, close: bool) -> None:
        keep = b"close" if close else b"keep-alive"
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            self.arrivals.append(arrived)
            request = json.loads(body or b"{}")
            await self._complete(path.endswith("chat/completions"), request, arrived, writer, keep)
        elif method == "GET" and path == "/v1/models":
            self._json(writer, keep, {"object": "list", "data": [{"id": MODEL, "object": "model", "root": MODEL,
                                                                  "owned_by": "kvtui-mock"}]})
        elif method == "GET" and path == "/mock/arrivals":
            self._json(writer, keep, {"arrivals": self.arrivals})
        elif method == "GET" and path == "/health":
            self._json(writer, keep, {})
        else:
            self._json(writer, keep, {"error": {"message": f"{method} {path}: not served by the mock"}}, b"404 Not Found")
        await writer.drain()

    @staticmethod
    def _json(writer, keep: bytes, data: dict, status: bytes = b"200 OK") -> None:
        payload = json.dumps(data).encode()
        writer.write(b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: %s\r\n\r\n%s"
                     % (status, len(payload), keep, payload))

    async def _complete(self, chat: bool, request: dict, arrived: float, writer, keep: bytes) -> None:
        if not request.get("stream"):
            await self._sleep_until(arrived + self.first_token_s + self.gap_s * (self.answers.tokens - 1))
            self._json(writer, keep, json.loads(self.answers.whole(chat)))
            return
        logprobs = bool(request.get("logprobs"))
        usage = bool((request.get("stream_options") or {}).get("include_usage"))
        chunks, tail = self.answers.stream(chat, logprobs, usage)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                     b"Transfer-Encoding: chunked\r\nConnection: %s\r\n\r\n" % keep)
        for k, chunk in enumerate(chunks):
            await self._sleep_until(arrived + self.first_token_s + k * self.gap_s)
            writer.write(chunk)
        writer.write((tail or b"") + DONE_CHUNK + LAST_CHUNK)

    @staticmethod
    async def _sleep_until(t: float) -> None:
        delay = t - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)


async def serve(server: MockServer, host: str, port: int, ready=None) -> None:
    """Serve until cancelled; `ready(port)` is called once the socket listens."""
    listener = await asyncio.start_server(server.handle, host, port, backlog=4096)
    bound = listener.sockets[0].getsockname()[1]
    if ready is not None:
        ready(bound)
    async with listener:
        await listener.serve_forever()


def main(argv: list[str] | None = None) -> None:
    """`python -m kvtui.remote.mock_openai [--port P] [--first-token-ms MS] [--gap-ms MS] [--tokens N]`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--first-token-ms", type=float, default=20.0)
    parser.add_argument("--gap-ms", type=float, default=5.0)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args(argv)
    server = MockServer(args.first_token_ms / 1000, args.gap_ms / 1000, args.tokens)

    def ready(port: int) -> None:
        print(f"mock-openai listening on {port}", flush=True)

    try:
        asyncio.run(serve(server, args.host, args.port, ready))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
