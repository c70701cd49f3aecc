"""The ready scenarios in scenarios/: each validates, opens with a comment saying what it shows and
what to watch, plans within budget, and normalizes to a stable, round-tripping form."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from test_scenario_plan import FakeTokenizer

from kvtui.config import EngineConfig
from kvtui.models import load_tokenizer
from kvtui.scenario import load_scenario, parse_scenario, plan_requests
from kvtui.scenario.prompts import AUDIO_KINDS, IMAGE_KINDS

SCENARIOS = sorted((Path(__file__).parents[2] / "scenarios").glob("*.yaml"))
IDS = [p.stem for p in SCENARIOS]


def test_library_is_complete():
    assert {"passphrase", "steady", "bursty", "long_tail", "bucketing_on", "bucketing_off", "reuse",
            "reallocate", "overload", "ramp", "trace"} <= set(IDS)


@pytest.mark.parametrize("path", SCENARIOS, ids=IDS)
def test_scenario_validates_and_plans(path: Path):
    text = path.read_text()
    assert text.startswith("# ") and "Watch:" in text.split("\nname:")[0], "opening comment with 'Watch:'"
    s = load_scenario(path)
    assert s.name == path.stem
    assert isinstance(s.engine_config(device="cpu"), EngineConfig)
    speech = s.prompts.kind in AUDIO_KINDS  # planned with a Whisper tokenizer (the decoder prompt's two ids)
    images = s.prompts.kind in IMAGE_KINDS  # planned with a chat template (the picture's place in the chat)
    tokenizer = load_tokenizer("tiny-whisper") if speech else load_tokenizer("tiny-vision") if images else None
    reqs = plan_requests(s, tokenizer or FakeTokenizer())
    assert 1 <= len(reqs) <= 80
    # small enough for SmolLM2 on 2 cores: a few thousand generated tokens at most
    assert sum(r.sampling.max_new_tokens for r in reqs) <= 3000
    again = parse_scenario(yaml.safe_dump(s.normalized()), source=str(path), base_dir=path.parent)
    assert again.normalized() == s.normalized() and again.content_hash() == s.content_hash()


def test_pairs_plan_identical_requests():
    tok = FakeTokenizer()
    by_name = {p.stem: load_scenario(p) for p in SCENARIOS}
    for a, b, field in [("bucketing_off", "bucketing_on", "bucketing"), ("reuse", "reallocate", "slot_reuse")]:
        sa, sb = by_name[a], by_name[b]
        assert plan_requests(sa, tok) == plan_requests(sb, tok)
        diff = {f.name for f in dataclasses.fields(EngineConfig)
                if getattr(sa.engine_config(), f.name) != getattr(sb.engine_config(), f.name)}
        assert diff == {field}


def test_passphrase_demo_shape():
    s = load_scenario(Path(__file__).parents[2] / "scenarios" / "passphrase.yaml")
    cfg = s.engine_config()
    assert (s.seed, s.max_requests, s.model, cfg.num_slots) == (0, 8, "default", 4)
    assert s.arrivals.process == "poisson" and s.arrivals.rate_per_s == 2.0
    assert s.sampling.temperature == 0.0 and s.output_tokens.value == 24
    assert s.expect.contamination == "none"


def test_content_hash_changes_with_content():
    a = parse_scenario("max_requests: 4")
    assert a.content_hash() == parse_scenario("max_requests: 4  # same").content_hash()
    assert a.content_hash() != parse_scenario("max_requests: 5").content_hash()
    assert len(a.content_hash()) == 64


def test_engine_config_mapping_and_overrides():
    s = parse_scenario("max_requests: 2\nengine: {slots: 3, max_len: 64, max_batch_size: 2, max_tokens_per_step: 99,"
                       " layout: packed, padding_side: left, bucketing: {enabled: true, tolerance: 0.5},"
                       " slot_reuse: reallocate, on_too_long: cap, max_waiting: 7, faults: [stale_slot]}")
    assert s.engine_config(device="cuda") == EngineConfig(
        num_slots=3, max_len=64, max_batch_size=2, max_tokens_per_step=99, layout="packed", padding_side="left",
        bucketing=True, bucket_tolerance=0.5, slot_reuse="reallocate", on_too_long="cap", max_waiting=7,
        device="cuda", faults=frozenset({"stale_slot"}))
    budget = parse_scenario("max_requests: 2\nmodel: tiny-llama\nengine: {kv_budget_bytes: 1000000, bucketing: true}")
    assert budget.engine_config().kv_budget_bytes == 1_000_000 and budget.engine.slots is None
    assert budget.engine_config().bucketing is True


def test_timeline_helpers():
    s = parse_scenario("max_requests: 2\ntimeline:\n"
                       "  - {at_s: 3, set: {max_batch_size: 2, bucketing.enabled: true, engine.layout: packed}}\n"
                       "  - {at_s: 4, set: {fault: stale_slot, on: true}, marker: break it}\n"
                       "  - {at_s: 5, set: {fault: stale_slot, on: false}}\n"
                       "  - {at_s: 6, set: {arrivals.rate_per_s: 3}}\n")
    e0, e1, e2, e3 = s.timeline
    assert e0.engine_overrides() == {"max_batch_size": 2, "bucketing": True, "layout": "packed"}
    assert dataclasses.replace(s.engine_config(), **e0.engine_overrides()).layout == "packed"
    assert e1.fault_switch == ("stale_slot", True) and e2.fault_switch == ("stale_slot", False)
    assert e1.marker == "break it" and e1.engine_overrides() == {}
    assert e3.arrival_changes() == {"rate_per_s": 3.0} and e3.fault_switch is None
    assert s.normalized()["timeline"][0]["set"] == {"engine.max_batch_size": 2, "engine.bucketing.enabled": True,
                                                    "engine.layout": "packed"}


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[2] / "scenarios").rglob("*.yaml")),
                         ids=lambda p: p.stem)
def test_scenario_has_no_warnings(path: Path):
    """Every timeline event of a ready scenario falls while its arrivals run (ramp's markers once sat at 6 and
    12 s on stages of 4 s, so the second never showed)."""
    assert load_scenario(path).warnings == []
