"""The paged-KV faults on tiny-llama: every detector the catalogue lists fires, victim and source are
named (and the tenants, for a cross-tenant reuse); the same loads with the fault off, and random paged
workloads with prefix caching, tenants and tight pools, stay silent."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_faults import CONTAMINATION, PAGED_LOADS, TEXT_DETECTORS, events_of, run, scenario

from kvtui.events import Arrive
from kvtui.faults import FAULTS
from kvtui.scenario import parse_scenario

PAGED_CASES = [(name, layout) for name in PAGED_LOADS for layout in FAULTS[name].layouts]


def _run_recorded(tiny, spec):
    events = []
    return run(tiny, spec, listeners=(events.append,)), events


@pytest.mark.parametrize("name,layout", PAGED_CASES)
def test_every_listed_detector_fires_and_names_victim_and_source(tiny, name, layout):
    session, events = _run_recorded(tiny, scenario(layout, faults=[name], kv="paged"))
    fault = FAULTS[name]
    counted = [e for e in session.contamination if e.counts]
    for detector in set(fault.caught_by) - TEXT_DETECTORS:  # the canary: on SmolLM2 (tiny-llama's text is random)
        assert any(e.detector == detector for e in counted), f"{name} ({layout}): {detector} silent"
    ran = {e.request_id for e in events if isinstance(e, Arrive)}
    named = [e for e in counted if e.kind in ("cross_request", "cross_tenant") and e.detector != "reference"]
    assert named
    for e in named:
        assert e.source is not None and e.source != e.victim and {e.source, e.victim} <= ran


def test_unsalted_prefix_serves_another_tenants_blocks_and_outputs_stay_right(tiny):
    session, events = _run_recorded(tiny, scenario("padded", faults=["unsalted_prefix"], kv="paged"))
    tenants = {e.request_id: e.tenant for e in events if isinstance(e, Arrive)}
    leaks = events_of(session, kind="cross_tenant", detector="prefix_provenance")
    assert leaks
    for e in leaks:
        assert e.evidence.victim_tenant == tenants[e.victim] != tenants[e.source] == e.evidence.source_tenant
        assert e.evidence.same_prefix and not e.evidence.same_salt and e.evidence.hit_tokens >= 16
    assert events_of(session, detector="reference") == []  # the reused K/V is right: only the sharing leaks
    assert session.summary.prefix_cache_cross_tenant_hits > 0


@pytest.mark.parametrize("name", list(PAGED_LOADS))
def test_the_same_load_without_the_fault_is_silent(tiny, name):
    session = run(tiny, scenario("padded", faults=[name], kv="paged", drop_faults=True))
    assert [e for e in session.contamination if e.kind in CONTAMINATION] == []
    assert session.summary.prefix_cache_hits > 0  # the cache was used, and used soundly
    assert session.summary.prefix_cache_cross_tenant_hits == 0


def test_without_salts_tenants_share_blocks_by_design(tiny):
    text = PAGED_LOADS["unsalted_prefix"].format(layout="padded", faults="").replace(
        "tenants: {count: 2}", "tenants: {count: 2, cache_salt: none}")
    session = run(tiny, parse_scenario(f"name: shared\nmodel: tiny-llama\n{text}\noutput_tokens: 8\n"
                                       "sampling: {ignore_eos: true}"))
    assert session.summary.prefix_cache_cross_tenant_hits > 0
    assert [e for e in session.contamination if e.kind in CONTAMINATION] == []  # no salt: sharing is allowed


@st.composite
def paged_scenarios(draw):
    block = draw(st.sampled_from([1, 4, 16]))
    max_len = 96
    least = -(-max_len // block) + 1
    prompts = draw(st.sampled_from([
        "{kind: system_prompt, count: 2, system_tokens: 20, instruction_tokens: 8, user_tokens: {dist: uniform, "
        "min: 1, max: 12}}",
        "{kind: multi_turn, sessions: 2, turns: 3, system_tokens: 8, user_tokens: 6, reply_tokens: 5}",
        "{kind: synthetic, prompt_tokens: {dist: uniform, min: 1, max: 30}, shared_prefix_tokens: 12}"]))
    return parse_scenario(f"""
seed: {draw(st.integers(0, 10_000))}
max_requests: {draw(st.integers(1, 8))}
model: tiny-llama
engine: {{kv: paged, block_size: {block}, num_blocks: {draw(st.integers(least, 3 * least))}, max_len: {max_len},
          prefix_caching: {str(draw(st.booleans())).lower()}, layout: {draw(st.sampled_from(["padded", "packed"]))},
          max_batch_size: {draw(st.integers(1, 6))}, max_tokens_per_step: {draw(st.sampled_from([8, 64, 1024]))},
          watermark: 0.0}}
tenants: {{count: {draw(st.integers(1, 3))}, cache_salt: {draw(st.sampled_from(["per_tenant", "none"]))}}}
arrivals: {{process: poisson, rate_per_s: {draw(st.sampled_from([2.0, 20.0, 200.0]))}}}
prompts: {prompts}
output_tokens: {draw(st.integers(1, 12))}
sampling: {{temperature: {draw(st.sampled_from([0.0, 0.8]))}, ignore_eos: true}}
""")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(paged_scenarios())
def test_paged_isolation_intact_gives_no_contamination(tiny, spec):
    session = run(tiny, spec)
    assert [e for e in session.contamination if e.kind in CONTAMINATION] == []
