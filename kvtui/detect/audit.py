"""noninterference audit (`kvtui audit`): run a scenario, then run it again with the prompts of half
the requests replaced by different prompts a few tokens longer (even requests, then odd ones). Every
request whose prompt stayed must produce exactly the same tokens: otherwise something of its
co-batched neighbours reached it. Catches leaks without canaries (position and mask faults too).
Runs on the virtual clock, so arrival times and step pacing are identical across the runs.
"""

from __future__ import annotations

import random

from kvtui.detect import contamination_event


def _replacement(prompt: list[int], vocab: list[int], seed: int, room: int) -> list[int]:
    """A different prompt, a few tokens longer when `room` allows (neighbour lengths change too, so
    faults that leak lengths, such as position offsets, show)."""
    rng = random.Random(seed)
    return [rng.choice(vocab) for _ in range(len(prompt) + min(rng.randint(1, 8), max(room, 0)))]


def _run(spec, loaded, faults, replace_parity: int | None, console=None):
    from kvtui.session import Session

    session = Session(spec, loaded, clock="virtual", detectors=(), faults=faults)
    if replace_parity is not None:
        special = set(loaded.tokenizer.all_special_ids)
        vocab = [i for i in range(min(len(loaded.tokenizer), 50000)) if i not in special]
        for index, planned in enumerate(sorted(session.pending, key=lambda p: p.request_id)):
            if index % 2 == replace_parity:
                room = session.config.max_len - len(planned.prompt_ids) - planned.sampling.max_new_tokens
                object.__setattr__(planned, "prompt_ids", _replacement(planned.prompt_ids, vocab, index, room))
    neighbours: dict[str, set[str]] = {}
    session.listeners.append(lambda e: _note_batch(e, neighbours))
    session.run()
    outputs = {rid: list(state.generated_ids) for rid, state in session.engine.requests.items()}
    steps = {rid: list(state.token_times_s) for rid, state in session.engine.requests.items()}
    return outputs, neighbours, session.tokenizer, steps


def _note_batch(event: dict, neighbours: dict[str, set[str]]) -> None:
    if event.get("type") == "step":
        ids = [r["id"] for r in event["running"]]
        for rid in ids:
            neighbours.setdefault(rid, set()).update(i for i in ids if i != rid)


def run_audit(spec, loaded, *, faults: tuple[str, ...] = (), console=None) -> list[dict]:
    """Three virtual-clock runs (baseline, evens replaced, odds replaced); returns contamination
    events (kind cross_request, detector noninterference) for every kept request whose tokens changed."""
    if console is not None:
        console.print("audit: baseline run")
    base, neighbours, tokenizer, _ = _run(spec, loaded, faults, None)
    ordered = sorted(base)
    events = []
    for parity in (0, 1):
        if console is not None:
            console.print(f"audit: run with {'even' if parity == 0 else 'odd'} requests' prompts replaced")
        changed, _, _, _ = _run(spec, loaded, faults, parity)
        for index, rid in enumerate(ordered):
            if index % 2 == parity or changed.get(rid) == base[rid]:
                continue
            a, b = base[rid], changed.get(rid, [])
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            replaced = sorted(n for n in neighbours.get(rid, ()) if ordered.index(n) % 2 == parity)
            events.append(contamination_event(
                t=0.0, step=-1, detector="noninterference", kind="cross_request", victim=rid,
                source=",".join(replaced) or None,
                evidence={"token_index": first, "baseline_text": tokenizer.decode(a, skip_special_tokens=True),
                          "text_with_neighbours_replaced": tokenizer.decode(b, skip_special_tokens=True),
                          "replaced_neighbours": replaced}))
    return events
