"""`kvtui audit --timing`: the prefix-cache timing side channel on tiny-llama. On the virtual clock a
cache hit skips prefill positions the cost model charges, so without salts TTFT separates matching
probes perfectly, and with per-tenant salts both classes compute the same positions."""

import pytest
from typer.testing import CliRunner

from kvtui.audit_timing import roc_auc, run_timing_audit
from kvtui.cli import app
from kvtui.scenario import parse_scenario

SCENARIO = """
name: timing
seed: 1
max_requests: 2
model: tiny-llama
engine: {kv: paged, block_size: 16, max_len: 256, prefix_caching: true}
tenants: {count: 2}
prompts: {kind: system_prompt}
"""


@pytest.mark.parametrize("positives,negatives,auc", [
    ([1.0], [2.0], 1.0),
    ([2.0], [1.0], 0.0),
    ([1.0], [1.0], 0.5),
    ([0.1, 0.4], [0.35, 0.8], 0.75),  # 3 of the 4 pairs ordered
    ([1.0, 3.0], [2.0, 2.0], 0.5),
])
def test_roc_auc_by_hand(positives, negatives, auc):
    assert roc_auc(positives, negatives) == auc


def _rows(tiny, faults=()):
    rows = run_timing_audit(parse_scenario(SCENARIO), tiny["tiny-llama"], faults=faults, probes=6)
    return {(r.salts, r.clock): r for r in rows}


def test_salts_close_the_channel_and_no_salt_opens_it(tiny):
    rows = _rows(tiny)
    salted, open_ = rows["per_tenant", "virtual"], rows["none", "virtual"]
    assert (salted.matching, salted.non_matching) == (6, 6)
    assert salted.auc == 0.5 and salted.cross_tenant_hit_tokens == 0  # same positions computed: all ties
    assert salted.ttft_matching_s == salted.ttft_non_matching_s
    assert open_.auc == 1.0 and open_.ttft_matching_s < open_.ttft_non_matching_s
    assert open_.cross_tenant_hit_tokens >= 6 * 64  # each matching probe reuses public prompt + secret
    assert 0.0 <= rows["none", "wall"].auc <= 1.0


def test_unsalted_prefix_reopens_it_despite_salts(tiny):
    rows = _rows(tiny, faults=("unsalted_prefix",))
    assert rows["per_tenant", "virtual"].auc == 1.0
    assert rows["per_tenant", "virtual"].cross_tenant_hit_tokens > 0


def test_cli_exit_codes(tmp_path):
    path = tmp_path / "timing.yaml"
    path.write_text(SCENARIO)
    ok = CliRunner().invoke(app, ["audit", str(path), "--timing", "--probes", "3"])
    assert ok.exit_code == 0, ok.output
    assert "ROC AUC" in ok.output and "per-tenant salts hold" in ok.output
    leak = CliRunner().invoke(app, ["audit", str(path), "--timing", "--probes", "3", "--fault", "unsalted_prefix"])
    assert leak.exit_code == 1
    bad = CliRunner().invoke(app, ["audit", str(path), "--timing", "--fault", "stale_slot"])
    assert bad.exit_code == 2
