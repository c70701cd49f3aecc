"""A fake OpenAI-compatible server for the target tests: streams a scripted answer per request, as an
httpx transport (in-process, no socket) or as a real HTTP server on 127.0.0.1 in a thread.

Each answer is "The passphrase is <the passphrase in the prompt>." split into word pieces, one SSE chunk
per piece (a role chunk first on the chat API, a finish chunk and a usage chunk last), with per-token
logprobs in llama.cpp's shape. Switches make it misbehave in one way each (leak, fail, hang, vary with
load), and it keeps a log of what it did, which the tests use as ground truth.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

PASSPHRASE = re.compile(r"[A-Z]+-[A-Z]+-\d\d")
PAGE = "<!DOCTYPE html>\n<html><head><title>Not Found</title></head><body><h1>Not Found</h1></body></html>\n"

LLAMACPP_METRICS = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 58
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 16
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 3
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
"""


@dataclass
class FakeOpenAI:
    """Behaviour switches (all off: a correct server).

    Attributes:
        delay_s: seconds between two chunks (asyncio.sleep) in transport mode.
        leak: answer with the passphrase of the previous different request seen (a cross-request leak).
        fail: passphrases whose requests get HTTP 500.
        hang: passphrases whose requests stall for 30 s before their first chunk (for timeouts).
        vary_under_load: (token index, gap, swap) - while another request is in flight, the answer's token
            at that index changes, and the top-2 logprob gap there is `gap` in every run; with `swap` the
            runner-up there is the other run's token (a near tie flipped), else an unrelated token.
        logprobs: return logprobs when asked.
        metrics: Prometheus text for /metrics (None: 404). slots: JSON for /slots (None: 404), or "live":
            4 llama.cpp-style slots (debug fields on) holding the requests streaming now.
        clock_steps: transport mode: before chunk k, set `self.now` to clock_steps[k] (a fake clock).
        prefix_cache: a prefix cache that reports `usage.prompt_tokens_details.cached_tokens` (all 7 prompt
            tokens for a prompt seen before, else 0): "honours_salt" keys it by (cache_salt, prompt) and
            skips it for `cache_prompt: false`; "ignores_salt" keys it by the prompt alone; "prefix" as
            "honours_salt", but a chat prompt whose first messages are a prompt seen before hits too (a next
            turn); None: no cache, nothing reported.
        stale_state: a planted recurrent-state leak, which changes the answer's fourth piece: "abort" - a
            prompt whose last sending has not written its whole answer (still streaming, or its client closed
            the stream early) answers " STALE", as a server that publishes a request's state when it is
            scheduled and writes it as it goes; "slot" - every answer carries a piece named after
            the previous request's prompt (a slot that starts from the state its last request wrote).
        owned_by: /v1/models' `owned_by` (e.g. "llamacpp", "vllm"), None to leave it out.
        html: passphrases whose requests get a 200 text/html page (PAGE) instead of a stream; "event": those
            get a stream whose first event's data is that page (not JSON).
    """

    delay_s: float = 0.0
    leak: bool = False
    fail: tuple[str, ...] = ()
    hang: tuple[str, ...] = ()
    vary_under_load: tuple[int, float, bool] | None = None
    logprobs: bool = True
    metrics: str | None = None
    slots: list | str | None = None
    clock_steps: list[float] | None = None
    model: str = "fake-model"
    prefix_cache: str | None = None
    owned_by: str | None = None
    html: tuple[str, ...] = ()
    html_as: str = "page"  # "page": a text/html answer; "event": an event stream whose data is the page
    now: float = 0.0
    in_flight: int = 0
    max_in_flight: int = 0
    requests: list[dict] = field(default_factory=list)
    leaks: list[tuple[str, str]] = field(default_factory=list)  # (victim passphrase, leaked passphrase)
    _last: str | None = None
    _original: list = field(default_factory=list)  # the last answer before any change
    _streaming: dict = field(default_factory=dict)  # id(body) -> its prompt text, while it streams
    _cached: set = field(default_factory=set)  # prefix_cache: the keys of the prompts seen
    stale_state: str | None = None
    stale: list[str] = field(default_factory=list)  # stale_state: the prompts whose answer it changed
    _unwritten: set = field(default_factory=set)  # stale_state "abort": prompts whose last answer is unfinished
    _previous: str = ""  # stale_state "slot": the last prompt answered

    def clock(self) -> float:
        return self.now

    def _slots(self):
        if self.slots != "live":
            return self.slots
        busy = list(self._streaming.values())[:4]
        return [{"id": i, "n_ctx": 512, "is_processing": i < len(busy),
                 **({"n_prompt_tokens": 40, "next_token": [{"n_decoded": 2}], "prompt": busy[i]} if i < len(busy) else {})}
                for i in range(4)]

    # -- the answer -----------------------------------------------------------------------------------
    def _answer(self, body: dict) -> tuple[str | None, list[str], int | None]:
        """(the prompt's passphrase, answer pieces, index of a changed token or None)."""
        prompt = json.dumps(body.get("messages") or body.get("prompt"))
        found = PASSPHRASE.search(prompt)
        own = found.group(0) if found else None
        said = own
        if self.leak and own and self._last and self._last != own:
            said = self._last
            self.leaks.append((own, said))
        if own:
            self._last = own
        pieces = ["The", " passphrase", " is", f" {said}", "."]
        key = _prompt_key(body)
        if self.stale_state == "abort" and key in self._unwritten:
            pieces[3] = " STALE"
            self.stale.append(key)
        elif self.stale_state == "slot":
            pieces[3] = f" S{zlib.crc32(self._previous.encode()) % 997}"
            self.stale.append(key)
        self._unwritten.add(key)
        self._previous = key
        self._original = list(pieces)
        changed = None
        if self.vary_under_load and self.in_flight > 1:
            changed = self.vary_under_load[0]
            pieces[changed] = " CHANGED"
        return own, pieces[: body.get("max_tokens", 99)], changed

    def _chunks(self, body: dict, pieces: list[str], changed: int | None) -> list[str]:
        chat = "messages" in body
        want = self.logprobs and (body.get("logprobs") is not None and body.get("logprobs") is not False)
        out = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]}] if chat else []
        for i, piece in enumerate(pieces):
            gap, other = 3.0, "?"
            if self.vary_under_load and i == self.vary_under_load[0]:
                gap = self.vary_under_load[1]
                if self.vary_under_load[2]:
                    other = self._original[i] if i == changed else " CHANGED"
            choice = {"index": 0, "finish_reason": None}
            choice.update({"delta": {"content": piece}} if chat else {"text": piece})
            if want:
                choice["logprobs"] = {"content": [_token(piece, gap, other)]}
            out.append({"choices": [choice]})
        last = "length" if len(pieces) < 5 else "stop"
        out.append({"choices": [{"index": 0, "finish_reason": last, **({"delta": {}} if chat else {"text": ""})}]})
        usage = {"prompt_tokens": 7, "completion_tokens": len(pieces)}
        if self.prefix_cache:
            usage["prompt_tokens_details"] = {"cached_tokens": self._cache_lookup(body)}
        out.append({"choices": [], "usage": usage})
        return [f"data: {json.dumps(c)}\n\n" for c in out] + ["data: [DONE]\n\n"]

    def _written(self, body: dict) -> None:
        """The request's whole answer was handed out (its last chunk written)."""
        self._unwritten.discard(_prompt_key(body))

    def _cache_lookup(self, body: dict) -> int:
        """Prompt tokens this request reads from the fake prefix cache (and remember its prompt)."""
        if self.prefix_cache in ("honours_salt", "prefix") and body.get("cache_prompt") is False:
            return 0
        salt = body.get("cache_salt") if self.prefix_cache in ("honours_salt", "prefix") else None
        if self.prefix_cache == "prefix" and body.get("messages"):
            messages = body["messages"]
            keys = [(salt, json.dumps(messages[:n])) for n in range(1, len(messages) + 1)]
            hit = any(k in self._cached for k in keys)
            self._cached.add(keys[-1])
            return 7 if hit else 0
        key = (salt, json.dumps(body.get("messages") or body.get("prompt")))
        hit = key in self._cached
        self._cached.add(key)
        return 7 if hit else 0

    def models(self) -> dict:
        entry = {"id": self.model, **({"owned_by": self.owned_by} if self.owned_by else {})}
        return {"object": "list", "data": [entry]}

    # -- transport mode --------------------------------------------------------------------------------
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=self.models())
        if request.url.path in ("/metrics", "/slots"):
            payload = self.metrics if request.url.path == "/metrics" else self._slots()
            if payload is None:
                return httpx.Response(404, text="not found")
            return httpx.Response(200, text=payload) if isinstance(payload, str) else httpx.Response(200, json=payload)
        body = json.loads(request.content)
        self.requests.append(body)
        own = (PASSPHRASE.search(json.dumps(body.get("messages") or body.get("prompt"))) or [None])[0]
        if own in self.fail:
            return httpx.Response(500, json={"error": {"message": f"boom for {own}"}})
        if own in self.html and self.html_as == "page":
            return httpx.Response(200, headers={"content-type": "text/html; charset=utf-8"}, text=PAGE)
        if own in self.html:
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, text=f"data: {PAGE}\n\n")
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=self._stream(body, own))

    async def _stream(self, body: dict, own: str | None):
        """The SSE body. A request counts as in flight until its last chunk is handed out (the client
        stops reading at `[DONE]`, so the generator is not always run to its end)."""
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self._streaming[id(body)] = json.dumps(body.get("messages") or body.get("prompt"))
        done = False
        try:
            await asyncio.sleep(30 if own in self.hang else self.delay_s)
            _, pieces, changed = self._answer(body)
            chunks = self._chunks(body, pieces, changed)
            for k, chunk in enumerate(chunks):
                if self.clock_steps is not None and k < len(self.clock_steps):
                    self.now = self.clock_steps[k]
                if k == len(chunks) - 1:
                    done = True
                    self.in_flight -= 1
                    self._streaming.pop(id(body), None)
                yield chunk.encode()
                await asyncio.sleep(self.delay_s)
        finally:
            if done:
                self._written(body)
            else:
                self.in_flight -= 1
                self._streaming.pop(id(body), None)


