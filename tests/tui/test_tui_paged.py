"""The dashboard on paged KV, driven by Pilot: the block map replaces the slot map (blocks coloured by
tenant, shared blocks with their reference count, cached free blocks dimmed), with the prefix hit
rate, preemptions and cross-tenant hits; on a replay of a tiny-llama recording and live."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from test_tui_app import LIVE_DETECTORS, quit_app, until

from kvtui.events import StepEvent
from kvtui.scenario import parse_scenario
from kvtui.session import Session
from kvtui.tui.app import KvtuiApp, screen_text
from kvtui.tui.live import LiveSource
from kvtui.tui.replay import ReplaySource
from kvtui.tui.snapshot_build import build_snapshot

SCENARIO = """
name: paged_tui
seed: 0
max_requests: 8
model: tiny-llama
engine: {kv: paged, block_size: 16, max_len: 160, num_blocks: 40, prefix_caching: true, faults: [unsalted_prefix]}
tenants: {count: 2}
arrivals: {process: constant, rate_per_s: 20.0}
prompts: {kind: system_prompt, count: 1, system_tokens: 48, user_tokens: {dist: uniform, min: 2, max: 8}}
output_tokens: 24
sampling: {ignore_eos: true}
"""


@pytest.fixture(scope="module")
def loaded():
    from kvtui.models import load_model

    return load_model("tiny-llama", progress=False)


@pytest.fixture(scope="module")
def recording(loaded, tmp_path_factory) -> tuple[Path, list]:
    path = tmp_path_factory.mktemp("paged") / "paged.jsonl"
    events: list = []
    Session(parse_scenario(SCENARIO), loaded, clock="virtual", record_path=path, listeners=(events.append,),
            detectors=LIVE_DETECTORS + ("prefix_provenance",)).run()
    return path, events


def _shared_step(events) -> StepEvent:
    """The first step where a block is held by two requests (a shared prefix)."""
    return next(e for e in events if isinstance(e, StepEvent) and e.block_state and any(c in "23456789+"
                                                                                       for c in e.block_state))


@pytest.mark.parametrize("size", [(160, 45), (100, 30)])
def test_block_map_on_a_replay(recording, size):
    path, events = recording
    shared = _shared_step(events)

    async def run():
        source = ReplaySource.from_file(path, start_paused=True)
        app = KvtuiApp(source)
        async with app.run_test(size=size) as pilot:
            source.seek_to(shared.t)
            await pilot.pause(0.2)
            text, snap = screen_text(app), build_snapshot(source.state)
            await pilot.press("q")
        return text, snap

    text, snap = asyncio.run(run())
    for needle in ("KV blocks", "blocks in use", "shared", "cached free", "prefix hit rate", "preemptions",
                   "cross-tenant hits", "16 tokens per block", "TENANT"):
        assert needle in text, f"{needle!r} not on the {size} screen:\n{text}"
    assert "╭─ slots" not in text
    assert len(snap.blocks) == 39  # the null block is not drawn
    holders = {rid: set(blocks) for rid, blocks in shared.block_tables}
    for b in snap.blocks:
        expected = sum(b.index in blocks for blocks in holders.values())
        assert b.refs == expected, b  # the reference count is the number of block tables listing the block
        if b.refs:
            tenant = snap_tenant(events, b.owner)
            assert b.color == source_tenant_color(events, tenant)
    assert any(b.refs >= 2 for b in snap.blocks)
    assert f"{sum(1 for b in snap.blocks if b.refs >= 2)} shared" in text


def snap_tenant(events, rid):
    return next(e.tenant for e in events if getattr(e, "type", "") == "request.arrive" and e.request_id == rid)


def source_tenant_color(events, tenant):
    """Tenants get palette colours in order of first arrival."""
    order = []
    for e in events:
        if getattr(e, "type", "") == "request.arrive" and e.tenant not in order:
            order.append(e.tenant)
    return order.index(tenant)


def test_block_map_live(loaded, tmp_path):
    spec = parse_scenario(SCENARIO.replace("output_tokens: 24", "output_tokens: 180").replace("max_len: 160", "max_len: 256"))

    def make(listener, generation):
        return Session(spec, loaded, clock="wall", record_path=tmp_path / "live.jsonl", listeners=(listener,),
                       detectors=("slot_taint", "prefix_provenance"))

    source = LiveSource(make)

    async def run():
        app = KvtuiApp(source)
        async with app.run_test(size=(160, 45)) as pilot:
            await until(lambda: "blocks in use" in screen_text(app) and source.state.metrics.prefix_hits > 0,
                        pilot=pilot, timeout_s=30)
            text = screen_text(app)
            await quit_app(app, pilot)
        return text, app.return_value

    text, summary = asyncio.run(run())
    assert "KV blocks" in text and "prefix hit rate" in text
    assert summary.prefix_cache_hits > 0 and summary.num_preemptions_total is not None


def test_the_isolation_key_and_the_fault_picker_follow_the_kv_mode():
    from kvtui.events import Header
    from kvtui.faults import FAULTS, faults_for
    from kvtui.tui.state import DashboardState

    for engine, expected in (({}, ("stale_slot",)), ({"kv": "paged", "prefix_caching": True}, ("block_refcount",)),
                             ({"kv": "paged"}, ("shared_position_offset",))):
        state = DashboardState()
        state.apply(Header(engine=engine))
        assert state.isolation_faults == expected
        kv = engine.get("kv", "slots")
        assert all(kv in FAULTS[name].kv for name in expected)
    assert "stale_slot" not in faults_for("paged") and "unsalted_prefix" in faults_for("paged")
    assert "unsalted_prefix" not in faults_for("slots") and "stale_slot" in faults_for("slots")
