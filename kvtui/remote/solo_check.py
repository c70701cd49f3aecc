"""The black-box reference check: a request's answer under load against the same prompt sent alone.

After the load, each completed greedy request (temperature 0) is sent again on its own, one at a time,
at temperature 0, and the two answers are compared token by token (by token id when the server gives
ids, else by token string; by text when it returns no logprobs). At the first differing token:

- the server returned top logprobs: when, in each run, the other run's token was within `tolerance`
  (nats) of that run's own choice, it is a near tie that numerical batch variance flipped: kind
  `numeric`. The distance reported is the larger of the two (for a two-way tie, the top-1 minus top-2
  logprob). When either run's distribution puts the other's token further away, or not among its top
  5 at all, the batched run's context was not what the solo run saw: kind `corruption` (every token
  before was the same in both, so the logits should have been too, up to numerical noise). Where one
  run has no token at that index (it ended), that run's top-1 minus top-2 gap decides.
- no logprobs: kind `unknown`: the answer changed under load, but the server gave nothing to tell a
  near tie from damage. Neither `numeric` nor `unknown` counts toward the exit code.

A divergence is never labelled `cross_request`: nothing in a changed token names a source. The requests
that were in flight at the same time are listed as `suspects` in the evidence.

A solo run never reads the server's prefix cache (see `uncached`): KV that the load wrote, damaged or
not, would otherwise be copied into the "solo" run, and the comparison would pass a corruption. vLLM
keeps its prefix cache on by default: on a long-prompt scenario 2,048 of a solo run's 2,381 prompt
tokens came from blocks the load had just written. llama.cpp's prompt cache restores the KV the load
left for the same prompt and prefills only the last token, and a one-token prefill rounds differently
from a whole-prompt one: measured on SmolLM2 Q4_1 (bursty.yaml's r011, -np 1), the same prompt sent
twice at temperature 0 gave different greedy tokens, top-2 gap 0.012 nats, with 63 of its 64 prompt
tokens from the cache the second time, and the first answer again with `cache_prompt: false`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from kvtui.events import Contamination, ReferenceEvidence
from kvtui.remote.openai import StreamResult


def uncached(body: dict, server_kind: str | None) -> dict:
    """A copy of a request body that the server answers without its prefix cache.

    llama.cpp (`server_kind` "llama.cpp"): `cache_prompt: false`. Any other server: a fresh random
    `cache_salt` (128 bits), the per-request cache namespace of vLLM (>= 0.9), SGLang and `kvtui serve`:
    no cached block carries it, so nothing is reused. Servers without it ignore the unknown field.
    """
    if server_kind == "llama.cpp":
        return {**body, "cache_prompt": False}
    return {**body, "cache_salt": secrets.token_hex(16)}


@dataclass(frozen=True)
class Divergence:
    """Where two answers first differ.

    Attributes:
        index: the token (or, without logprobs, streamed chunk) index of the first difference.
        batched_token / solo_token: the token ids there when the server gives ids (None past an end).
        gap: the smaller top-1 minus top-2 logprob of the two runs there (nats), None when unknown.
        kind: numeric, corruption or unknown (see the module docstring).
        batched_piece / solo_piece: the two tokens' text (None past an end).
    """

    index: int
    batched_token: int | None
    solo_token: int | None
    gap: float | None
    kind: str
    batched_piece: str | None = None
    solo_piece: str | None = None


def first_divergence(batched: StreamResult, solo: StreamResult, tolerance: float) -> Divergence | None:
    """The first difference between two answers to the same prompt, or None when they are the same."""
    if batched.tokens and solo.tokens:
        a, b = [t.key for t in batched.tokens], [t.key for t in solo.tokens]
        if a == b:
            return None
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        gap, kind = _flip_distance(batched.tokens[i:i + 1], solo.tokens[i:i + 1], tolerance)
        return Divergence(i, _id(batched, i), _id(solo, i), gap, kind, _text(batched, i), _text(solo, i))
    if batched.text == solo.text:
        return None
    a, b = [p for p in batched.pieces if p], [p for p in solo.pieces if p]
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return Divergence(i, None, None, None, "unknown", a[i] if i < len(a) else None, b[i] if i < len(b) else None)


def _flip_distance(a: list, b: list, tolerance: float) -> tuple[float | None, str]:
    """(distance in nats, kind) at a divergence; `a` and `b` hold each run's token there (or nothing)."""
    if not a or not b:  # one run ended here: its rival's own top-1/top-2 gap is all there is
        gap = (a or b)[0].top2_gap if (a or b) else None
        return gap, "unknown" if gap is None else ("numeric" if gap <= tolerance else "corruption")
    x, y = a[0], b[0]
    if not x.top or not y.top:
        return None, "unknown"
    lags = [x.below_top(y.key), y.below_top(x.key)]
    # a token missing from a run's top list lies further below than the last one listed
    floors = [lag if lag is not None else t.top[0][1] - t.top[-1][1] for lag, t in zip(lags, (x, y))]
    if None not in lags:
        return max(lags), "numeric" if max(lags) <= tolerance else "corruption"
    return None, "corruption" if max(floors) > tolerance else "unknown"