def _prompt_key(body: dict) -> str:
    """A request's prompt (chat messages or completions prompt) as one string."""
    return json.dumps(body.get("messages") or body.get("prompt"))


def _token(piece: str, gap: float, other: str) -> dict:
    """One logprobs entry: `piece` chosen, `other` the runner-up `gap` nats below, then three fillers
    further down (llama.cpp's shape, top 5)."""
    def entry(text: str, logprob: float) -> dict:
        return {"id": zlib.crc32(text.encode()) % 49152, "token": text, "logprob": logprob}

    fillers = [entry(f"<filler {k}>", -0.1 - gap - 1.0 - k) for k in range(3)]
    return {**entry(piece, -0.1), "top_logprobs": [entry(piece, -0.1), entry(other, -0.1 - gap), *fillers]}


class FakeHTTPServer:
    """`fake` served over real HTTP on 127.0.0.1 (a free port) from a thread: `with FakeHTTPServer(f) as url:`.
    Streams close-delimited (`Connection: close`), as llama.cpp's server does."""

    def __init__(self, fake: FakeOpenAI, chunk_delay_s: float = 0.01) -> None:
        self.fake, self.delay = fake, chunk_delay_s
        fake_ref, delay, lock = fake, chunk_delay_s, threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                if self.path == "/v1/models":
                    return self._send(200, json.dumps(fake_ref.models()))
                payload = fake_ref.metrics if self.path == "/metrics" else fake_ref.slots if self.path == "/slots" else None
                if payload is None:
                    return self._send(404, "not found")
                self._send(200, payload if isinstance(payload, str) else json.dumps(payload))

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    fake_ref.requests.append(body)
                    fake_ref.in_flight += 1
                    fake_ref.max_in_flight = max(fake_ref.max_in_flight, fake_ref.in_flight)
                try:
                    time.sleep(delay)
                    with lock:
                        own, pieces, changed = fake_ref._answer(body)
                    if own in fake_ref.fail:
                        return self._send(500, json.dumps({"error": {"message": f"boom for {own}"}}))
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    for chunk in fake_ref._chunks(body, pieces, changed):
                        self.wfile.write(chunk.encode())
                        self.wfile.flush()
                        time.sleep(delay)
                    with lock:
                        fake_ref._written(body)
                except (BrokenPipeError, ConnectionResetError):  # the client went away (a stopped run)
                    pass
                finally:
                    with lock:
                        fake_ref.in_flight -= 1

            def _send(self, code: int, text: str):
                self.send_response(code)
                self.send_header("Content-Length", str(len(text.encode())))
                self.end_headers()
                self.wfile.write(text.encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


class PageServer:
    """A web server that is not an OpenAI-compatible API: every GET and POST gets `status` with an HTML page
    (PAGE, text/html), as a wrong base URL or a proxy's error page does. `with PageServer(404) as url:`."""

    def __init__(self, status: int = 404, content_type: str = "text/html; charset=utf-8", text: str = PAGE) -> None:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                self._page()

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._page()

            def _page(self):
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(text.encode())))
                self.end_headers()
                self.wfile.write(text.encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
