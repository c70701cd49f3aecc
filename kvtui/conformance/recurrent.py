"""The recurrent-state check: the per-request state of a hybrid model (gated-delta or Mamba layers beside
attention), which a server pools in slots, checkpoints for its prefix cache and moves between memory tiers,
must be each request's own.

Four parts, each sent one request at a time through the server's prefix cache (under one `cache_salt` of the
run's own; llama.cpp: its one cache), every answer greedy and then compared with its solo run: the same body
sent alone past the cache (a fresh `cache_salt`; llama.cpp: `cache_prompt: false`), so the server computes it
from an empty state. The comparison is the reference detector's (`first_divergence`: a difference at a near
tie of the two runs' top logprobs, under the server's tolerance, is numeric noise and does not count). Solo
runs are sent after their part, in reverse order, so each follows another request than its cached run did.

- `multi_turn`: conversations on one shared system prompt, interleaved (turn t of each before turn t + 1 of
  any); each turn's prompt is the conversation so far with the server's own answers, so each turn extends the
  state the server cached for the previous one.
- `cancel_retry`: a long prompt streamed and closed by the client mid-prefill (at a fraction of the solo
  time to first token) or after its first token; at once the same prompt again, then a different prompt on
  the same prefix. A server that publishes a state before it is written serves the retry what the cancelled
  prefill left.
- `tier_restore`: more conversations (distinct documents) than a server has slots, first turns one after
  another so each pushes the earlier ones out of the slots (into a host tier, llama-server's `--cache-ram`,
  where there is one), then every second turn, which must restore its own conversation's state. n/a when the
  server reports cached tokens and no second turn took any: nothing was kept to restore.
- `slot_reuse`: different short prompts in sequence over the server's few slots, then each asked again; a
  slot that starts a request from the state its previous request wrote changes the answer.

A recurrent state fades as it reads on (kvtui's tiny hybrid forgets within about 40 tokens), so the text a
request computes after any point where a wrong state could enter is kept short: short user messages and
answers after a cached history, short prompts for slot reuse. An attention-only model has no recurrent state;
the check then exercises the prefix cache on the same shapes (multi-turn extension, a retry after a cancelled
prefill) and must pass.
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import time
from dataclasses import dataclass, field

import httpx

from kvtui.conformance.base import CheckResult, Server, Verdict, not_applicable
from kvtui.remote.openai import CHAT_PATH, TOP_LOGPROBS, StreamResult, stream_request
from kvtui.remote.solo_check import first_divergence

RECURRENT = "recurrent_state"
TITLE = "recurrent state (slots, checkpoints, tiers)"
PARTS = ("multi_turn", "cancel_retry", "tier_restore", "slot_reuse")

# plain words for documents and questions; the run's nonce starts every first message, so no prompt of one run
# finds a cached prefix of an earlier run (the cancelled prefills need a prefill to cut)
WORDS = ("harbor lantern morning river garden station window bridge market winter summer letter candle "
         "orchard valley meadow kettle ladder basket pocket island forest mirror violin engine ticket "
         "museum tunnel castle pepper button cabinet blanket shovel rocket compass hammer feather copper "
         "silver marble canvas pillow saddle anchor puzzle signal parcel ribbon harvest thunder").split()
VERBS = ("keeps", "finds", "carries", "paints", "opens", "follows", "counts", "repairs", "hides", "sells")
ACK = "Noted. Ask me about it."


@dataclass
class Sent:
    """One request a part sent through the prefix cache, and its solo run.

    Attributes:
        label: how the evidence names it ("c1 turn 2", "retry 1", "p3 again").
        body: the chat body (greedy, streamed, logprobs), before the cache salt.
        answer: what the server answered through its cache; solo: the same body alone past the cache (None
            until sent).
        restore: the request was meant to find its own earlier state cached (a next turn, a retry, a prompt
            asked again); the figures count how many of these took cached prompt tokens.
    """

    label: str
    body: dict
    answer: StreamResult
    solo: StreamResult | None = None
    restore: bool = False


@dataclass(frozen=True)
class Part:
    """One part's outcome: `name` (PARTS), `verdict`, `figures` (what was compared, what the cache served),
    `evidence` (a fail's differing answers, or the n/a reason)."""

    name: str
    verdict: Verdict
    figures: str
    evidence: str = ""

    def as_dict(self) -> dict:
        """The part as plain JSON-ready data."""
        return {"name": self.name, "verdict": self.verdict, "figures": self.figures, "evidence": self.evidence}


@dataclass
class Plan:
    """The sizes of one run. quick: 3 conversations of 3 turns, 2 cuts, 6 conversations for the tier, 6
    prompts for slot reuse; else 4 x 4, 4 cuts, 8 and 8."""

    quick: bool
    tokens: int = field(init=False)
    turns: tuple[int, int] = field(init=False)
    cuts: tuple[float | None, ...] = field(init=False)
    tier: int = field(init=False)
    slots: int = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = 12 if self.quick else 16
        self.turns = (3, 3) if self.quick else (4, 4)
        # fractions of the solo time to first token at which the client closes the stream; None: at the first
        # token (the prefill done, the first decode step written)
        self.cuts = (0.5, None) if self.quick else (0.25, 0.5, 0.75, None)
        self.tier = 6 if self.quick else 8
        self.slots = 6 if self.quick else 8


DOC_TOKENS = 200  # the cancelled prompt's document: long enough that its prefill can be cut
TIER_DOC_TOKENS = 360  # each tier conversation's own document: the part's first turns (6 x ~24 blocks of 16
# tokens) overflow a pool of 96 blocks (kvtui's conformance server on a hybrid), so each second turn is restored
# from the tier below it
SYSTEM_TOKENS = 30  # the multi-turn conversations' shared system prompt
OPENING_TOKENS = 60  # each conversation's own opening, longer than what it shares (a server that keeps a
# conversation only when a new prompt shares little of it, as llama-server, then keeps each)


def prose(rng: random.Random, tokenizer, tokens: int) -> str:
    """Sentences of WORDS, drawn from `rng`, until they are at least `tokens` tokens of `tokenizer`."""
    sentences: list[str] = []
    while len(tokenizer.encode(" ".join(sentences), add_special_tokens=False)) < tokens:
        a, b, c = rng.sample(WORDS, 3)
        sentences.append(f"The {a} {rng.choice(VERBS)} the {b} near the {c}.")
    return " ".join(sentences)


def question(rng: random.Random) -> str:
    """A short user message (about 10 tokens)."""
    a, b = rng.sample(WORDS, 2)
    return f"What does the {a} do with the {b}?"


def chat(server: Server, messages: list[dict], tokens: int) -> dict:
    """A greedy streamed chat body with `messages`, top logprobs and the usage chunk."""
    body = {"messages": [dict(m) for m in messages], "max_tokens": tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": TOP_LOGPROBS}
    if server.served_model:
        body["model"] = server.served_model
    return body


class Runner:
    """Sends one run's requests: through the prefix cache under the run's salt (`cached`), alone past it
    (`solos`), and cut by the client (`cut`), on one asyncio client."""

    def __init__(self, server: Server, client: httpx.AsyncClient, salt: str) -> None:
        self.server, self.client, self.salt = server, client, salt

    async def cached(self, label: str, body: dict, *, restore: bool = False) -> Sent:
        """`body` through the prefix cache.

        Raises:
            httpx.HTTPError: the server failed it (a check's exit 3).
        """
        answer = await self.send(self.server.salted(body, self.salt), label)
        return Sent(label, body, answer, restore=restore)

    async def solos(self, sent: list[Sent]) -> None:
        """Each body of `sent` alone past the cache, last first (a body sent twice is sent alone once).

        Raises:
            httpx.HTTPError: the server failed one.
        """
        done: dict[str, StreamResult] = {}
        for s in reversed(sent):
            key = repr(s.body)
            if key not in done:
                done[key] = await self.send(self.server.uncached(s.body), f"{s.label} (solo)")
            s.solo = done[key]

    async def send(self, body: dict, label: str) -> StreamResult:
        """`body` as it is (the caller salts it or not).

        Raises:
            httpx.HTTPError: the server failed it.
        """
        result = await stream_request(self.client, CHAT_PATH, body, timeout_s=self.server.timeout_s)
        if result.finish_reason == "error":
            raise httpx.HTTPError(f"recurrent state, {label}: the server failed the request: {result.error}")
        return result

    async def cut(self, body: dict, after_s: float | None) -> tuple[float, bool]:
        """Stream `body` through the cache and close the stream at its first token, or after `after_s` seconds
        (None: no limit but the request's), whichever comes first. Returns (seconds the stream was open,
        whether a token came). A failure to connect or a refusal is no error here: the request is gone."""
        got = [False]

        async def read() -> None:
            async with self.client.stream("POST", CHAT_PATH, json=self.server.salted(body, self.salt),
                                          headers={"Connection": "close"}) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data:") and _has_token(line):
                        got[0] = True
                        return

        start = time.perf_counter()
        try:
            await asyncio.wait_for(read(), after_s if after_s is not None else self.server.timeout_s)
        except (asyncio.TimeoutError, httpx.HTTPError):
            pass
        return time.perf_counter() - start, got[0]


def _has_token(line: str) -> bool:
    """A stream event that carries generated text or a token's logprobs (not the role chunk vLLM sends before
    the prefill, nor the usage chunk)."""
    try:
        data = json.loads(line[5:].strip())
    except ValueError:
        return False
    for choice in (data.get("choices") or []) if isinstance(data, dict) else []:
        delta = choice.get("delta") or {}
        if delta.get("content") or choice.get("text") or (choice.get("logprobs") or {}).get("content"):
            return True
    return False


# -- the parts --------------------------------------------------------------------------------------------
async def multi_turn(run: Runner, plan: Plan, rng: random.Random, nonce: str) -> tuple[list[Sent], str]:
    """Conversations on one shared system prompt, each opening with a document of its own, turn t of each
    before turn t + 1 of any; each turn's prompt is the conversation so far with the server's answers.
    Returns (sent, a note for the figures)."""
    tokenizer = run.server.tokenizer
    conversations, turns = plan.turns
    system = f"Session {nonce}. " + prose(rng, tokenizer, SYSTEM_TOKENS)
    history = [[{"role": "system", "content": system},
                {"role": "user", "content": prose(rng, tokenizer, OPENING_TOKENS) + " " + question(rng)}]
               for _ in range(conversations)]
    sent = []
    for t in range(turns):
        for k in range(conversations):
            if t:
                history[k].append({"role": "user", "content": question(rng)})
            s = await run.cached(f"c{k + 1} turn {t + 1}", chat(run.server, history[k], plan.tokens), restore=t > 0)
            history[k].append({"role": "assistant", "content": s.answer.text})
            sent.append(s)
    await run.solos(sent)
    return sent, (f"{conversations} conversations x {turns} turns on a {SYSTEM_TOKENS}-token system prompt, each "
                  f"opening with {OPENING_TOKENS} tokens of its own")


async def cancel_retry(run: Runner, plan: Plan, rng: random.Random, nonce: str) -> tuple[list[Sent], str]:
    """Per cut: a long prompt (a document, an acknowledgement, a question) closed by the client mid-prefill or
    at its first token; then at once the same prompt (the retry), its next turn (the retry's answer and
    another question), and another question on the same document."""
    tokenizer = run.server.tokenizer

    def prompts(tag: str) -> tuple[list[dict], str, str]:
        doc = f"Document {nonce}-{tag}. " + prose(rng, tokenizer, DOC_TOKENS)
        return [{"role": "user", "content": doc}, {"role": "assistant", "content": ACK}], question(rng), question(rng)

    def user(text: str) -> list[dict]:
        return [{"role": "user", "content": text}]

    prefix, a, _ = prompts("calibration")  # the solo time to first token of a prompt this long
    alone = await run.send(run.server.uncached(chat(run.server, prefix + user(a), plan.tokens)), "calibration")
    ttft = (alone.first_s - alone.sent_s) if alone.first_s is not None else 1.0
    sent, cuts = [], []
    for v, fraction in enumerate(plan.cuts, start=1):
        prefix, a, b = prompts(str(v))
        same = chat(run.server, prefix + user(a), plan.tokens)
        open_s, token = await run.cut(same, None if fraction is None else fraction * ttft)
        retry = await run.cached(f"retry {v}", same, restore=True)
        turn = prefix + user(a) + [{"role": "assistant", "content": retry.answer.text}] + user(question(rng))
        nxt = await run.cached(f"next {v}", chat(run.server, turn, plan.tokens), restore=True)
        other = await run.cached(f"other {v}", chat(run.server, prefix + user(b), plan.tokens), restore=True)
        sent += [retry, nxt, other]
        cached = ", ".join(f"{s.label.split()[0]} {s.answer.cached_tokens}" for s in (retry, nxt, other)
                           if s.answer.cached_tokens is not None)
        cuts.append(f"cut {v} closed after {open_s * 1000:.0f} ms {'after' if token else 'before'} its first token"
                    + (f" (cached tokens: {cached})" if cached else ""))
    await run.solos(sent)
    return sent, (f"{len(plan.cuts)} prompts of ~{DOC_TOKENS + 40} tokens (solo time to first token "
                  f"{ttft * 1000:.0f} ms), each cut by the client, then retried at once, its next turn, another "
                  f"question on its document: {'; '.join(cuts)}")


async def tier_restore(run: Runner, plan: Plan, rng: random.Random, nonce: str) -> tuple[list[Sent], str]:
    """More conversations than slots, each on its own document: every first turn, one after another, then
    every second turn in the same order."""
    tokenizer = run.server.tokenizer
    history = [[{"role": "user", "content": f"Document {nonce}-t{k}. " + prose(rng, tokenizer, TIER_DOC_TOKENS)
                 + " " + question(rng)}] for k in range(plan.tier)]
    sent = []
    for t in range(2):
        for k in range(plan.tier):
            if t:
                history[k].append({"role": "user", "content": question(rng)})
            s = await run.cached(f"t{k + 1} turn {t + 1}", chat(run.server, history[k], plan.tokens), restore=t > 0)
            history[k].append({"role": "assistant", "content": s.answer.text})
            sent.append(s)
    await run.solos(sent)
    return sent, f"{plan.tier} conversations on documents of their own, every first turn, then every second turn"


async def slot_reuse(run: Runner, plan: Plan, rng: random.Random, nonce: str) -> tuple[list[Sent], str]:
    """Different short prompts one after another, then each asked again in the same order."""
    # the run's nonce last: the prompts share only the chat template's opening, so a server that keeps a slot's
    # prompt when the next one shares little of it (llama-server's host-RAM cache) keeps each
    bodies = [chat(run.server, [{"role": "user", "content": f"{question(rng)} {prose(rng, run.server.tokenizer, 12)} "
                                f"(note {nonce}-s{k})"}], plan.tokens) for k in range(plan.slots)]
    sent = [await run.cached(f"p{k + 1}", body) for k, body in enumerate(bodies)]
    sent += [await run.cached(f"p{k + 1} again", body, restore=True) for k, body in enumerate(bodies)]
    await run.solos(sent)
    return sent, f"{plan.slots} different short prompts one after another, then each again"


# -- judging ----------------------------------------------------------------------------------------------
def cache_note(sent: list[Sent]) -> str:
    """What the server said its cache served: of the requests meant to find their own state (restore), how
    many took cached prompt tokens, and how many in all."""
    if all(s.answer.cached_tokens is None for s in sent):
        return "cached prompt tokens not reported"
    meant = [s for s in sent if s.restore]
    hit = [s for s in meant if s.answer.cached_tokens]
    total = sum(s.answer.cached_tokens or 0 for s in sent)
    prompt = sum(s.answer.prompt_tokens or 0 for s in sent)
    of = f" of {prompt}" if prompt else ""
    return f"{len(hit)} of {len(meant)} meant to resume took cached prompt tokens; {total}{of} prompt tokens cached"


def judge(name: str, sent: list[Sent], tolerance: float, *, note: str = "", needs_restore: bool = False) -> Part:
    """One part's verdict: fail when an answer differs from its solo run beyond a near tie (a token whose
    runs' top logprobs lie further apart than `tolerance` nats, or a token one run does not list); n/a when no
    solo run could be compared (each took cached prompt tokens: the server ignored the fresh salt), or when
    `needs_restore` and the server reports cached tokens but no request meant to resume took any; else pass.

    Args:
        sent: the part's requests, each with its solo run.
        tolerance: the server's numeric noise (nats).
        note: what the part sent, put first in the figures.
    """
    wrong, near, unknown = [], 0, 0
    # a "solo" run that took prompt tokens from the cache is no solo run (a server that ignores the fresh salt)
    served = [s for s in sent if s.solo is not None and s.solo.cached_tokens]
    judged = [s for s in sent if s.solo is not None and not s.solo.cached_tokens]
    for s in judged:
        d = first_divergence(s.answer, s.solo, tolerance)
        if d is None:
            continue
        if d.kind == "numeric":
            near += 1
        elif d.kind == "corruption":
            cached = "" if s.answer.cached_tokens is None else (
                f"; it took {s.answer.cached_tokens} of {s.answer.prompt_tokens} prompt tokens from the cache")
            gap = "" if d.gap is None else f", {d.gap:.2g} nats apart"
            wrong.append(f"{s.label}: differs from its solo run at token {d.index} ({d.batched_piece!r} vs "
                         f"{d.solo_piece!r}{gap}){cached}")
        else:
            unknown += 1
    equal = len(judged) - len(wrong) - near - unknown
    figures = (f"{note}: " if note else "") + f"{equal} of {len(judged)} equal their solo run"
    if served:
        figures += f", {len(served)} not compared (their solo run was served from the cache)"
    if near:
        figures += f", {near} near ties"
    if unknown:
        figures += f", {unknown} differ without logprobs to judge"
    figures += f"; {cache_note(sent)}"
    if wrong:
        more = f"; {len(wrong) - 2} more" if len(wrong) > 2 else ""
        return Part(name, "fail", figures, "; ".join(wrong[:2]) + more)
    if not judged:
        return Part(name, "n/a", figures, "no solo run could be compared: the server took prompt tokens from its "
                    "cache for each, past a fresh cache_salt")
    meant = [s for s in sent if s.restore]
    if needs_restore and any(s.answer.cached_tokens is not None for s in meant) and not any(
            s.answer.cached_tokens for s in meant):
        return Part(name, "n/a", figures, f"no request meant to resume took cached prompt tokens (0 of "
                    f"{len(meant)}): the server kept none of the {len(meant)} conversations to restore")
    return Part(name, "pass", figures)


def combine(parts: list[Part], sent_line: str) -> CheckResult:
    """The class's row: fail when a part fails, pass when one passes and none fails, else n/a. The figures
    name every part with its verdict; the evidence every failing part's (or, all n/a, their reasons)."""
    verdict: Verdict = ("fail" if any(p.verdict == "fail" for p in parts) else
                        "pass" if any(p.verdict == "pass" for p in parts) else "n/a")
    figures = "; ".join(f"{p.name} {p.verdict}: {p.figures}" for p in parts)
    shown = [p for p in parts if p.verdict == verdict] if verdict != "pass" else []
    evidence = "; ".join(f"{p.name}: {p.evidence}" for p in shown)
    return CheckResult(RECURRENT, TITLE, verdict, sent_line, figures, evidence, parts=[p.as_dict() for p in parts])


RUNS = {"multi_turn": multi_turn, "cancel_retry": cancel_retry, "tier_restore": tier_restore,
        "slot_reuse": slot_reuse}


def recurrent_state(server: Server) -> CheckResult:
    """The four parts (module docstring), one request at a time, every answer against its solo run. n/a when
    the server refuses cache_salt (no request can then be sent past its prefix cache: a solo run could read
    the state the cached run left).

    Raises:
        httpx.HTTPError, TargetError: the server failed a request outright.
    """
    plan = Plan(server.quick)
    conversations, turns = plan.turns
    sent_line = (f"one at a time, greedy, {plan.tokens} tokens, each then alone past the cache: {conversations} "
                 f"conversations x {turns} turns on a shared system prompt; {len(plan.cuts)} long prompts closed by "
                 f"the client mid-prefill or at the first token, each retried at once, then its next turn and another "
                 f"prompt on its prefix; {plan.tier} conversations x 2 turns on documents of their own; {plan.slots} short "
                 "prompts, then each again")
    server.say(f"recurrent state: {sent_line}")
    refused = server.salt_refusal()
    if refused:
        return not_applicable(RECURRENT, TITLE, sent_line, f"{refused}, so no request can be sent past its prefix "
                              "cache: a solo run could read the state the cached run left")
    nonce = secrets.token_hex(4)
    rng = random.Random(nonce)

    async def go() -> list[Part]:
        async with server.async_client() as client:
            run = Runner(server, client, secrets.token_hex(16))
            parts = []
            for name in PARTS:
                sent, note = await RUNS[name](run, plan, rng, nonce)
                parts.append(judge(name, sent, server.tolerance, note=note, needs_restore=name == "tier_restore"))
                server.say(f"recurrent state, {name}: {parts[-1].verdict}")
            return parts

    return combine(asyncio.run(go()), sent_line)
