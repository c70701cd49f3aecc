"""The checks of API features kvtui's target session does not send: parallel sampling (n > 1) and
structured output (response_format json_schema) beside plain requests.

Both isolate their own property from batching in general. n > 1: one request with n choices runs
alone (its choices are the only rows, all of one length), and choice i is compared with a separate
request seeded seed + i, also alone (vLLM's and kvtui's seeding of a request's children). Structured
output: the plain requests' answers in a round beside constrained neighbours are compared with their
answers in a control round of the same shape where those neighbours are plain, so anything but the
neighbours' grammar is the same in both rounds; every prompt is the same text, so every row has one
length.
"""

from __future__ import annotations

import asyncio
import json

import httpx

from kvtui.conformance.base import CheckResult, Server, fresh_seed, not_applicable, refusal, salt_words, short
from kvtui.remote.openai import CHAT_PATH, TOP_LOGPROBS, StreamResult, TokenInfo, parse_logprobs, stream_request
from kvtui.remote.reach import json_body
from kvtui.remote.solo_check import first_divergence, listed_once

N, STRUCTURED = "parallel_sampling", "structured_output"
TITLES = {N: "n > 1 (parallel sampling)", STRUCTURED: "structured output beside plain requests"}
STORY = "Write a short story about a lighthouse keeper and a {word}."
WORDS = ("fox", "violin", "comet")
# words added to the story request, one at a time, until its chat prompt ends 1 token past a multiple of
# ALIGN tokens (a multiple of every block size the servers here use: 16, 32, 64): the prompt's last,
# partial block then holds 1 prompt token and room for the first generated tokens of every choice, so the
# choices share that block while they write their first tokens (with 10 free places, choices that agreed on
# their first 6 tokens once hid a server that forks them without copy-on-write)
MORE = ("It should be set on a rocky island far out at sea, during one long winter night when a storm cuts "
        "the keeper off from the mainland and the lamp must be kept burning until the supply boat comes back "
        "in the spring, and it should end quietly.").split()
ALIGN = 64


def _story(server: Server, word: str) -> str:
    """The story request for `word`, with MORE's words added until its chat prompt is 1 token past a multiple
    of ALIGN (as close as MORE allows)."""
    text = STORY.format(word=word)
    best = (ALIGN, text)
    for k in range(len(MORE) + 1):
        candidate = " ".join([text, *MORE[:k]])
        ids = server.tokenizer.apply_chat_template([{"role": "user", "content": candidate}],
                                                   add_generation_prompt=True, tokenize=True)
        length = len(ids["input_ids"] if hasattr(ids, "keys") else ids)
        if (length - 1) % ALIGN < best[0]:
            best = ((length - 1) % ALIGN, candidate)
        if best[0] == 0:
            break
    return best[1]


def _choices(data: dict) -> list[str]:
    """The text of each choice of a non-streamed chat answer, in index order."""
    choices = sorted(data.get("choices") or [], key=lambda c: c.get("index", 0))
    return [(c.get("message") or {}).get("content") or "" for c in choices]


def _starts(data: dict) -> list[str]:
    """How each choice starts, in index order: its first token (from logprobs; sampled from the prompt's own
    logits, before any choice writes to a block the choices share), else its first word."""
    out = []
    for c in sorted(data.get("choices") or [], key=lambda c: c.get("index", 0)):
        content = (c.get("logprobs") or {}).get("content") or []
        if content and isinstance(content[0], dict) and content[0].get("token") is not None:
            out.append(f"token {content[0]['token']!r}")
        else:
            words = ((c.get("message") or {}).get("content") or "").split()
            out.append(f"word {words[0] if words else ''!r}")
    return out


def _logprobs(data: dict) -> list[list[TokenInfo]]:
    """Each choice's tokens with their top logprobs, in index order ([] for a choice without logprobs)."""
    return [parse_logprobs(c.get("logprobs")) for c in sorted(data.get("choices") or [], key=lambda c: c.get("index", 0))]


