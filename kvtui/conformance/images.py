"""The image check: one text with different pictures; every answer must be its own picture's.

The pictures are kvtui's canary pictures (kvtui/models/projector.py `canary_image`: a generated picture
of a word on a coloured background, which `kvtui serve --model dinov2-smollm2` reads as the word), each
sent inline as a PNG `data:` URL in one chat message between the texts of PROMPT, "Say the word<picture>
once." (SmolLM2's chat template puts the picture at position 27 of 36: in a full block for a prefix cache
of 16- or 32-token blocks, so another picture's request can reach it there). Greedy, streamed, with
logprobs. In order:

1. solo: a 1-token probe (a refusal makes the check n/a with the server's answer), then each picture
   alone past the prefix cache (a fresh cache_salt), without a uuid: its own answer.
2. through the prefix cache, under one cache_salt new to this run: each picture one at a time (the first
   fills the cache; the others share every text block with it and differ only at the picture's
   position), then all of them at once.
3. one uuid: two different pictures one at a time, each past the prefix cache, both labelled with the
   same image `uuid` (vLLM's per-part field, its multi_modal_uuids), so only an encoder cache keyed by
   the client's label can mix them up.

Every answer of 2 and 3 must equal its picture's solo answer (a difference at a near tie of the
logprobs aside). Fail: it equals another picture's solo answer (the evidence names which picture's) or
differs from its own. n/a: the server refuses image parts, or every picture gets the same solo answer
(the server ignores the picture, e.g. a text model behind a server that drops image parts).
"""

from __future__ import annotations

import asyncio
import base64
import io
import secrets

import httpx

from kvtui.conformance.base import CheckResult, Server, not_applicable, refusal, salt_words, send, short
from kvtui.remote.openai import CHAT_PATH, TOP_LOGPROBS, StreamResult
from kvtui.remote.solo_check import first_divergence

IMAGES = "images"
TITLE = "images"
PROMPT = ("Say the word", " once.")  # the text before and after the picture
TOKENS = 8  # greedy tokens per answer