@dataclass(frozen=True)
class Drift:
    """How far two token-equal answers' logprobs lie apart.

    Attributes:
        index: the token where the move is largest; nats: that move, the largest |logprob difference| of a
            token both runs list among their top logprobs there; token: its text there.
    """

    index: int
    nats: float
    token: str


def logprob_drift(batched: StreamResult, solo: StreamResult) -> Drift | None:
    """The largest move of a listed token's logprob between two answers with the same tokens (the same
    prompt computed twice, e.g. once through the prefix cache and once past it). A token listed twice in
    one run's top list (two ids with one text, where the server gives text only) is left out: its two
    logprobs cannot be told apart. None when either run has no logprobs, the answers differ
    (first_divergence judges those) or no token is listed once by both."""
    if not batched.tokens or [t.key for t in batched.tokens] != [t.key for t in solo.tokens]:
        return None
    best = None
    for i, (a, b) in enumerate(zip(batched.tokens, solo.tokens)):
        ours, theirs = listed_once(a.top), listed_once(b.top)
        for key, logprob in ours.items():
            if key in theirs and (best is None or abs(logprob - theirs[key]) > best.nats):
                best = Drift(i, abs(logprob - theirs[key]), a.token)
    return best


def listed_once(top) -> dict:
    """key -> logprob of the keys a top list holds once (a key listed twice, two ids with one text where the
    server gives text only, cannot be told apart)."""
    keys = [key for key, _ in top]
    return {key: logprob for key, logprob in top if keys.count(key) == 1}


def _id(result: StreamResult, i: int) -> int | None:
    return result.tokens[i].id if i < len(result.tokens) else None


def _text(result: StreamResult, i: int) -> str | None:
    return result.tokens[i].token if i < len(result.tokens) else None


def reference_event(request_id: str, batched: StreamResult, solo: StreamResult, *, tolerance: float, t: float,
                    suspects: tuple[str, ...] = ()) -> Contamination | None:
    """A `reference` contamination report for `request_id` when its answer differs from its solo run."""
    d = first_divergence(batched, solo, tolerance)
    if d is None:
        return None
    return Contamination(
        t=t, step=-1, detector="reference", kind=d.kind, victim=request_id, source=None,
        evidence=ReferenceEvidence(token_index=d.index, batched_token=d.batched_token, solo_token=d.solo_token,
                                   top2_gap=None if d.gap is None else round(d.gap, 6), tolerance=tolerance,
                                   batched_text=batched.text, solo_text=solo.text, suspects=suspects,
                                   batched_piece=d.batched_piece, solo_piece=d.solo_piece))