def sampling_flip(choice: list[TokenInfo], alone: list[TokenInfo], tolerance: float) -> float | None:
    """How far apart two sampled answers' distributions lay, up to and at their first differing token, when
    they differ there by numerical noise alone; None otherwise.

    Both answers come from one prompt and one seed, so up to their first differing token i they saw the same
    context: their distributions at 0..i should be equal up to the server's numerical batch variance (one
    request of n rows against one of 1 row). A sampled token then flips only where the seeded draw fell within
    that noise of a boundary between two tokens' cumulative probabilities. A sibling's KV written into the
    choice's blocks moves its distribution by far more.

    Args:
        choice, alone: the two answers' tokens with top logprobs (nats), as parse_logprobs gives them.
        tolerance: the server's numeric noise (nats).

    Returns:
        The largest |logprob difference| of a token both runs list once among their top logprobs at
        positions 0..i (nats), when it is at most `tolerance` and at least one token is listed by both at i;
        None when the answers do not differ token by token, either has no logprobs there, or the
        distributions moved more.
    """
    keys_a, keys_b = [t.key for t in choice], [t.key for t in alone]
    if not choice or not alone or keys_a == keys_b:
        return None
    i = next((k for k, (x, y) in enumerate(zip(keys_a, keys_b)) if x != y), min(len(keys_a), len(keys_b)))
    if i >= min(len(choice), len(alone)):
        return None  # one answer ended where the other went on: not a sampled flip
    worst, common = 0.0, 0
    for a, b in zip(choice[:i + 1], alone[:i + 1]):
        ours, theirs = listed_once(a.top), listed_once(b.top)
        shared = [abs(lp - theirs[k]) for k, lp in ours.items() if k in theirs]
        worst, common = max([worst, *shared]), len(shared)
    return worst if common and worst <= tolerance else None


def parallel_sampling(server: Server) -> CheckResult:
    """One chat request with n choices at temperature 1, alone; then n requests seeded seed + i, alone.
    Choice i must equal the i-th separate answer, except where the two first differ at a token whose
    distributions agree within the server's tolerance (sampling_flip: a seeded draw at a boundary that
    numerical noise moved). n/a when the server refuses n > 1, gives fewer choices, or seeds its choices
    otherwise (a choice's first token, or without logprobs its first word, differs from its separate run's)."""
    n, tokens = 3, 16 if server.quick else 24
    seed = fresh_seed()
    text = _story(server, WORDS[seed % len(WORDS)])
    sent = (f"1 chat request n={n} (temperature 1.0, seed S, {tokens} tokens) alone, then {n} requests n=1 seeded "
            f"S+i alone; {salt_words(server)}")
    server.say(f"n > 1: {sent}")
    sampling = dict(temperature=1.0, top_p=1.0, seed=seed, logprobs=True, top_logprobs=TOP_LOGPROBS)
    with server.client() as client:
        r = client.post(CHAT_PATH, json=server.uncached(server.chat_body(text, max_tokens=tokens, n=n, **sampling)))
        if 400 <= r.status_code < 500:
            return not_applicable(N, TITLES[N], sent, f"the server refuses n={n}: {refusal(r)}")
        r.raise_for_status()
        answer = json_body(r)
        choices, starts, tokens_of = _choices(answer), _starts(answer), _logprobs(answer)
        if len(choices) != n:
            return not_applicable(N, TITLES[N], sent, f"asked for n={n}, the server gave {len(choices)} "
                                  f"choice{'' if len(choices) == 1 else 's'}")
        separate, separate_starts, separate_tokens = [], [], []
        for i in range(n):
            one = client.post(CHAT_PATH, json=server.uncached(server.chat_body(
                text, max_tokens=tokens, **{**sampling, "seed": seed + i})))
            one.raise_for_status()
            alone = json_body(one)
            separate.append(_choices(alone)[0])
            separate_starts.append(_starts(alone)[0])
            separate_tokens.append(_logprobs(alone)[0])
    tolerance = server.options().tolerance
    differ = [i for i in range(n) if choices[i] != separate[i]]
    flips = {i: sampling_flip(tokens_of[i], separate_tokens[i], tolerance) for i in differ}
    flips = {i: d for i, d in flips.items() if d is not None}
    differ = [i for i in differ if i not in flips]
    distinct = len(set(choices))
    figures = f"{n - len(differ) - len(flips)} of {n} choices equal their seeded run; {distinct} distinct choices"
    if flips:
        figures += (f"; {len(flips)} sampled token{'' if len(flips) == 1 else 's'} flipped by numerical noise "
                    f"(distributions within {max(flips.values()):.2g} nats, tolerance {tolerance:g})")
    if not differ:
        return CheckResult(N, TITLES[N], "pass", sent, figures)
    other = next((i for i in range(n) if starts[i] != separate_starts[i]), None)
    if other is not None:
        return not_applicable(N, TITLES[N], sent, f"the server does not seed choice i with seed + i (choice {other} "
                              f"starts with {starts[other]}, its seeded run with {separate_starts[other]}), so the "
                              "choices cannot be compared", figures)
    i = differ[0]
    return CheckResult(N, TITLES[N], "fail", sent, figures,
                       f"choice {i}: {short(choices[i])}; seeded run: {short(separate[i])}")


