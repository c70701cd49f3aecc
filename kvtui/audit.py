"""noninterference audit (`kvtui audit`): run a scenario, then run it again with the prompts of half
the requests replaced by different prompts a few tokens longer (even requests, then odd ones). Every
request whose prompt stayed must produce exactly the same tokens: otherwise something of its
co-batched neighbours reached it. Catches leaks without canaries (position and mask faults too).
Runs on the virtual clock, so arrival times and step pacing are identical across the runs.
"""

from __future__ import annotations

import random
from dataclasses import replace

from kvtui.events import Contamination, Finish, NoninterferenceEvidence, StepEvent
from kvtui.session import Session


def _replacement(prompt: list[int], vocab: list[int], seed: int, room: int) -> list[int]:
    """A different prompt, a few tokens longer when `room` allows (neighbour lengths change too, so
    faults that leak lengths, such as position offsets, show)."""
    rng = random.Random(seed)
    return [rng.choice(vocab) for _ in range(len(prompt) + min(rng.randint(1, 8), max(room, 0)))]


def _run(spec, loaded, faults, replace_parity: int | None):
    session = Session(spec, loaded, clock="virtual", detectors=(), faults=faults)
    if replace_parity is not None:
        session.pending = _replaced(session, loaded.tokenizer, replace_parity)
    neighbours: dict[str, set[str]] = {}
    outputs: dict[str, list[int]] = {}
    session.listeners.append(lambda e: _note(e, neighbours, outputs))
    session.run()
    return outputs, neighbours, session.tokenizer


def _replaced(session, tokenizer, parity: int) -> list:
    """The session's planned requests with every other one's prompt (by request id: even when
    `parity` is 0, odd when 1) replaced by a different prompt a few tokens longer."""
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(min(len(tokenizer), 50000)) if i not in special]
    order = {p.request_id: i for i, p in enumerate(sorted(session.pending, key=lambda p: p.request_id))}
    out = []
    for planned in session.pending:
        index = order[planned.request_id]
        if index % 2 == parity:
            room = session.config.max_len - len(planned.prompt_ids) - planned.sampling.max_new_tokens
            planned = replace(planned, prompt_ids=_replacement(planned.prompt_ids, vocab, index, room))
        out.append(planned)
    return out


def _note(event, neighbours: dict[str, set[str]], outputs: dict[str, list[int]]) -> None:
    """Collect each request's co-batched neighbours (step events) and output tokens (finish events)."""
    if isinstance(event, Finish):
        outputs[event.request_id] = list(event.output_ids)
    elif isinstance(event, StepEvent):
        ids = [r.request_id for r in event.running]
        for rid in ids:
            neighbours.setdefault(rid, set()).update(i for i in ids if i != rid)


def run_audit(spec, loaded, *, faults: tuple[str, ...] = (), console=None) -> list[Contamination]:
    """Three virtual-clock runs (baseline, evens replaced, odds replaced); returns contamination
    events (kind cross_request, detector noninterference) for every kept request whose tokens changed."""
    if console is not None:
        console.print("audit: baseline run")
    base, neighbours, tokenizer = _run(spec, loaded, faults, None)
    ordered = sorted(base)
    events = []
    for parity in (0, 1):
        if console is not None:
            console.print(f"audit: run with {'even' if parity == 0 else 'odd'} requests' prompts replaced")
        changed, _, _ = _run(spec, loaded, faults, parity)
        for index, rid in enumerate(ordered):
            if index % 2 == parity or changed.get(rid) == base[rid]:
                continue
            a, b = base[rid], changed.get(rid, [])
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            replaced = sorted(n for n in neighbours.get(rid, ()) if ordered.index(n) % 2 == parity)
            events.append(Contamination(
                t=0.0, step=-1, detector="noninterference", kind="cross_request", victim=rid,
                source=",".join(replaced) or None,
                evidence=NoninterferenceEvidence(
                    token_index=first, baseline_text=tokenizer.decode(a, skip_special_tokens=True),
                    text_with_neighbours_replaced=tokenizer.decode(b, skip_special_tokens=True),
                    replaced_neighbours=tuple(replaced))))
    return events
