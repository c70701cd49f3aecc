"""The LoRA-adapter check: two adapters and the base model on one shared prompt, each answer against its
solo run on a fresh cache, with the server's cached-token counts as evidence.

A server that serves several LoRA adapters from one base model shares one prefix cache between them. The
KV of a prompt computed under adapter A is not the KV of that prompt under adapter B (the adapter changes
the k/v projections of every layer), so the cache must key blocks by the adapter (vLLM: the adapter is part
of the block hash; kvtui serve: engine/lora.py prefix_salt), and by the adapter's version across a reload
in place. llama.cpp #26207 reports llama-server reusing a slot's cached prompt when a request picks
another per-request `lora`.

How a server names its adapters:
- vLLM and kvtui serve (`--enable-lora --lora-modules name=path`): `/v1/models` lists each adapter with its
  `parent` (the base model) and `root` (its folder); a request's `model` picks it.
- llama-server (`--lora A --lora B --lora-init-without-apply`): `GET /lora-adapters` lists them by `id`; a
  request's body `lora: [{"id": i, "scale": s}]` sets each one's scale (every adapter is listed, scale 0
  for the ones not applied); the base model is a request without `lora` (the server's own scales, all 0
  under --lora-init-without-apply), as a client that wants no adapter sends it.

What it sends (greedy, streamed, top logprobs; a fresh random number at the start of each prompt, so no run
meets another run's cache):
1. one at a time through the cache on P1: A, base, B, base, A (each after another variant on the same
   prompt: a cache keyed without the adapter hands it the previous variant's KV);
2. at once on P2: A, B and base together on a cold cache (rows of different adapters in one batch), then
   (full run) the same three together again, now through the cache;
3. where the server reloads an adapter in place (vLLM's and kvtui's `POST /v1/load_lora_adapter` with
   `load_inplace: true`, allowed by `VLLM_ALLOW_RUNTIME_LORA_UPDATING` / `--allow-runtime-lora-updating`):
   A reloaded with B's folder, then A on P1 again, which must now answer as B's solo run (its old
   version's cached blocks are not its KV); A is loaded back from its own folder after;
4. solo: each of base, A, B alone past the prefix cache (a fresh cache_salt; llama.cpp cache_prompt false),
   on P1 and P2 (last: llama.cpp keeps even an uncached prompt in its slot).

Fail: an answer of steps 1-3 that differs from its solo run by more than a numeric flip (a top-2 logprob
gap within the server's tolerance), named with the variant before it, whether it equals another variant's
solo answer, and the prompt tokens the server said it took from its cache; or a variant's first request on
P1 for which the server says it took more than half the prompt from its cache, when only other variants
had sent P1 (that KV can only be theirs), whatever the answer; or the reloaded A's answer (step 3) with
B's solo tokens but a logprob that moved by more than the tolerance, where the control below holds. n/a: the
server serves fewer than two adapters, refuses the adapter requests, or its adapters do not change the answer
to the prompt.

Why the reload is also judged by logprobs: a cache keyed by the adapter's name without its version hands
the reloaded A the blocks of P1 its old version computed in step 1; only the prompt's tail and the decode
run under the new weights. The greedy tokens often stay B's: measured on SmolLM2 with kvtui's seeded
adapters (`--fault lora_reload_stale`, 10 fresh prompts), 2 of 10 such answers differed from B's solo run
in a token, all 10 had the same tokens with logprobs moved by 0.8 to 1.4 nats, where a clean kvtui serve's
reloaded A (computed afresh) moved 0 nats. The logprobs count only where the server's answers that came back
to their own cached blocks, P1's base and A again (#4 and #5), equal their solo runs token for token with
logprobs within the tolerance (the control: a prompt through this server's cache is computed as it is past
it; kvtui serve: under 3e-5 nats). Where the server did not say it read its cache for them, or they differ,
the reload is judged by its tokens only. The cached-token count alone cannot judge it: a server that keys
blocks by the adapter's weights may rightly serve the reloaded A the blocks B computed for P1.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import httpx

from kvtui.conformance.base import CheckResult, Server, fresh_seed, not_applicable, refusal, salt_words, send, short
from kvtui.remote.openai import StreamResult
from kvtui.remote.solo_check import Drift, first_divergence, logprob_drift

ADAPTERS = "adapters"
TITLE = "LoRA adapters (prefix cache, batching)"
TOP_LOGPROBS = 5
WORDS = ("river", "lantern", "copper", "meadow", "harbor", "violet", "granite", "falcon", "orchard", "velvet",
         "summit", "ember", "willow", "compass", "marble", "thistle", "cobalt", "saddle", "juniper", "quartz")
PROMPT_TOKENS = 200  # past vLLM's 128-token blocks, several of kvtui's 16-token ones (by the model's tokenizer)
RELOADED = "reloaded in place with"  # in the reloaded A's label


@dataclass(frozen=True)
class Variant:
    """The base model or one adapter, as a request selects it.

    Attributes:
        name: "base", or the adapter's name (llama.cpp: `lora<id>`).
        fields: the body fields that select it (`model`, or llama.cpp's `lora`).
        path: the adapter's folder where the server lists it (vLLM's and kvtui's `root`), else None.
    """

    name: str
    fields: dict
    path: str | None = None


def find_variants(server: Server) -> tuple[list[Variant], str]:
    """The base model and the first two adapters the server lists ([] and why when it lists fewer), and how
    they are selected (for the `sent` line)."""
    with server.client() as client:
        try:
            listed = client.get("/v1/models").json().get("data", [])
        except (httpx.HTTPError, ValueError, AttributeError):
            listed = []
        cards = [m for m in listed if isinstance(m, dict) and m.get("parent") and m.get("id") != server.served_model]
        if len(cards) >= 2:
            base = Variant("base", {"model": server.served_model} if server.served_model else {})
            return [base] + [Variant(m["id"], {"model": m["id"]}, m.get("root")) for m in cards[:2]], "by `model`"
        if server.server_kind == "llama.cpp":
            try:
                loaded = client.get("/lora-adapters").json()
            except (httpx.HTTPError, ValueError):
                loaded = []
            ids = [a["id"] for a in loaded if isinstance(a, dict) and isinstance(a.get("id"), int)]
            if len(ids) >= 2:
                def scales(on: int | None) -> dict:
                    return {"lora": [{"id": i, "scale": 1.0 if i == on else 0.0} for i in ids]}

                # the base model as a client asks for it: no `lora` field (the server's own scales, all 0)
                return [Variant("base", {}), Variant(f"lora{ids[0]}", scales(ids[0])),
                        Variant(f"lora{ids[1]}", scales(ids[1]))], "by the body's `lora` scales"
    return [], ("the server serves fewer than two LoRA adapters (vLLM and kvtui serve: --enable-lora --lora-modules "
                "a=PATH b=PATH; llama-server: --lora A --lora B --lora-init-without-apply)")


def prompt(nonce: int, tokenizer) -> str:
    """A prompt of seeded words, about PROMPT_TOKENS tokens by `tokenizer` (a Hugging Face tokenizer), after a
    number of its own (no two runs share a prefix)."""
    rng = random.Random(nonce)
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words))) < PROMPT_TOKENS:
        words += [rng.choice(WORDS) for _ in range(10)]
    return f"Record {nonce}. Notes: {' '.join(words)}. Tell me a story about these notes."


def body(server: Server, text: str, variant: Variant, tokens: int) -> dict:
    """A greedy streamed chat body for `text` under `variant`, with top logprobs and the usage chunk."""
    out = {"messages": [{"role": "user", "content": text}], "max_tokens": tokens, "temperature": 0.0,
           "stream": True, "stream_options": {"include_usage": True}, "logprobs": True,
           "top_logprobs": TOP_LOGPROBS}
    if server.served_model:
        out["model"] = server.served_model
    return {**out, **variant.fields}


def cached(result: StreamResult) -> str:
    """'cached 190 of 203 prompt tokens' (the server's own counts; llama.cpp: timings), or 'cache not said'."""
    if result.cached_tokens is None:
        return "cache not said"
    return f"cached {result.cached_tokens} of {result.prompt_tokens if result.prompt_tokens is not None else '?'}"


def reload(server: Server, name: str, path: str) -> str | None:
    """Reload adapter `name` in place from `path`: None when done, else the server's answer in one line."""
    with server.client() as client:
        r = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path, "load_inplace": True})
    return None if r.status_code == 200 else refusal(r)


