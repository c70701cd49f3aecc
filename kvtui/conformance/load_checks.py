"""The checks that replay a small scenario with kvtui's target session (kvtui/remote/session.py): solo
parity under load, request ids, prompt embeddings and the prompt cache across conversations.

Each builds its scenario here (passphrase prompts, greedy), runs it with the session's own detectors
(`reference`: every greedy answer sent again alone past the prefix cache and compared; `canary`: an
answer holding another request's passphrase) and judges by the findings that count (a numeric
near-tie or an unlabelled difference does not).
"""

from __future__ import annotations

import asyncio
import secrets

from kvtui.conformance.base import CheckResult, Server, not_applicable, send
from kvtui.events import Contamination
from kvtui.remote.openai import TOP_LOGPROBS
from kvtui.remote.session import TargetSession
from kvtui.remote.solo_check import Drift, logprob_drift

SOLO, IDS, EMBEDS, CACHE = "solo_parity", "request_ids", "prompt_embeds", "prompt_cache"
TITLES = {SOLO: "solo parity under load", IDS: "request ids", EMBEDS: "prompt embeddings",
          CACHE: "prompt cache across conversations"}

# the prompt-cache check's conversations: the passphrase first, then notes long enough to fill several KV
# blocks after it, so a cache that keys a block by its tokens alone (not by what came before) would hand one
# conversation's notes, computed after another passphrase, to the next
NOTES = ("The passphrase is {passphrase}. Keep it in mind while you read the notes below.\\n\\nNotes from the "
         "front desk of the Harbor View Hotel. Breakfast is served from seven to ten in the garden room, and late "
         "check-out until one o'clock can be arranged at the desk. Guests who arrive by car park in the yard behind "
         "the hotel; the shuttle to the station leaves every half hour from the main door. Spare towels and "
         "blankets are in the cupboard on each floor. The bar closes at midnight.\\n\\nReply with only the "
         "passphrase.")


def scenario(name: str, body: str, model: str):
    """A kvtui scenario from YAML `body` (everything but name and model)."""
    from kvtui.scenario import parse_scenario

    return parse_scenario(f"name: conformance-{name}\nmodel: {model}\n{body}")


def run_session(server: Server, spec, detectors: tuple[str, ...], **options) -> TargetSession:
    """Run `spec` against the server with `detectors`; returns the finished session.

    Raises:
        TargetError: the server cannot be reached.
    """
    session = TargetSession(spec, server.tokenizer, server.options(**options), detectors=detectors,
                            model=server.model)
    session.run()
    return session


def counted(session: TargetSession) -> list[Contamination]:
    """The findings that count (numeric near-ties and unlabelled differences do not)."""
    return [e for e in session.contamination if e.counts]


def describe(e: Contamination) -> str:
    """One finding in a few words: victim <- source, detector and kind, and what the detector saw."""
    seen = ""
    evidence = e.evidence
    for name in ("leaked", "batched_piece", "outcome"):
        value = getattr(evidence, name, None)
        if value:
            seen = f" ({name.replace('_', ' ')}: {str(value)[:60]!r})"
            break
    return f"{e.victim} <- {e.source or '?'}: {e.detector} {e.kind}{seen}"


def evidence_line(found: list[Contamination], limit: int = 3) -> str:
    """The first findings, described, and how many more."""
    more = f"; {len(found) - limit} more" if len(found) > limit else ""
    return "; ".join(describe(e) for e in found[:limit]) + more


def solo_note(refused: str | None) -> str:
    """What the figures add when no solo run could be sent (the server refuses cache_salt): the canary alone
    judged."""
    return " (none sent: the server refuses cache_salt; judged by the canary alone)" if refused else ""


def completed(session: TargetSession) -> int:
    """Requests that got a whole answer."""
    return sum(r.finish_reason in ("stop", "length") for r in session.results.values())