def _pictures(n: int) -> list[tuple[str, str]]:
    """The first `n` canary pictures (the ones dinov2-smollm2's projector was fitted on): (word, PNG data URL)."""
    from kvtui.models.projector import CANARY_WORDS, canary_image

    out = []
    for k in range(n):
        buffer = io.BytesIO()
        canary_image(CANARY_WORDS[k], 0, k).save(buffer, format="PNG")
        out.append((CANARY_WORDS[k], "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()))
    return out


def _body(server: Server, url: str, salt: str | None, *, uuid: str | None = None, tokens: int = TOKENS,
          stream: bool = True) -> dict:
    """A greedy chat request showing the picture at `url` after PROMPT. `salt`: None, past the prefix cache
    (a fresh cache_salt); else that cache_salt (where the server takes one; llama.cpp: its default cache)."""
    part = {"type": "image_url", "image_url": {"url": url}}
    if uuid is not None:
        part["uuid"] = uuid
    extra = dict(stream=True, stream_options={"include_usage": True}, logprobs=True,
                 top_logprobs=TOP_LOGPROBS) if stream else {}
    body = server.chat_body("", max_tokens=tokens, temperature=0.0, **extra)
    body["messages"][0]["content"] = [{"type": "text", "text": PROMPT[0]}, part, {"type": "text", "text": PROMPT[1]}]
    return server.uncached(body) if salt is None else server.salted(body, salt)


def _answered(results: list[StreamResult], what: str) -> None:
    """Raise httpx.HTTPError naming the first request of `results` that failed."""
    bad = next((r for r in results if r.finish_reason == "error"), None)
    if bad is not None:
        raise httpx.HTTPError(f"an image request ({what}) failed: {bad.error}")


def _key(result: StreamResult) -> tuple:
    """What two answers are told apart by: the token keys when the server gave logprobs, else the text."""
    return tuple(t.key for t in result.tokens) if result.tokens else (result.text,)


def images(server: Server) -> CheckResult:
    """The same text with different pictures: solo, through the prefix cache one at a time and at once, and
    two pictures under one uuid (see the module docstring)."""
    n = 2 if server.quick else 3
    pictures = _pictures(n)
    sent = (f"{n} canary pictures (inline PNG) behind one text, greedy {TOKENS} tokens: each alone past the prefix "
            f"cache ({salt_words(server)}), then one at a time and all at once through it (one cache_salt for the "
            "run), then 2 of them one at a time with one shared image uuid")
    server.say(f"images: {sent}")
    with server.client() as client:
        r = client.post(CHAT_PATH, json=_body(server, pictures[0][1], None, tokens=1, stream=False))
    if r.status_code >= 400:
        return not_applicable(IMAGES, TITLE, sent, f"the server takes no images: {refusal(r)}")
    r.raise_for_status()
    solo = asyncio.run(send(server, [_body(server, url, None) for _, url in pictures], together=False))
    _answered(solo, "solo")
    distinct = len({_key(s) for s in solo})
    if distinct == 1:
        return not_applicable(IMAGES, TITLE, sent, f"the server ignores the picture: each of the {n} pictures got "
                              f"the same solo answer {short(solo[0].text, 40)}, so no answer can be told apart",
                              f"{n} solo answers, 1 distinct")
    salt = secrets.token_hex(16)
    cached = [_body(server, url, salt) for _, url in pictures]
    lone = asyncio.run(send(server, cached, together=False))
    together = asyncio.run(send(server, [_body(server, url, salt) for _, url in pictures], together=True))
    _answered(lone + together, "through the prefix cache")
    uuid = f"kvtui-{secrets.token_hex(8)}"
    labelled = asyncio.run(send(server, [_body(server, url, None, uuid=uuid) for _, url in pictures[:2]],
                                 together=False))
    uuid_note = _uuid_refused(labelled)
    if uuid_note is None:
        _answered(labelled, "with a uuid")
    runs = [("one at a time through the prefix cache", lone), ("all at once through the prefix cache", together)]
    if uuid_note is None:
        runs.append(("one uuid for 2 pictures", labelled))
    return _judge(server, sent, pictures, solo, runs, distinct, uuid_note)


def _uuid_refused(results: list[StreamResult]) -> str | None:
    """Why the server refused the image uuid (its 4xx answer), or None when it answered."""
    bad = next((r for r in results if r.finish_reason == "error" and r.status is not None and 400 <= r.status < 500),
               None)
    return None if bad is None else f"the server refuses an image uuid ({(bad.error or '')[:120]})"


def _judge(server: Server, sent: str, pictures: list[tuple[str, str]], solo: list[StreamResult], runs: list,
           distinct: int, uuid_note: str | None) -> CheckResult:
    """Each answer of `runs` [(what, [result per picture])] against its picture's solo answer."""
    tolerance = server.options().tolerance
    findings, counts, ties = [], [], 0
    for what, results in runs:
        equal = 0
        for k, result in enumerate(results):
            d = first_divergence(result, solo[k], tolerance)
            if d is None:
                equal += 1
                continue
            if d.kind == "numeric":
                ties += 1
                continue
            findings.append(_finding(what, k, result, solo, pictures, tolerance))
        counts.append(f"{what}: {equal} of {len(results)} equal their solo answer")
    cached = [r.cached_tokens for _, results in runs[:2] for r in results if r.cached_tokens is not None]
    reuse = (f"{sum(1 for c in cached if c)} of {2 * len(pictures)} served cached prompt tokens" if cached else
             "cached prompt tokens not reported")
    figures = (f"{len(pictures)} solo answers, {distinct} distinct; " + "; ".join(counts) +
               f"; {reuse}; {ties} near ties" + (f"; {uuid_note}" if uuid_note else ""))
    if findings:
        return CheckResult(IMAGES, TITLE, "fail", sent, figures, "; ".join(findings[:3]) +
                           (f"; {len(findings) - 3} more" if len(findings) > 3 else ""))
    return CheckResult(IMAGES, TITLE, "pass", sent, figures)


def _finding(what: str, k: int, result: StreamResult, solo: list[StreamResult], pictures, tolerance: float) -> str:
    """One answer that is not its picture's: whose solo answer it gave, or how it differs from its own."""
    own = _key(solo[k])
    for j, other in enumerate(solo):
        if j == k or _key(other) == own:
            continue
        d = first_divergence(result, other, tolerance)
        if d is None or d.kind == "numeric":
            return (f"{what}: picture {k} ({pictures[k][0]}) got picture {j}'s ({pictures[j][0]}) solo answer "
                    f"{short(result.text, 40)}; its own: {short(solo[k].text, 40)}")
    return (f"{what}: picture {k} ({pictures[k][0]}) answered {short(result.text, 40)}; its solo answer: "
            f"{short(solo[k].text, 40)}")