def through_cache(server: Server, variants: list[Variant], p1: str, p2: str, tokens: int,
                  rounds: int) -> tuple[list[tuple[str, StreamResult, str, str]], str]:
    """Steps 1-3 (the module's docstring): each answer as (label, result, its prompt, the variant whose solo
    run it must equal), the reloaded A's last (its label holds RELOADED), and what became of the reload
    in place, in words."""
    base, a, b = variants
    checked: list[tuple[str, StreamResult, str, str]] = []  # (label, result, prompt, whose solo it must equal)
    order = [a, base, b, base, a]  # each variant's first request on P1 comes after another variant's
    seq = asyncio.run(send(server, [body(server, p1, v, tokens) for v in order], together=False))
    for k, (v, r) in enumerate(zip(order, seq)):
        after = f" after {order[k - 1].name}" if k else " first"
        checked.append((f"P1 #{k + 1} {v.name}{after}", r, p1, v.name))
    for n in range(rounds):
        together = asyncio.run(send(server, [body(server, p2, v, tokens) for v in (a, b, base)], together=True))
        for v, r in zip((a, b, base), together):
            checked.append((f"P2 at once{' again' if n else ''} {v.name}", r, p2, v.name))
    reload_note = "no reload (the server lists no adapter folders)"
    if a.path and b.path:
        refused = reload(server, a.name, b.path)
        if refused is None:
            try:
                (r,) = asyncio.run(send(server, [body(server, p1, a, tokens)], together=False))
                checked.append((f"P1 {a.name} {RELOADED} {b.name}'s weights", r, p1, b.name))
            finally:
                restored = reload(server, a.name, a.path)
            reload_note = "A reloaded in place" + ("" if restored is None else f" (restoring it failed: {restored})")
        else:
            reload_note = f"no reload in place ({refused})"
    return checked, reload_note