def solo_parity(server: Server) -> CheckResult:
    """Greedy passphrase requests sent at once, each then sent again alone; every answer must equal its solo
    run. Every request (load and solo) goes past the prefix cache, so this check sees batching only."""
    n, tokens = (6, 16) if server.quick else (8, 24)
    spec = scenario(SOLO, f"arrivals: {{process: rounds, rounds: [{{size: {n}, count: 1}}]}}\n"
                          f"prompts: {{kind: passphrase}}\noutput_tokens: {tokens}\nsampling: greedy\n", server.model)
    sent = f"{n} greedy chat requests at once ({tokens} tokens each), then each alone; fresh cache_salt on every one"
    server.say(f"solo parity: {sent}")
    refused = server.salt_refusal()
    if refused:
        return not_applicable(SOLO, TITLES[SOLO], sent, f"{refused}, so no request can be sent past its prefix "
                              "cache: a solo run could reuse what the batched run cached")
    session = run_session(server, spec, ("reference", "canary"), uncached_load=True)
    found = counted(session)
    numeric = len(session.contamination) - len(found)
    figures = (f"{completed(session)} of {n} answered; {session.reference_checked} compared with their solo run, "
               f"{session.reference_cached} solo runs served from cache; {numeric} near-tie differences")
    if found:
        return CheckResult(SOLO, TITLES[SOLO], "fail", sent, figures, evidence_line(found))
    if not session.reference_checked:
        return not_applicable(SOLO, TITLES[SOLO], sent, "no solo run could be compared: the server took prompt "
                              "tokens from its prefix cache for each, or every request failed", figures)
    return CheckResult(SOLO, TITLES[SOLO], "pass", sent, figures)


IDS_BODY = """arrivals: {process: rounds, rounds: [{size: 2, count: 1}, {size: 4, count: 2}]}
prompts: {kind: passphrase}
output_tokens: 20
sampling: greedy
request_ids:
  send_as: [header]
  groups: [{ids: unique, size: 4}, {ids: duplicate, size: 2}, {ids: unique, size: 2}, {ids: duplicate, size: 2}]
  probes: 1
  health: true
  wait_s: WAIT
"""


def request_ids(server: Server) -> CheckResult:
    """Clients choose their x-request-id; two pairs share one while in flight among bystanders. Fail: a
    request hung or was lost, the server stopped serving, or a pair's answers crossed (the canary)."""
    wait = 15 if server.quick else 30
    spec = scenario(IDS, IDS_BODY.replace("WAIT", str(wait)), server.model)
    sent = ("10 greedy chat requests in rounds of 2, 4, 4, each with an x-request-id of its client's choosing; "
            "2 pairs share one while in flight; then 1 request with a fresh id and GET /health")
    server.say(f"request ids: {sent}")
    session = run_session(server, spec, ("canary",))
    groups = session.id_audit.groups
    group_of = {rid: g for g, members in groups.items() for rid in members}
    found = [e for e in counted(session) if e.detector == "request_id" or (
        e.source is not None and group_of.get(e.victim) is not None and group_of.get(e.victim) == group_of.get(e.source)
        and len(groups[group_of[e.victim]]) > 1)]
    figures = session.id_audit.line(session.results)
    if found:
        return CheckResult(IDS, TITLES[IDS], "fail", sent, figures, evidence_line(found))
    return CheckResult(IDS, TITLES[IDS], "pass", sent, figures)