SCHEMAS = (  # a short object and a longer one, so the constrained neighbours finish at different steps
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"passphrase": {"type": "string", "maxLength": 32}}, "required": ["passphrase"],
     "additionalProperties": False},
)
PROMPT = "The passphrase is AMBER-FALCON-37. Reply with only the passphrase."
JSON_TOKENS = 48  # room for the longer object, whatever spacing the server allows
ORDERS = (("json0", "plain0", "json1", "plain1"), ("plain0", "json0", "plain1", "json1"))


def _body(server: Server, name: str, constrained: bool, tokens: int) -> dict:
    """One request of a round: greedy, streamed with logprobs; a constrained one with room for its whole
    object (JSON_TOKENS)."""
    body = server.chat_body(PROMPT, max_tokens=JSON_TOKENS if constrained else tokens, temperature=0.0, stream=True,
                            stream_options={"include_usage": True}, logprobs=True, top_logprobs=TOP_LOGPROBS)
    if constrained:
        schema = SCHEMAS[int(name[-1])]
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": f"answer{name[-1]}",
                                                                         "schema": schema, "strict": True}}
    return server.uncached(body)


async def _round(server: Server, order: tuple[str, ...], constrained: bool, tokens: int) -> dict[str, StreamResult]:
    """One round: the four requests of `order` sent at once; the json* ones constrained when `constrained`."""
    async with server.async_client() as client:
        tasks = [stream_request(client, CHAT_PATH, _body(server, name, constrained and name.startswith("json"), tokens),
                                timeout_s=server.timeout_s) for name in order]
        return dict(zip(order, await asyncio.gather(*tasks)))


def _valid(text: str, schema: dict) -> bool:
    """`text` is a JSON object with exactly the schema's required keys."""
    try:
        data = json.loads(text)
    except ValueError:
        return False
    return isinstance(data, dict) and set(data) == set(schema["required"])


def structured_output(server: Server) -> CheckResult:
    """Rounds of 2 JSON-schema requests beside 2 plain ones (one prompt for all), against a control round of 4
    plain; each plain answer must be what it was in the control round (a near tie of the logprobs aside).
    n/a when the server refuses response_format json_schema or does not keep to it."""
    tokens = 16 if server.quick else 24
    sent = (f"a control round of 4 plain greedy chat requests, then {len(ORDERS)} rounds of 2 plain beside 2 "
            f"response_format json_schema ones, 4 at once; {tokens} tokens, {salt_words(server)}")
    server.say(f"structured output: {sent}")
    control = asyncio.run(_round(server, ORDERS[0], False, tokens))
    rounds = [asyncio.run(_round(server, order, True, tokens)) for order in ORDERS]
    failed = next((r for r in [*control.values(), *(x for rd in rounds for x in rd.values())] if r.finish_reason == "error"), None)
    if failed is not None:
        if failed.status is not None and 400 <= failed.status < 500:
            return not_applicable(STRUCTURED, TITLES[STRUCTURED], sent, f"the server refuses response_format "
                                  f"json_schema: HTTP {failed.status}: {(failed.error or '')[:160]}")
        raise httpx.HTTPError(f"a structured-output request failed: {failed.error}")
    kept = [_valid(rd[name].text, SCHEMAS[int(name[-1])]) for rd in rounds for name in rd if name.startswith("json")]
    if not all(kept):
        bad = next(rd[name] for rd in rounds for name in rd if name.startswith("json")
                   and not _valid(rd[name].text, SCHEMAS[int(name[-1])]))
        why = (f"a constrained answer did not close its object within {JSON_TOKENS} tokens: {short(bad.text)}"
               if bad.finish_reason == "length" else
               f"the server does not keep to response_format json_schema: {short(bad.text)} is not the schema's object")
        return not_applicable(STRUCTURED, TITLES[STRUCTURED], sent, why)
    return _judge_plain(server, sent, control, rounds)


def _judge_plain(server: Server, sent: str, control: dict[str, StreamResult], rounds: list) -> CheckResult:
    """The plain answers of each mixed round against the control round's."""
    changed, numeric = [], 0
    tolerance = server.options().tolerance
    for k, rd in enumerate(rounds):
        for name in ("plain0", "plain1"):
            d = first_divergence(rd[name], control[name], tolerance)
            if d is None:
                continue
            if d.kind == "numeric":
                numeric += 1
            else:
                changed.append(f"round {k + 1} {name}: {short(rd[name].text, 40)}; control: {short(control[name].text, 40)}")
    plain = 2 * len(rounds)
    figures = (f"{plain - len(changed) - numeric} of {plain} plain answers equal the control round's; {numeric} near "
               f"ties; {2 * len(rounds)} JSON answers valid")
    if changed:
        return CheckResult(STRUCTURED, TITLES[STRUCTURED], "fail", sent, figures, "; ".join(changed[:2]))
    return CheckResult(STRUCTURED, TITLES[STRUCTURED], "pass", sent, figures)