def borrowed(sequence: list[tuple[str, StreamResult, str, str]], text: str) -> list[str]:
    """The requests of the one-at-a-time sequence on `text` that took more than half their prompt from the
    cache on their variant's first sending of it, when only other variants had sent it: named with their
    counts."""
    seen: list[str] = []
    out = []
    for label, r, _, whose in sequence:
        if whose not in seen and seen and r.cached_tokens and r.prompt_tokens and 2 * r.cached_tokens > r.prompt_tokens:
            out.append(f"{label}: the server took {r.cached_tokens} of {r.prompt_tokens} prompt tokens from its cache "
                       f"on {whose}'s first sending of the prompt, which only {' and '.join(sorted(set(seen)))} had "
                       "sent: their KV")
        seen.append(whose)
    return out


def cache_control(sequence: list[tuple[str, StreamResult, str, str]],
                  solo: dict[tuple[str, str], StreamResult]) -> tuple[Drift | None, str]:
    """The control for judging the reload by logprobs: how far P1's answers that came back to their own
    variant's cached blocks (#4 base and #5 A, `sequence[3:5]`) moved against their solo runs (`solo`, by
    (prompt, variant)): the larger Drift (nats), or None and why when that cannot be told (one took nothing
    from the cache or does not say, differs from its solo run in a token, or has no logprobs)."""
    moves = []
    for label, r, p, whose in sequence[3:5]:
        if not r.cached_tokens:
            return None, f"{label.split(' ', 2)[2]} took nothing from the cache or did not say"
        drift = logprob_drift(r, solo[(p, whose)])
        if drift is None:
            return None, f"{label.split(' ', 2)[2]} differs from its solo run or has no logprobs"
        moves.append(drift)
    return max(moves, key=lambda d: d.nats), ""


def stale(label: str, r: StreamResult, solo: StreamResult, control: Drift | None, tolerance: float) -> str | None:
    """The reloaded A's answer `r`, token-equal to B's solo run `solo`, described when its logprobs moved by
    more than `tolerance` (nats) on a server whose `control` (cache_control) moved within it; else None."""
    drift = logprob_drift(r, solo)
    if control is None or control.nats > tolerance or drift is None or drift.nats <= tolerance:
        return None
    return (f"{label}: same tokens as its solo run, but a logprob moved {drift.nats:.3g} nats > tolerance "
            f"{tolerance:g} (token {drift.index}, {drift.token!r}; the control moved {control.nats:.2g}): computed "
            f"on KV that is not its new weights'; {cached(r)}")


