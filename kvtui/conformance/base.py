"""What every conformance check shares: the server under test (`Server`), one check's result
(`CheckResult`) and the small helpers the checks use to talk to the server.

A check is a function `(Server) -> CheckResult`. It sends its own requests, judges them, and says
what it sent, its verdict (pass, fail, or n/a with the reason), the figures it measured and the
evidence for a fail. A check that cannot reach the server, or reads an answer that is not JSON
(kvtui.remote.reach.json_body), raises `TargetError` (the command's exit 3).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Literal

import httpx

from kvtui.remote.openai import CHAT_PATH, StreamResult, stream_request
from kvtui.remote.options import DEFAULT_TOLERANCE, TargetOptions
from kvtui.remote.solo_check import uncached

Verdict = Literal["pass", "fail", "n/a"]
VERDICTS: tuple[Verdict, ...] = ("pass", "fail", "n/a")


@dataclass
class Server:
    """The server under test and how to drive it.

    Attributes:
        url: base URL (http://HOST:PORT; the /v1/... paths are added).
        model: kvtui's name of the model the server serves (its tokenizer plans the prompts; "default" is
            SmolLM2-135M-Instruct); tokenizer: that model's tokenizer.
        served_model: the `model` field to send (None: the first of /v1/models).
        server_kind: what /v1/models' owned_by says ("vLLM", "llama.cpp", "kvtui", ...; None unknown).
        timeout_s: one request's limit (seconds).
        tolerance: the server's numeric noise (nats): a top-2 logprob gap under which a differing greedy
            token is a numeric flip, and the most a token-equal answer's logprobs may move against its solo
            run (the prompt-cache check). --target servers: 0.5 (bfloat16 servers flip gaps up to a few
            tenths); kvtui's own float32 server: 1e-3 (its batched-vs-solo spread is under 1e-4).
        quick: fewer requests per check (CI); say: where progress lines go.
    """

    url: str
    model: str
    tokenizer: object
    served_model: str | None = None
    server_kind: str | None = None
    timeout_s: float = 120.0
    tolerance: float = DEFAULT_TOLERANCE
    quick: bool = False
    say: Callable[[str], None] = field(default=lambda text: None)
    _salt: list = field(default_factory=list, repr=False, compare=False)  # [salt_refusal()] once asked

    def options(self, **changes) -> TargetOptions:
        """TargetOptions for a TargetSession or the timing audit against this server."""
        return TargetOptions(url=self.url, served_model=self.served_model, timeout_s=self.timeout_s,
                             tolerance=self.tolerance, **changes)

    def client(self) -> httpx.Client:
        """A blocking client on the server's base URL (the caller closes it)."""
        return httpx.Client(base_url=self.url.rstrip("/"), timeout=httpx.Timeout(self.timeout_s))

    def async_client(self) -> httpx.AsyncClient:
        """An asyncio client on the server's base URL (the caller closes it)."""
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=0)
        return httpx.AsyncClient(base_url=self.url.rstrip("/"), timeout=httpx.Timeout(self.timeout_s), limits=limits)

    def salt_refusal(self) -> str | None:
        """Why the server takes no `cache_salt` (its 4xx answer to a 1-token chat request carrying one, e.g.
        transformers serve's 422, where the same request without it is answered), or None when it takes one
        (llama.cpp: None, `cache_prompt: false` stands in). Asked once per server."""
        if not self._salt:
            refused = None
            if self.server_kind != "llama.cpp":
                body = self.chat_body("Hi", max_tokens=1)
                with self.client() as client:
                    r = client.post(CHAT_PATH, json=uncached(body, self.server_kind))
                    if 400 <= r.status_code < 500 and client.post(CHAT_PATH, json=body).status_code == 200:
                        refused = f"the server refuses cache_salt: {refusal(r)}"
            self._salt.append(refused)
        return self._salt[0]

    def uncached(self, body: dict) -> dict:
        """`body` past the server's prefix cache (a fresh cache_salt; llama.cpp: cache_prompt false); `body` as
        it is when the server refuses cache_salt (the checks that send it say so)."""
        if self.salt_refusal():
            return dict(body)
        return uncached(body, self.server_kind)

    def salted(self, body: dict, salt: str) -> dict:
        """`body` under the cache namespace `salt`: its cache_salt; as it is where the server refuses the salt or
        is llama.cpp (no namespaces: its one prompt cache)."""
        if self.salt_refusal() or self.server_kind == "llama.cpp":
            return dict(body)
        return {**body, "cache_salt": salt}

    def chat_body(self, text: str, *, max_tokens: int, **extra) -> dict:
        """A chat completions body with one user message `text` (non-streamed unless `extra` says so)."""
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, **extra}
        if self.served_model:
            body["model"] = self.served_model
        return body


@dataclass
class CheckResult:
    """One class's outcome.

    Attributes:
        check: the check's name (`--check NAME`); title: its heading in the table.
        verdict: "pass", "fail" or "n/a".
        sent: what the check sent, one line.
        figures: what it measured, one line.
        evidence: a fail's evidence (victim, source, the differing text), or the n/a reason.
        seconds: wall time the check took.
        parts: a check of several parts (recurrent_state): each part's name, verdict, figures and evidence
            ({} each); [] for a check of one part. Left out of as_dict when empty.
    """

    check: str
    title: str
    verdict: Verdict
    sent: str
    figures: str
    evidence: str = ""
    seconds: float = 0.0
    parts: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        """The result as plain JSON-ready data (`parts` only when the check has parts)."""
        data = asdict(self)
        if not self.parts:
            del data["parts"]
        return data


async def send(server: Server, bodies: list[dict], together: bool) -> list[StreamResult]:
    """Stream each chat body to the server, one at a time or all at once (`together`); the results in order.
    Never raises for a server or network failure (the result's finish_reason is then "error")."""
    async with server.async_client() as client:
        if together:
            return list(await asyncio.gather(*(stream_request(client, CHAT_PATH, b, timeout_s=server.timeout_s)
                                               for b in bodies)))
        return [await stream_request(client, CHAT_PATH, b, timeout_s=server.timeout_s) for b in bodies]


def not_applicable(check: str, title: str, sent: str, why: str, figures: str = "") -> CheckResult:
    """An n/a result whose evidence is the reason."""
    return CheckResult(check, title, "n/a", sent, figures or "-", why)


def refusal(response: httpx.Response) -> str:
    """A 4xx answer in one line: its status and the server's message, cut to 200 characters."""
    try:
        data = response.json()
        message = data.get("error", data) if isinstance(data, dict) else data
        if isinstance(message, dict):
            message = message.get("message", message)
    except ValueError:
        message = response.text
    return f"HTTP {response.status_code}: {' '.join(str(message).split())[:200]}"


def salt_words(server: Server) -> str:
    """How a check's requests go past the prefix cache, for its `sent` line."""
    if server.salt_refusal():
        return "no cache_salt (the server refuses it)"
    return "cache_prompt false on each" if server.server_kind == "llama.cpp" else "fresh cache_salt on each"


def fresh_seed() -> int:
    """A random seed below 2**30 (every run its own: a server's cache outlives runs)."""
    return secrets.randbelow(1 << 30)


def short(text: str, limit: int = 60) -> str:
    """`text` on one line, cut to `limit` characters, quoted."""
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= limit else flat[: limit - 1] + "…")
