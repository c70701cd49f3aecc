"""The block map (key `m`): what its cells say of a paged run with a fault that acts, from the run's own
events (a tiny-llama run of two tenants sharing a system prompt with unsalted_prefix on), and the panel at
a narrow and a wide size."""

from __future__ import annotations

import pytest
from rich.console import Console

from kvtui.events import Contamination, FaultActed, StepEvent
from kvtui.scenario import parse_scenario
from kvtui.session import Session
from kvtui.tui.map_panel import kv_map
from kvtui.tui.snapshot_build import build_snapshot
from kvtui.tui.state import DashboardState

UNSALTED = """name: block-map
seed: 0
max_requests: 8
model: tiny-llama
engine: {kv: paged, block_size: 16, max_len: 128, prefix_caching: true, num_blocks: 40, faults: [unsalted_prefix]}
tenants: {count: 2}
arrivals: {process: constant, rate_per_s: 10.0}
prompts: {kind: system_prompt, count: 1, system_tokens: 32, user_tokens: {dist: uniform, min: 2, max: 8}}
output_tokens: 8
sampling: {ignore_eos: true}
"""


@pytest.fixture(scope="module")
def moment(tiny):
    """(the snapshot right after the first fault.acted event, that event, the first prefix_provenance report
    with the snapshot right after it)."""
    state, snaps, reports = DashboardState(), [], []

    def listen(event):
        state.apply(event)
        if isinstance(event, FaultActed) and not snaps:
            snaps.append((build_snapshot(state), event))
        if isinstance(event, Contamination) and event.detector == "prefix_provenance" and not reports:
            reports.append((event, build_snapshot(state)))

    Session(parse_scenario(UNSALTED), tiny["tiny-llama"], clock="virtual", listeners=(listen,)).run()
    return *snaps[0], reports[0]


def test_the_blocks_the_fault_handed_over_are_marked_coloured_by_tenant_and_just_reused(moment):
    snap, acted, _ = moment
    assert acted.fault == "unsalted_prefix" and acted.where == "block" and acted.ids
    cells = {c.index: c for c in snap.kv_map.cells}
    for block in acted.ids:
        c = cells[block]
        assert c.fault == "unsalted_prefix" and c.reused == 0 and c.owner is not None
        assert c.tenant in ("t0", "t1")
    by_tenant = {c.tenant: c.color for c in snap.kv_map.cells if c.owner}  # one colour per tenant
    assert len(by_tenant) == 2 and len(set(by_tenant.values())) == 2
    assert all(c.color == by_tenant[c.tenant] for c in snap.kv_map.cells if c.owner)
    # the other tenant's request that computed the blocks: the block's age counts from it, not the reuse
    assert all(cells[b].age > 0 for b in acted.ids)
    assert snap.kv_map.unit == "block" and len(snap.kv_map.cells) == 39  # the null block left out


def test_the_detectors_mark_the_blocks_their_reports_name_and_the_victims_own(moment):
    _, _, (report, snap) = moment
    marked = {c.index for c in snap.kv_map.cells if c.detector == "prefix_provenance"}
    own = {c.index for c in snap.kv_map.cells if c.owner == report.victim}
    assert report.evidence.blocks and set(report.evidence.blocks) | own <= marked


@pytest.mark.parametrize("size", [(58, 18), (94, 32)])
def test_the_panel_lists_each_owner_with_its_blocks_and_marks(moment, size):
    snap, acted, _ = moment
    width, height = size
    console = Console(width=width, color_system=None, record=True)
    console.print(kv_map(snap, width, height))
    text = console.export_text()
    assert len(text.splitlines()) <= height and "39 blocks held: ! fault acted" in text
    owner = next(c.owner for c in snap.kv_map.cells if c.index == acted.ids[0])  # the block's first holder
    lines = [line for line in text.splitlines() if line.startswith(f" {owner} ")]
    assert lines and "!unsalted_prefix" in lines[0] and ("reused 0 ago" in lines[0]) == (width >= 80)


def test_a_slot_run_has_one_cell_per_slot_and_no_block_fields(tiny):
    state = DashboardState()
    spec = parse_scenario(UNSALTED.replace("kv: paged, block_size: 16, max_len: 128, prefix_caching: true, "
                                           "num_blocks: 40, faults: [unsalted_prefix]", "slots: 3, max_len: 128"))
    Session(spec, tiny["tiny-llama"], clock="virtual", listeners=(state.apply,)).run()
    view = build_snapshot(state).kv_map
    assert view.unit == "slot" and [c.index for c in view.cells] == [0, 1, 2]
    assert all(c.reused is None and not c.cached and c.fault is None for c in view.cells)
    assert isinstance(state.last_step, StepEvent) and view.state == () and view.tier is None
