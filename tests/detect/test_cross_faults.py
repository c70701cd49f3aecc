"""The cross-attention faults on tiny-whisper (the fault x detector truth table of encoder-decoder
models): every detector the catalogue lists fires (the canary needs real transcripts: the `whisper`
test on Whisper tiny.en), each report names a victim and a source that ran, and the same loads with
the fault off stay silent."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtui.faults import FAULTS
from kvtui.model_kinds import ModelKind
from kvtui.models import load_model
from kvtui.scenario import load_scenario, parse_scenario
from kvtui.session import Session

ROOT = Path(__file__).resolve().parents[2]
AUDIO = ROOT / "scenarios" / "audio"
TEXT_DETECTORS = {"canary"}
CROSS = [name for name, fault in FAULTS.items() if fault.models == (ModelKind.ENCODER_DECODER,)]
# loads that make each fault act: slots reused (stale_cross_kv), rows leaving at different times
# (cross_row_misalign), several requests with the same decoder prompt (encoder_cache_unkeyed), and a
# shared initial prompt longer than a few blocks under prefix caching (cross_kv_prefix_cached)
LOADS = {
    "stale_cross_kv": ("slots: 2", 6, ""),
    "cross_row_misalign": ("slots: 3", 8, ""),
    "encoder_cache_unkeyed": ("slots: 3", 6, ""),
    "cross_kv_prefix_cached": ("block_size: 4, prefix_caching: true", 6, "Passphrases are read here."),
}
CASES = [(name, layout, kv) for name in CROSS for layout in FAULTS[name].layouts for kv in FAULTS[name].kv]


def _spec(name: str, layout: str, kv: str, fault: bool = True):
    pool, requests, prompt = LOADS[name]
    return parse_scenario(f"""name: cross-truth-table
seed: 0
max_requests: {requests}
model: tiny-whisper
engine: {{{pool}, kv: {kv}, max_len: 64, layout: {layout}, faults: [{name if fault else ""}]}}
arrivals: {{process: constant, rate_per_s: 8.0}}
prompts: {{kind: spoken_passphrase, clips: {AUDIO}, initial_prompt: "{prompt}"}}
output_tokens: {{dist: uniform, min: 3, max: 16}}
sampling: {{ignore_eos: true}}
""")


@pytest.fixture(scope="module")
def tiny_whisper_model():
    return load_model("tiny-whisper", progress=False)


def _run(loaded, spec) -> Session:
    session = Session(spec, loaded, clock="virtual")
    session.run()
    return session


@pytest.mark.parametrize("name,layout,kv", CASES)
def test_every_listed_detector_catches_the_cross_fault_naming_victim_and_source(tiny_whisper_model, name, layout, kv):
    spec = _spec(name, layout, kv)
    session = _run(tiny_whisper_model, spec)
    ran = {f"r{i:03d}" for i in range(spec.max_requests)}
    counted = [e for e in session.contamination if e.counts]
    assert set(FAULTS[name].caught_by) - TEXT_DETECTORS <= {e.detector for e in counted}, session.contamination
    assert {e.kind for e in counted} == {"cross_request"}
    assert {e.victim for e in counted} <= ran
    named = [e for e in counted if e.detector in ("slot_taint", "prefix_provenance")]
    assert named and all(e.source in ran and e.source != e.victim for e in named)
    assert session.summary.fault_acts[name] > 0  # fault.acted events where it acted


@pytest.mark.parametrize("name", CROSS)
def test_the_same_load_without_the_fault_is_silent(tiny_whisper_model, name):
    fault = FAULTS[name]
    session = _run(tiny_whisper_model, _spec(name, fault.layouts[0], fault.kv[-1], fault=False))
    assert session.contamination == [] and session.observer("reference").checked == LOADS[name][1]


def test_encoder_cache_hit_on_other_audio_names_both_audio_hashes(tiny_whisper_model):
    session = _run(tiny_whisper_model, _spec("encoder_cache_unkeyed", "padded", "slots"))
    (first, *_) = [e for e in session.contamination if e.detector == "prefix_provenance"]
    assert first.source == "r000" and first.evidence.audio_hash != first.evidence.source_audio_hash
    assert first.evidence.blocks == () and len(first.evidence.audio_hash) == 12


@pytest.mark.parametrize("name", CROSS)
def test_the_fault_scenarios_load_and_name_their_fault(name):
    spec = load_scenario(ROOT / "scenarios" / "faults" / f"{name}.yaml")
    assert spec.model == "whisper-tiny.en" and name in spec.engine.faults
    assert spec.expect.contamination == "detected"


@pytest.mark.whisper
@pytest.mark.parametrize("name", [n for n in CROSS if TEXT_DETECTORS & set(FAULTS[n].caught_by)])
def test_canary_catches_the_cross_fault_on_whisper_tiny_en(whisper_en, name):
    """The canary column: on Whisper tiny.en a victim's transcript says another clip's passphrase."""
    spec = load_scenario(ROOT / "scenarios" / "faults" / f"{name}.yaml")
    session = _run(whisper_en, spec)
    canary = [e for e in session.contamination if e.detector == "canary" and e.counts]
    assert canary, session.contamination
    ran = {f"r{i:03d}" for i in range(spec.max_requests)}
    assert all(e.victim in ran and e.source in ran and e.source != e.victim for e in canary)
