"""Speech scenarios: the spoken_passphrase and audio prompt kinds, the canary on transcripts, the
command line's one-line refusals, and scenarios/transcribe.yaml on Whisper tiny.en (`whisper`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtui.cli import app
from kvtui.detect.canary import CanaryDetector
from kvtui.models import load_tokenizer
from kvtui.scenario import parse_scenario, plan_requests
from kvtui.scenario.errors import ScenarioError

ROOT = Path(__file__).resolve().parents[2]
AUDIO = ROOT / "scenarios" / "audio"


def _write(tmp_path: Path, prompts: str, model: str = "tiny-whisper", extra: str = "") -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(f"name: s\nseed: 1\nmax_requests: 5\nmodel: {model}\nengine: {{slots: 2, max_len: 64}}\n"
                    f"arrivals: {{process: constant, rate_per_s: 20.0}}\nprompts: {prompts}\n"
                    f"output_tokens: {{dist: fixed, value: 12}}\nsampling: greedy\n{extra}")
    return path


def test_spoken_passphrase_plans_clips_in_turn_with_their_passphrases():
    spec = parse_scenario(f"max_requests: 10\nmodel: tiny-whisper\nengine: {{max_len: 64}}\nprompts: {{kind: spoken_passphrase, clips: {AUDIO}}}")
    planned = plan_requests(spec, load_tokenizer("tiny-whisper"))
    assert [p.passphrase for p in planned[:3]] == ["AMBER-LANTERN-23", "COBALT-RIVER-74", "COPPER-FALCON-67"]
    assert planned[8].audio_label == "amber-lantern-23.wav" and planned[8].canary.spoken is True
    assert {tuple(p.prompt_ids) for p in planned} == {(257, 260)}
    assert planned[0].input.path == str(AUDIO / "amber-lantern-23.wav")


def test_audio_kind_takes_one_file(tmp_path):
    spec = parse_scenario(f"max_requests: 3\nmodel: tiny-whisper\nengine: {{max_len: 64}}\nprompts: {{kind: audio, path: {AUDIO / 'purple-tiger-58.wav'}}}")
    planned = plan_requests(spec, load_tokenizer("tiny-whisper"))
    assert [p.audio_label for p in planned] == ["purple-tiger-58.wav"] * 3
    assert all(p.canary is None for p in planned)


@pytest.mark.parametrize("prompts,message", [
    ("{kind: spoken_passphrase, clips: nowhere}", "prompts.clips: audio path nowhere not found"),
    ("{kind: audio, path: bad.wav}", "prompts.path: audio file"),
])
def test_bad_audio_is_one_line_naming_the_field(tmp_path, prompts, message):
    (tmp_path / "bad.wav").write_bytes(b"not a wav")
    with pytest.raises(ScenarioError) as err:
        parse_scenario(f"prompts: {prompts}", base_dir=tmp_path)
    assert len(err.value.errors) == 1 and message in err.value.errors[0], err.value.errors


@pytest.mark.parametrize("prompts,model,line", [
    ("{kind: synthetic, prompt_tokens: 8}", "tiny-whisper",
     "model tiny-whisper is a speech model (Whisper) and takes audio; use prompts kind spoken_passphrase or audio"),
    (f"{{kind: spoken_passphrase, clips: {AUDIO}}}", "tiny-llama",
     "prompts kind spoken_passphrase is audio, and model tiny-llama is not a speech model; use --model whisper-tiny.en"),
])
def test_prompts_and_model_that_do_not_go_together_are_one_line_exit_2(tmp_path, prompts, model, line):
    path = _write(tmp_path, prompts, model)
    result = CliRunner().invoke(app, ["run", str(path), "--headless"])
    assert result.exit_code == 2, result.output
    (err,) = result.stderr.splitlines()
    assert line in err, err


def test_tiny_whisper_scenario_runs_headless_with_encoder_fields_recorded(tmp_path):
    path = _write(tmp_path, f"{{kind: spoken_passphrase, clips: {AUDIO}}}", extra="expect: {contamination: none}\n")
    record = tmp_path / "run.jsonl"
    result = CliRunner().invoke(app, ["run", str(path), "--headless", "--record", str(record), "--quiet"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in record.read_text().splitlines()]
    steps = [x for x in lines if x["type"] == "step"]
    assert steps[-1]["encoder_misses"] == 5 and steps[-1]["encoder_entries"] == 5
    assert max(s["encoder_referenced"] for s in steps) == 2  # two slots
    finishes = [x for x in lines if x["type"] == "request.finish"]
    assert [f["passphrase"] for f in finishes][:2] == ["AMBER-LANTERN-23", "COBALT-RIVER-74"]
    summary = lines[-1]
    assert summary["type"] == "summary" and summary["reference_checked"] == 5
    assert [x for x in lines if x["type"] == "contamination"] == []


def test_canary_finds_a_spoken_passphrase_in_another_transcript():
    canary = CanaryDetector()
    canary.on_arrive("a", "SILVER-RABBIT-19", spoken=True)
    canary.on_arrive("b", "COPPER-FALCON-67", spoken=True)
    assert canary.on_finish("b", " The past race is Copper Falcon sixty-seven.", 1.0, 3) == []
    assert canary.on_finish("a", " The past phrase is golden rabbit 19.", 1.0, 3) == []  # its own
    (event,) = canary.on_finish("b", " The past race is silver rabbit nineteen.", 1.0, 4)
    assert (event.victim, event.source, event.evidence.matched) == ("b", "a", "SILVER-RABBIT-19")
    canary.on_arrive("c", "AMBER-LANTERN-23", spoken=True)
    assert canary.on_finish("c", "amber lantern", 1.0, 5) == []  # its own words
    assert canary.on_finish("c", "The falcon", 1.0, 5) == []  # one part of another's: not enough
    (event,) = canary.on_finish("c", "falcon 67", 1.0, 6)
    assert (event.source, event.evidence.matched) == ("b", "FALCON-67")


@pytest.mark.whisper
def test_transcribe_scenario_every_clip_its_own_zero_findings(whisper_en, tmp_path):
    record = tmp_path / "t.jsonl"
    result = CliRunner().invoke(app, ["run", str(ROOT / "scenarios" / "transcribe.yaml"), "--headless",
                                      "--record", str(record), "--quiet"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in record.read_text().splitlines()]
    finishes = [x for x in lines if x["type"] == "request.finish"]
    assert len(finishes) == 12 and all(f["passphrase_echoed"] for f in finishes)
    summary = lines[-1]
    assert (summary["reference_checked"], summary["kvtui:passphrase_echoed"]) == (12, 12)
    assert [x for x in lines if x["type"] == "contamination"] == []
    assert [x for x in lines if x["type"] == "step"][-1]["encoder_hits"] == 4  # 12 requests, 8 clips


def test_dashboard_shows_the_encoder_cache_and_each_slots_clip(tmp_path):
    from kvtui.models import load_model
    from kvtui.session import Session
    from kvtui.tui import panels
    from kvtui.tui.snapshot_build import build_snapshot
    from kvtui.tui.state import DashboardState

    spec = parse_scenario(_write(tmp_path, f"{{kind: spoken_passphrase, clips: {AUDIO}}}").read_text())
    state = DashboardState()
    seen = []

    def listen(event):
        state.apply(event)
        if getattr(event, "type", "") == "step" and state.slot_owner:
            seen.append(build_snapshot(state))

    Session(spec, load_model("tiny-whisper", progress=False), clock="virtual", listeners=(listen,)).run()
    snap = next(s for s in seen if s.encoder.referenced == 2)  # both slots held
    assert (snap.encoder.entries, snap.encoder.capacity, snap.encoder.referenced) == (2, 16, 2)
    assert [s.audio for s in snap.slots] == ["amber-lantern-23.wav", "cobalt-river-74.wav"]
    line = panels.encoder_line(snap).plain
    assert line == f"encoder cache 2/16 entries · 2 held · hits 0/2 (0%) · {snap.encoder.nbytes / 1e6:.1f} MB"
    assert snap.encoder.nbytes == 2 * 2 * 2 * 4 * 1500 * 16 * 4
    assert "amber-lantern-23" in panels._slot_cell(snap.slots[0], 60).plain


@pytest.mark.parametrize("prompts,model,fault,kind", [
    (f"{{kind: spoken_passphrase, clips: {AUDIO}}}", "tiny-whisper", "racy_threads", "encoder-decoder"),
    ("{kind: synthetic, prompt_tokens: 8}", "tiny-llama", "stale_cross_kv", "decoder-only"),
])
def test_a_fault_for_the_other_kind_of_model_is_one_line_exit_2(tmp_path, prompts, model, fault, kind):
    path = _write(tmp_path, prompts, model, extra=f"timeline: [{{at_s: 0.1, set: {{fault: {fault}, on: true}}}}]\n")
    result = CliRunner().invoke(app, ["run", str(path), "--headless"])
    assert result.exit_code == 2, result.output
    (err,) = result.stderr.splitlines()
    assert f"fault {fault} does not act on {kind} models like {model}" in err, err