def prompt_embeds(server: Server) -> CheckResult:
    """Passphrase prompts sent as embedding rows (vLLM's `prompt_embeds`), one at a time, through the prefix
    cache; every answer must be its own passphrase's and equal its solo run. n/a when the server refuses
    prompt embeddings, or when kvtui has no input embedding table for the model to make the rows from (the
    hybrid tiny-qwen35moe)."""
    n = 4 if server.quick else 6
    spec = scenario(EMBEDS, f"arrivals: {{process: rounds, rounds: [{{size: 1, count: {n}}}]}}\n"
                            "prompts: {kind: passphrase, embeds: all}\noutput_tokens: 16\nsampling: greedy\n",
                    server.model)
    sent = (f"{n} completions whose whole prompt is embedding rows (prompt_embeds), one at a time, through the "
            "prefix cache; each then alone with a fresh cache_salt")
    server.say(f"prompt embeddings: {sent}")
    from kvtui.models.registry import ENTRIES, find_model

    entry = find_model(server.model)
    if entry is not None and entry.embeds_from is None:  # e.g. the hybrid: no table to make the rows from
        known = ", ".join(e.name for e in ENTRIES if e.embeds_from)
        return not_applicable(EMBEDS, TITLES[EMBEDS], sent, f"kvtui has no input embedding table for model "
                              f"{server.model} to make the rows from (it sends rows of {known})")
    refused = server.salt_refusal()
    session = run_session(server, spec, ("canary",) if refused else ("reference", "canary"))
    refused = [r for r in session.results.values() if r.status is not None and 400 <= r.status < 500]
    if refused and len(refused) == len(session.results):
        return not_applicable(EMBEDS, TITLES[EMBEDS], sent, f"the server refuses prompt embeddings: "
                              f"{(refused[0].error or f'HTTP {refused[0].status}')[:200]}")
    found = counted(session)
    figures = (f"{completed(session)} of {n} answered, {session.summary.passphrase_echoed} said their own "
               f"passphrase; {session.reference_checked} compared with their solo run{solo_note(refused)}")
    if found:
        return CheckResult(EMBEDS, TITLES[EMBEDS], "fail", sent, figures, evidence_line(found))
    if not completed(session):
        first = next(iter(session.results.values()))
        return not_applicable(EMBEDS, TITLES[EMBEDS], sent, f"no request was answered: {(first.error or '')[:160]}")
    return CheckResult(EMBEDS, TITLES[EMBEDS], "pass", sent, figures)


def prompt_cache(server: Server) -> CheckResult:
    """Conversations that share long notes after their own passphrase, one at a time through the prefix
    (prompt) cache; then the same ones again, as a retry or the next turn sends a conversation's history
    again, so that each finds its blocks cached; each sending then alone past the cache; then rounds of 2 new
    ones at once, read by the canary.

    A cache that keys a block by its tokens without what came before it serves the second sending the notes
    another conversation computed after its own passphrase (one whose passphrase fills as many tokens, so
    the notes' blocks align). SmolLM2 still answers with its own passphrase, token for token (measured:
    the reused notes moved the top-2 gaps by up to 0.45 nats and changed no greedy token). So where the
    server computes a cached prompt exactly as an uncached one (the control: exactness_control), a lone
    answer is also compared with its solo run by its logprobs: one that moved by more than the server's
    tolerance was computed on state that is not its own. Where it does not (llama.cpp's one-token
    prefills round otherwise), logprob moves say nothing and only tokens count.

    Fail: an answer holds another conversation's passphrase, or a lone one differs from its solo run in a
    token or (exact servers) in a logprob by more than the tolerance."""
    fill, rounds = (4, 2) if server.quick else (8, 4)
    common = f"prompts: {{kind: passphrase, template: \"{NOTES}\"}}\noutput_tokens: 20\nsampling: greedy\n"
    lone = scenario(CACHE, f"arrivals: {{process: rounds, rounds: [{{size: 1, count: {fill}}}]}}\n{common}", server.model)
    pairs = scenario(CACHE, f"seed: 1\narrivals: {{process: rounds, rounds: [{{size: 2, count: {rounds}}}]}}\n{common}",
                     server.model)
    sent = (f"a control conversation twice through the cache, then alone past it; {fill} conversations one at a time "
            f"(the passphrase, then ~110 tokens of notes every one shares), then the same {fill} again, each sending "
            f"then alone past the cache; then {rounds} rounds of 2 new ones at once")
    server.say(f"prompt cache: {sent}")
    refused = server.salt_refusal()
    detectors = ("canary",) if refused else ("reference", "canary")
    control = None if refused else exactness_control(server)
    sessions = [run_session(server, lone, detectors), run_session(server, lone, detectors),
                run_session(server, pairs, ("canary",))]
    exact = control is not None and control.nats == 0.0
    found = [describe(e) for s in sessions for e in counted(s)] + (drifted(sessions[:2], server.tolerance)
                                                                    if exact else [])
    finishes = [r for s in sessions for r in s.results.values()]
    cached = [r.cached_tokens for r in finishes if r.cached_tokens is not None]
    reuse = f"{sum(1 for c in cached if c)} of {len(finishes)} served cached prompt tokens ({sum(cached)} in all)" \
        if cached else "cached prompt tokens not reported"
    figures = (f"{sum(completed(s) for s in sessions)} of {len(finishes)} answered; {reuse}; "
               f"{sum(s.reference_checked for s in sessions)} lone ones compared with their solo run"
               f"{solo_note(refused)}{largest_drift(sessions[:2])}{control_note(control, refused)}")
    if found:
        more = f"; {len(found) - 3} more" if len(found) > 3 else ""
        return CheckResult(CACHE, TITLES[CACHE], "fail", sent, figures, "; ".join(found[:3]) + more)
    return CheckResult(CACHE, TITLES[CACHE], "pass", sent, figures)


