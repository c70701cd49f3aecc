"""`kvtui bench --part transcribe`: every system's transcripts are checked against each other (kvtui's
one-at-a-time and batched runs against transformers' generate on a separate instance, token for token),
the figures are counted right, and the part is registered with the CLI."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from rich.console import Console

from kvtui.bench import PARTS, transcribe
from kvtui.models import load_model


def test_tiny_whisper_systems_agree_and_figures_add_up():
    loaded = load_model("tiny-whisper", progress=False)
    result = transcribe.run(loaded, name="tiny-whisper", quick=True, console=Console(quiet=True))
    rows = {r["system"]: r for r in result["rows"]}
    assert list(rows) == ["kvtui_sequential", "kvtui_batched", "transformers_generate"]  # no ctranslate2 model
    assert result["clips"] == 8 and not result["ctranslate2"]
    for r in rows.values():
        assert r["same_as_sequential"] == 8, r["system"]  # generate on a separate instance: the same tokens
        assert r["seconds"]["n"] == 3 and r["seconds"]["min"] <= r["seconds"]["median"] <= r["seconds"]["max"]
        assert r["clips_per_s"] == pytest.approx(8 / r["seconds"]["median"])
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"]["median"])
    table = transcribe.markdown(result)
    assert re.match(r"\| kvtui, batched \| [\d.]+ \([\d.]+-[\d.]+\) \| [\d.]+ \| [\d.]+ \| 8/8 \|", table[5])
    assert table[-1].startswith("| ctranslate2 | not installed")


def test_the_part_is_registered():
    assert "transcribe" in PARTS
    out = subprocess.run([sys.executable, "-m", "kvtui.cli", "bench", "--part", "nonsense"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2 and "transcribe" in out.stderr


@pytest.mark.whisper
def test_whisper_tiny_en_against_ctranslate2(whisper_en):
    pytest.importorskip("ctranslate2")
    result = transcribe.run(whisper_en, name="whisper-tiny.en", quick=True, console=Console(quiet=True),
                            repeats=1, warmup=False)  # the tokens are checked, not the timing: one round
    rows = {r["system"]: r for r in result["rows"]}
    assert set(rows) == set(transcribe.SYSTEMS)
    assert all(r["same_as_sequential"] == 8 for r in rows.values())  # ctranslate2 and generate: kvtui's tokens
    assert "silver rabbit 19" in result["transcripts"]["silver-rabbit-19.wav"].lower()
