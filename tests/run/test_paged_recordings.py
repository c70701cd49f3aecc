"""The committed paged-KV recordings (SmolLM2, virtual clock): each replays to its recorded summary,
and shows what its scenario is for."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtui.cli import replay_summary
from kvtui.events import Contamination, StepEvent
from kvtui.record import read_recording

ROOT = Path(__file__).parents[2] / "recordings"
NAMES = ("shared_system_prompt", "shared_system_prompt_no_prefix_caching", "multi_tenant",
         "multi_tenant_unsalted_prefix", "preemption")
PAGED = ("num_preemptions_total", "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_cross_tenant_hits")


def load(name: str):
    header, events, summary, truncated = read_recording(ROOT / f"{name}.jsonl")
    assert not truncated and summary is not None
    return header, events, summary


@pytest.mark.parametrize("name", NAMES)
def test_replay_gives_the_recorded_paged_figures(name):
    header, events, summary = load(name)
    assert header.engine["kv"] == "paged" and header.clock == "virtual" and "SmolLM2" in header.model.id
    again = replay_summary(header, events, summary)
    for field in PAGED + ("time_to_first_token_seconds", "output_tokens_per_s", "findings_by_kind"):
        assert getattr(again, field) == getattr(summary, field), field
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert all(e.kv == "paged" and e.block_state for e in steps)


def test_prefix_caching_cuts_ttft_and_raises_throughput():
    _, _, on = load("shared_system_prompt")
    _, _, off = load("shared_system_prompt_no_prefix_caching")
    assert on.prefix_cache_hits > 0 and off.prefix_cache_queries is None  # caching off: nothing looked up
    assert on.time_to_first_token_seconds.p50 < off.time_to_first_token_seconds.p50
    assert on.output_tokens_per_s > off.output_tokens_per_s
    assert on.findings_by_kind == off.findings_by_kind == {}  # the same answers, checked against solo runs


def test_salts_keep_tenants_apart_and_the_fault_does_not():
    _, _, salted = load("multi_tenant")
    _, events, unsalted = load("multi_tenant_unsalted_prefix")
    assert salted.prefix_cache_hits > 0 and salted.prefix_cache_cross_tenant_hits == 0
    assert salted.findings_by_kind == {}
    assert unsalted.prefix_cache_cross_tenant_hits > 0 and unsalted.findings_by_kind.get("cross_tenant", 0) > 0
    tenants = {e.request_id: e.tenant for e in events if getattr(e, "type", "") == "request.arrive"}
    leaks = [e for e in events if isinstance(e, Contamination) and e.detector == "prefix_provenance"]
    assert leaks and all(tenants[e.victim] != tenants[e.source] for e in leaks)


def test_preemption_keeps_every_answer():
    _, _, summary = load("preemption")
    assert summary.num_preemptions_total > 0
    assert summary.findings_by_kind == {} and summary.reference_checked == summary.requests_completed == 8
    assert summary.passphrase_echoed == summary.passphrase_requests == 8