def exactness_control(server: Server) -> Drift | None:
    """Whether the server computes a cached prompt exactly as an uncached one: one notes conversation of
    its own (under a fresh cache_salt no other request has; llama.cpp has one cache for all) sent twice
    through the cache, then alone past it. Returns the logprob drift of the second sending against the
    lone one (0 nats: exact), or None when that cannot be told: an answer failed or has no logprobs, the
    two differ in a token, the second sending took no prompt tokens from the cache (or the server does
    not say), or the lone one took some."""
    text = NOTES.replace("{passphrase}", "CONTROL-" + secrets.token_hex(3).upper()).replace("\\n", "\n")
    body = server.chat_body(text, max_tokens=8, temperature=0.0, stream=True, stream_options={"include_usage": True},
                            logprobs=True, top_logprobs=TOP_LOGPROBS)
    salted = server.salted(body, secrets.token_hex(16))
    _, again, alone = asyncio.run(send(server, [salted, salted, server.uncached(body)], together=False))
    if again.finish_reason not in ("stop", "length") or alone.finish_reason not in ("stop", "length"):
        return None
    if not again.cached_tokens or alone.cached_tokens:
        return None
    return logprob_drift(again, alone)


def control_note(control: Drift | None, refused: str | None) -> str:
    """The figures' note on the exactness control (exactness_control)."""
    if refused:
        return ""
    if control is None:
        return ("; no exactness control (an answer without logprobs, or the cache not read by the second sending "
                "or read by the lone one): logprobs not judged")
    if control.nats == 0.0:
        return "; the server computes a cached prompt exactly (control moved 0 nats): logprobs judged"
    return (f"; a cached prompt is not computed exactly (control moved {control.nats:.2g} nats): logprob moves "
            "not judged")


def drifts(sessions: list[TargetSession]) -> list[tuple[str, Drift]]:
    """(sending, drift) of every lone answer that equals its solo run token for token (both with logprobs)."""
    out = []
    for k, session in enumerate(sessions):
        for rid, solo in session.solo_results.items():
            drift = logprob_drift(session.results[rid], solo)
            if drift is not None:
                out.append((f"{rid}{' (again)' if k else ''}", drift))
    return out


def drifted(sessions: list[TargetSession], tolerance: float) -> list[str]:
    """The lone answers whose logprobs moved against their solo run by more than `tolerance`, described."""
    return [f"{name}: same tokens as its solo run, but a logprob moved {d.nats:.3g} nats > tolerance {tolerance:g} "
            f"(token {d.index}, {d.token!r}): computed on cached state that is not its own"
            for name, d in drifts(sessions) if d.nats > tolerance]


def largest_drift(sessions: list[TargetSession]) -> str:
    """The figures' note on the largest logprob move of a token-equal lone answer ("" without logprobs)."""
    found = drifts(sessions)
    if not found:
        return ""
    name, d = max(found, key=lambda f: f[1].nats)
    return f"; largest logprob move of a token-equal one {d.nats:.2g} nats ({name})"
