"""`kvtui audit` (local): the noninterference audit on tiny-llama, on the virtual clock.

The oracle is the baseline run itself: a request whose own prompt stayed must produce the same tokens when
its neighbours' prompts are replaced. With isolation intact none may change; with a batching fault that
lets a row see its neighbours (or their lengths), kept requests change, and each report names only
replaced neighbours that were co-batched with it.
"""

from __future__ import annotations

import pytest

from kvtui.audit import run_audit
from kvtui.events import Finish, StepEvent
from kvtui.scenario import parse_scenario
from kvtui.session import Session

SCENARIO = """
name: audit-test
seed: 3
max_requests: 6
model: tiny-llama
engine: {slots: 3, max_len: 128, layout: LAYOUT}
arrivals: {process: constant, rate_per_s: 50.0}
prompts: {kind: synthetic, prompt_tokens: {dist: uniform, min: 3, max: 30}}
output_tokens: 8
sampling: {ignore_eos: true}
"""


def spec(layout="padded"):
    return parse_scenario(SCENARIO.replace("LAYOUT", layout))


def _baseline(loaded, layout, faults=()):
    """Each request's tokens and co-batched neighbours in an unchanged run (read from its events)."""
    session = Session(spec(layout), loaded, clock="virtual", detectors=(), faults=faults)
    outputs, neighbours = {}, {}

    def note(e):
        if isinstance(e, Finish):
            outputs[e.request_id] = list(e.output_ids)
        elif isinstance(e, StepEvent):
            ids = [r.request_id for r in e.running]
            for rid in ids:
                neighbours.setdefault(rid, set()).update(i for i in ids if i != rid)

    session.listeners.append(note)
    session.run()
    return outputs, neighbours


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_audit_holds_with_isolation_intact(tiny, layout):
    assert run_audit(spec(layout), tiny["tiny-llama"]) == []


@pytest.mark.parametrize(("fault", "layout"), [("shared_position_offset", "padded"), ("no_request_mask", "packed")])
def test_audit_catches_a_batching_fault_and_names_replaced_cobatched_neighbours(tiny, fault, layout):
    loaded = tiny["tiny-llama"]
    events = run_audit(spec(layout), loaded, faults=(fault,))
    assert events, f"{fault} changed no kept request's tokens"
    outputs, neighbours = _baseline(loaded, layout, faults=(fault,))
    tokenizer = loaded.tokenizer
    for e in events:
        assert (e.detector, e.kind, e.step) == ("noninterference", "cross_request", -1)
        victim_parity = int(e.victim[1:]) % 2  # r000..r005: index by request id
        replaced = e.evidence.replaced_neighbours
        assert replaced and all(int(n[1:]) % 2 != victim_parity for n in replaced)
        assert set(replaced) <= neighbours[e.victim]
        assert e.source == ",".join(replaced)
        assert e.evidence.baseline_text == tokenizer.decode(outputs[e.victim], skip_special_tokens=True)
        assert e.evidence.baseline_text != e.evidence.text_with_neighbours_replaced
        assert 0 <= e.evidence.token_index < len(outputs[e.victim])
        assert (e.evidence.top2_gap, e.evidence.tolerance) == (None, None)