def reload_judged(checked: list[tuple[str, StreamResult, str, str]], solo: dict[tuple[str, str], StreamResult],
                  control: Drift | None, why: str, tolerance: float) -> str:
    """The figures' note on how the reloaded A's answer (`checked[-1]`) was judged, with how far its logprobs
    moved against B's solo run where its tokens are B's ("" without a reload)."""
    if not checked or RELOADED not in checked[-1][0]:
        return ""
    if control is None:
        return f", judged by tokens only (no control: {why})"
    if control.nats > tolerance:
        return (f", judged by tokens only (base and A again through the cache moved {control.nats:.2g} nats "
                f"> tolerance {tolerance:g} against their solo runs)")
    _, r, p, whose = checked[-1]
    drift = logprob_drift(r, solo[(p, whose)])
    moved = "" if drift is None else f"its logprobs moved {drift.nats:.2g} nats; "
    return (f", judged by tokens and logprobs ({moved}the control, base and A again through the cache, moved "
            f"{control.nats:.2g} nats)")


def adapters(server: Server) -> CheckResult:
    """The check (the module's docstring): pass, fail with the differing answers, or n/a with the reason."""
    tokens = 12 if server.quick else 24
    variants, how = find_variants(server)
    rounds = 1 if server.quick else 2
    sent = (f"base and 2 adapters ({how}) on ~{PROMPT_TOKENS}-token prompts: 5 one at a time through the cache (A, "
            f"base, B, base, A), {rounds} round(s) of 3 at once, a reload of A in place where offered, then each "
            f"solo ({salt_words(server)}); {tokens} greedy tokens")
    server.say(f"adapters: {sent}")
    if not variants:
        return not_applicable(ADAPTERS, TITLE, sent, how)
    base = variants[0]
    p1, p2 = prompt(fresh_seed(), server.tokenizer), prompt(fresh_seed(), server.tokenizer)

    checked, reload_note = through_cache(server, variants, p1, p2, tokens, rounds)
    solo: dict[tuple[str, str], StreamResult] = {}
    runs = [(p, v) for p in (p1, p2) for v in variants]
    for (p, v), r in zip(runs, asyncio.run(send(server, [server.uncached(body(server, p, v, tokens))
                                                         for p, v in runs], together=False))):
        if r.finish_reason not in ("stop", "length"):
            return not_applicable(ADAPTERS, TITLE, sent, f"the solo run under {v.name} failed: {r.error}")
        solo[(p, v.name)] = r
    if len({solo[(p1, v.name)].text for v in variants}) == 1:
        return not_applicable(ADAPTERS, TITLE, sent, "the adapters do not change the answer to the prompt (base, A "
                              f"and B all said {short(solo[(p1, base.name)].text)} alone), so no mix-up would show")

    control, why = cache_control(checked, solo)
    bad, flips = [], 0
    for label, r, p, whose in checked:
        if r.finish_reason not in ("stop", "length"):
            bad.append(f"{label}: no answer ({r.error})")
            continue
        d = first_divergence(r, solo[(p, whose)], server.tolerance)
        if d is None:
            moved = stale(label, r, solo[(p, whose)], control, server.tolerance) if RELOADED in label else None
            bad += [moved] if moved else []
            continue
        if d.kind == "numeric":
            flips += 1
            continue
        others = [v.name for v in variants if v.name != whose and solo[(p, v.name)].text == r.text]
        like = f", equal to {others[0]}'s solo answer" if others else ""
        bad.append(f"{label}: {short(r.text, 80)} against its solo {short(solo[(p, whose)].text, 80)} (from token "
                   f"{d.index}: {d.batched_piece!r} where the solo run has {d.solo_piece!r}, {d.kind}){like}; "
                   f"{cached(r)}")
    hits = [f"{label.split(' ', 1)[1]}: {cached(r)}" for label, r, _, _ in checked[:5]]
    figures = (f"{len(checked) - len(bad)} of {len(checked)} answers equal their solo run"
               f"{f' ({flips} numeric flips)' if flips else ''}; through the cache on P1: {'; '.join(hits)}; "
               f"{reload_note}{reload_judged(checked, solo, control, why, server.tolerance)}")
    bad = borrowed(checked[:5], p1) + bad
    if bad:
        return CheckResult(ADAPTERS, TITLE, "fail", sent, figures, "; ".join(bad[:3]) + (
            f"; {len(bad) - 3} more" if len(bad) > 3 else ""))
    return CheckResult(ADAPTERS, TITLE, "pass", sent, figures)
