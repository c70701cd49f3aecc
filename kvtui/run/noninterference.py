"""The noninterference audit (`kvtui audit`, local or `--target`), over either kind of run.

Three runs of a scenario's load: as planned (the baseline), then with the prompts of half the requests
replaced by different prompts a few tokens longer (the even requests by request id, then the odd ones).
Every request whose own prompt stayed must get the same answer in each run: otherwise something of
its neighbours reached it. Catches leaks without canaries (position and mask faults too).

What differs between a local and a target run is behind `AuditSubject`: how a run is made and what it
answers (kvtui/audit.py: token ids on the virtual clock, compared exactly; kvtui/remote/audit.py: a
server's streamed answers, compared with logprob tolerance), how much longer a replacement prompt may
be, and who could have reached a request (co-batched in a step, or in flight at the same time).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from kvtui.events import Contamination, NoninterferenceEvidence
from kvtui.request import NO_FACTS, AudioClip, TokenPrompt


@dataclass(frozen=True)
class Change:
    """How a kept request's answer moved between the baseline and a run with neighbours replaced.

    Attributes:
        index: the first differing token (0-based, in the answer).
        kind: `cross_request` (it moved with its neighbours), `numeric` (a near tie flipped, within
            `tolerance`) or `unknown` (nothing to judge by).
        baseline_text / changed_text: the two answers.
        gap: the top-2 logprob gap (nats) at `index` when known; tolerance: the gap under which a
            change is numeric, when one applies.
    """

    index: int
    kind: str
    baseline_text: str
    changed_text: str
    gap: float | None = None
    tolerance: float | None = None


@dataclass
class AuditRun:
    """One of the audit's runs: the requests as planned, each request's answer, who could have reached
    it (request ids), and the requests a server answered partly from its prefix cache (not compared)."""

    planned: list
    answers: dict[str, object]
    neighbours: dict[str, tuple[str, ...]] = field(default_factory=dict)
    cached: set[str] = field(default_factory=set)


class AuditSubject(Protocol):
    """What the audit runs on: kvtui's engine (kvtui/audit.py) or a server (kvtui/remote/audit.py)."""

    tokenizer: object

    def run(self, planned: list | None) -> AuditRun:
        """One run of `planned` (None: the scenario's own plan)."""

    def room(self, planned) -> int:
        """How many tokens longer a replacement for `planned`'s prompt may be."""

    def compare(self, baseline: object, changed: object) -> Change | None:
        """How an answer moved (None: it did not, or there is nothing to compare)."""


@dataclass
class NoninterferenceAudit:
    """What the audit found: `events` (noninterference reports), `compared` (requests compared across
    two runs), `cached` (requests left out because the server reported cached prompt tokens)."""

    events: list[Contamination] = field(default_factory=list)
    compared: int = 0
    cached: int = 0


def replacement(prompt: list[int], vocab: list[int], seed: int, room: int) -> list[int]:
    """A different prompt, up to 8 tokens longer as `room` allows (neighbour lengths change too, so
    faults that leak lengths, such as position offsets, show), drawn from `vocab` with `seed`."""
    rng = random.Random(seed)
    return [rng.choice(vocab) for _ in range(len(prompt) + min(rng.randint(1, 8), max(room, 0)))]


def replaced_plan(planned: list, tokenizer, parity: int, room: Callable[[object], int]) -> list:
    """`planned` with every other request's prompt (by request id: even when `parity` is 0, odd when 1)
    replaced by random tokens (no special ones) up to `room(request)` longer, with their text when the
    request had text (a server is sent the text): no canary, no prompt facts."""
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(min(len(tokenizer), 50000)) if i not in special]
    order = {p.request_id: i for i, p in enumerate(sorted(planned, key=lambda p: p.request_id))}
    out = []
    for p in planned:
        index = order[p.request_id]
        if index % 2 == parity:
            ids = replacement(p.prompt_ids, vocab, index, room(p))
            text = tokenizer.decode(ids, skip_special_tokens=True) if p.text is not None else None
            p = replace(p, input=_replaced_input(p.input, ids), text=text, canary=None, facts=NO_FACTS)
        out.append(p)
    return out


def _replaced_input(spec, ids: list[int]):
    """The InputSpec of a replaced prompt: a speech request's clip with the new decoder ids (its audio
    stays), any other prompt the new token ids alone (an embeddings or image prompt becomes a token one)."""
    if isinstance(spec, AudioClip):
        return replace(spec, ids=tuple(ids))
    return TokenPrompt(tuple(ids))


def run_noninterference(subject: AuditSubject, console=None) -> NoninterferenceAudit:
    """The three runs; a `noninterference` report for every kept request whose answer changed (see
    the module docstring), naming the replaced neighbours that could have reached it in the baseline."""
    def say(text: str) -> None:
        if console is not None:
            console.print(text)

    say("audit: baseline run")
    base = subject.run(None)
    ordered = {rid: i for i, rid in enumerate(sorted(base.answers))}
    audit = NoninterferenceAudit()
    for parity in (0, 1):
        say(f"audit: run with the {'even' if parity == 0 else 'odd'} requests' prompts replaced")
        changed = subject.run(replaced_plan(base.planned, subject.tokenizer, parity, subject.room))
        for rid, index in ordered.items():
            if index % 2 == parity or rid not in changed.answers:
                continue
            if rid in base.cached or rid in changed.cached:
                audit.cached += 1
                continue
            audit.compared += 1
            change = subject.compare(base.answers[rid], changed.answers[rid])
            if change is not None:
                replaced = [n for n in base.neighbours.get(rid, ()) if n in ordered and ordered[n] % 2 == parity]
                audit.events.append(_report(rid, change, sorted(replaced)))
    return audit


def _report(rid: str, change: Change, replaced: list[str]) -> Contamination:
    return Contamination(
        t=0.0, step=-1, detector="noninterference", kind=change.kind, victim=rid,
        source=(",".join(replaced) or None) if change.kind == "cross_request" else None,
        evidence=NoninterferenceEvidence(
            token_index=change.index, baseline_text=change.baseline_text,
            text_with_neighbours_replaced=change.changed_text, replaced_neighbours=tuple(replaced),
            top2_gap=change.gap, tolerance=change.tolerance))
