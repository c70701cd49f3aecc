"""`kvtui audit SCENARIO --target URL`: the noninterference audit (kvtui/audit.py) against a server.

Three runs of the scenario's load: as planned, then with the prompts of the even requests replaced by
different prompts a few tokens longer, then the odd ones (the replacement prompts are kvtui.audit's).
A request whose prompt stayed must get the same answer in every run. On the wall clock the batches
differ from run to run anyway, so a changed answer is compared as the reference check compares: the
first differing token's top-2 logprob gap within the tolerance is `numeric`; beyond it the answer
moved with its neighbours' content: `cross_request`, naming the replaced neighbours that were in flight
with it in the first run; without logprobs, `unknown`.

Every request of the three runs goes past the server's prefix cache (a fresh `cache_salt` each, or
`cache_prompt: false` to llama.cpp): a run that reused the KV an earlier run wrote for the same prompt
would copy that run's answer instead of computing its own. A request whose server still reports cached
prompt tokens in either run is not compared, and counted (`TargetAudit.cached`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvtui.audit import _replacement
from kvtui.events import Contamination, NoninterferenceEvidence
from kvtui.target.session import TargetOptions, TargetSession
from kvtui.target.solo_check import first_divergence


def replaced_plan(planned: list, tokenizer, parity: int) -> list:
    """`planned` with every other request's prompt (by request id: even when `parity` is 0, odd when 1)
    replaced by random tokens a few longer, sent as their text (or ids for a prompt without text)."""
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(min(len(tokenizer), 50000)) if i not in special]
    order = {p.request_id: i for i, p in enumerate(sorted(planned, key=lambda p: p.request_id))}
    out = []
    for p in planned:
        index = order[p.request_id]
        if index % 2 == parity:
            ids = _replacement(p.prompt_ids, vocab, index, room=8)
            meta = {"prompt_text": tokenizer.decode(ids, skip_special_tokens=True)} if "prompt_text" in p.metadata \
                else {}
            p = replace(p, prompt_ids=ids, metadata=meta)
        out.append(p)
    return out


@dataclass
class TargetAudit:
    """What the audit found: `events` (noninterference reports), `compared` (requests compared across
    two runs), `cached` (requests left out because the server reported cached prompt tokens)."""

    events: list[Contamination] = field(default_factory=list)
    compared: int = 0
    cached: int = 0


def run_target_audit(spec, tokenizer, options: TargetOptions, *, console=None) -> TargetAudit:
    """The three runs; a `noninterference` report for every kept request whose answer changed (kinds
    numeric, cross_request or unknown, see the module docstring).

    Raises:
        TargetError: the server cannot be reached.
    """
    def say(text: str) -> None:
        if console is not None:
            console.print(text)

    options = replace(options, uncached_load=True)
    say("audit: baseline run")
    base = TargetSession(spec, tokenizer, options, detectors=())
    planned = list(base.pending)
    base.run()
    ordered = sorted(base.results)
    audit = TargetAudit()
    for parity in (0, 1):
        say(f"audit: run with the {'even' if parity == 0 else 'odd'} requests' prompts replaced")
        changed = TargetSession(spec, tokenizer, options, detectors=(),
                                planned=replaced_plan(planned, tokenizer, parity))
        changed.run()
        for index, rid in enumerate(ordered):
            if index % 2 == parity or rid not in changed.results:
                continue
            if base.results[rid].cached_tokens or changed.results[rid].cached_tokens:
                audit.cached += 1
                continue
            audit.compared += 1
            event = _compare(rid, base, changed, parity, ordered, options.tolerance)
            if event is not None:
                audit.events.append(event)
    return audit


def _compare(rid: str, base: TargetSession, changed: TargetSession, parity: int, ordered: list[str],
             tolerance: float) -> Contamination | None:
    a, b = base.results[rid], changed.results[rid]
    if "error" in (a.finish_reason, b.finish_reason):
        return None
    d = first_divergence(a, b, tolerance)
    if d is None:
        return None
    neighbours = [n for n in base._overlapping(rid) if ordered.index(n) % 2 == parity]
    kind = "cross_request" if d.kind == "corruption" else d.kind
    return Contamination(
        t=0.0, step=-1, detector="noninterference", kind=kind, victim=rid,
        source=(",".join(neighbours) or None) if kind == "cross_request" else None,
        evidence=NoninterferenceEvidence(token_index=d.index, baseline_text=a.text,
                                         text_with_neighbours_replaced=b.text, replaced_neighbours=tuple(neighbours),
                                         top2_gap=None if d.gap is None else round(d.gap, 6), tolerance=tolerance))
