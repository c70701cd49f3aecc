"""Numeric labelling true on the machine it runs on (kvtui/detect/tolerance.py): the tolerance is measured
(batched against solo logits on this CPU, model, dtype, torch and threads), stored beside the step-cost
calibration and read back; logits a row's processing masked in both runs stay comparable.

Only what holds on every CPU is asserted: a positive finite spread, where it is stored, what a run names."""

from __future__ import annotations

import math
import re

import pytest
import torch
from helpers import make_engine

from kvtui.detect import tolerance
from kvtui.detect.reference import ReferenceDetector, compare_draws, sampled_flip_is_numeric
from kvtui.engine import SamplingParams
from kvtui.engine.sampling import draw_token, make_generator


@pytest.fixture(scope="module")
def tiny_bf16():
    from kvtui.models import load_model

    return load_model("tiny-llama", dtype="bfloat16", progress=False)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTUI_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tolerance, "_MEASURED", {})
    return tmp_path


# -- processed logits: masked in both runs, left out ------------------------------------------------------

def masked_draw(allowed: dict[int, float], seed: int = 4):
    """The Draw of a token drawn from [64] logits where only `allowed` (token -> logit) is not masked (a grammar
    allowing three tokens: the Draw lists masked ones among its top 8, as NaN)."""
    logits = torch.full((64,), -torch.inf)
    for token, z in allowed.items():
        logits[token] = z
    params = SamplingParams(temperature=1.0, seed=seed)
    return draw_token(logits, params, make_generator(params))[1]


def test_tokens_masked_in_both_runs_are_left_out_of_the_spread():
    batched = masked_draw({5: 1.0, 9: 0.5, 12: 0.0})
    solo = masked_draw({5: 1.02, 9: 0.5, 12: 0.01})
    assert any(math.isnan(z) for z in batched.logits) and any(math.isnan(z) for z in solo.logits)
    shift, spread = compare_draws(batched, solo)
    assert spread == pytest.approx(0.02, abs=1e-6)
    assert sampled_flip_is_numeric(batched, solo, 1.0, 0.5)


def test_a_token_masked_in_one_run_only_is_not_comparable():
    batched = masked_draw({5: 1.0, 9: 0.5, 12: 0.0})
    solo = masked_draw({5: 1.0, 9: 0.5})  # 12 masked here, allowed there: another grammar state
    assert compare_draws(batched, solo)[1] == math.inf
    assert not sampled_flip_is_numeric(batched, solo, 1.0, 0.5)


def test_a_constrained_rows_draws_keep_the_processed_logits_in_both_runs(tiny_bf16):
    """A choice grammar on tiny-llama in bfloat16, batched with two plain requests and alone: both runs' Draws
    hold the logits after the grammar bitmask (masked tokens NaN in both), so their spread is finite."""
    pytest.importorskip("xgrammar")
    from kvtui.engine.request import StructuredOutputs

    sampling = SamplingParams(temperature=1.0, seed=2, max_new_tokens=6, ignore_eos=True,
                              structured=StructuredOutputs(choice=("yes", "no", "maybe")))
    plain = SamplingParams(temperature=1.0, seed=5, max_new_tokens=6, ignore_eos=True)

    def run(neighbours: int):
        engine = make_engine(tiny_bf16.model, num_slots=3, max_len=64, grammar_tokenizer=tiny_bf16.tokenizer)
        state = engine.submit("c", [5, 6, 7, 8], sampling)
        for i in range(neighbours):
            engine.submit(f"p{i}", [9 + i] * (3 + 4 * i), plain)
        engine.run_until_done()
        return state

    batched, solo = run(2), run(0)
    assert batched.generated_ids == solo.generated_ids  # same tokens here; the Draws are what is compared
    for b, s in zip(batched.draws, solo.draws):
        assert any(math.isnan(z) for z in b.logits) and any(math.isnan(z) for z in s.logits)
        assert math.isfinite(compare_draws(b, s)[1])


# -- the calibration ---------------------------------------------------------------------------------------

def test_the_calibration_measures_a_positive_finite_spread_on_tiny_llama_in_bfloat16(tiny_bf16, cache):
    record = tolerance.measure(tiny_bf16)
    assert 0 < record["largest"] < math.inf
    assert 1 <= record["rounds"] <= tolerance.MAX_ROUNDS
    per_round = len(tolerance.PROMPTS) * tolerance.NEW_TOKENS * len(tolerance.COMPOSITIONS)
    assert 0 < record["positions"] <= record["rounds"] * per_round
    assert record["tolerance"] == max(record["largest"] * tolerance.SAFETY, tolerance.FLOAT32)
    assert set(record["by_composition"]) == set(tolerance.COMPOSITIONS)
    assert (record["model"], record["dtype"], record["cpu"]) == ("tiny-llama", "bfloat16", tolerance.cpu_name())
    assert (record["torch"], record["threads"]) == (torch.__version__, torch.get_num_threads())


def test_a_slow_measurement_stops_after_its_first_round(tiny_bf16, cache):
    """More rounds only while the time spent is under the budget: SmolLM2 in bfloat16 on a slow CPU takes one."""
    one = {"padded, batch 4": tolerance.COMPOSITIONS["padded, batch 4"]}
    record = tolerance.measure(tiny_bf16, compositions=one, budget_s=0.0)
    assert record["rounds"] == 1 and record["positions"] == len(tolerance.PROMPTS) * tolerance.NEW_TOKENS


def test_a_measurement_is_stored_and_read_back_for_its_cpu_only(tiny_bf16, cache, monkeypatch):
    lines = []
    first = tolerance.reference_tolerance(tiny_bf16, progress=lines.append)
    assert first.source == "measured" and len(lines) == 1 and "measuring bfloat16" in lines[0]
    path = first.described["file"]
    cpu_word = re.sub(r"[^A-Za-z0-9_.-]", "_", tolerance.cpu_name().split()[0])  # "Intel(R)" -> "Intel_R_"
    assert path.startswith(str(cache / "calibration")) and cpu_word in path
    again = tolerance.reference_tolerance(tiny_bf16, progress=lines.append)
    assert (again.source, again.value, len(lines)) == ("calibrated", first.value, 1)
    assert tolerance.load(tiny_bf16)[1] == path
    monkeypatch.setattr(tolerance, "cpu_name", lambda: "Another CPU 9000")
    assert tolerance.load(tiny_bf16) is None  # another CPU's rounding is not this one's


def test_float32_keeps_its_built_in_tolerance(tiny, cache):
    found = tolerance.reference_tolerance(tiny["tiny-llama"])
    assert (found.value, found.source) == (1e-3, "built-in")
    assert ReferenceDetector(tiny["tiny-llama"], tiny["tiny-llama"].tokenizer).tolerance == 1e-3


def test_the_detector_labels_with_the_stored_tolerance(tiny_bf16, cache):
    record = {**tolerance.machine_key(tiny_bf16), "tolerance": 0.123, "largest": 0.041, "safety": 3.0}
    tolerance.store(record)
    ref = ReferenceDetector(tiny_bf16, tiny_bf16.tokenizer)
    assert (ref.tolerance, ref.numeric.source) == (0.123, "calibrated")


def test_a_run_names_the_tolerance_it_labelled_with(tiny_bf16, cache):
    from rich.console import Console

    from kvtui.scenario import parse_scenario
    from kvtui.session import Session
    from kvtui.summary import print_summary

    tolerance.store({**tolerance.machine_key(tiny_bf16), "tolerance": 0.75, "largest": 0.25, "safety": 3.0})
    spec = parse_scenario("""
name: bf16
seed: 1
max_requests: 2
model: tiny-llama
dtype: bfloat16
engine: {slots: 2, max_len: 64, batch_invariant: false}
prompts: {kind: synthetic, prompt_tokens: {dist: uniform, min: 3, max: 8}}
output_tokens: 4
""")
    session = Session(spec, tiny_bf16, clock="virtual", detectors=("reference",))
    summary = session.run()
    described = session.header().reference_tolerance
    assert (described["tolerance"], described["source"], described["cpu"]) == (0.75, "calibrated",
                                                                              tolerance.cpu_name())
    console = Console(record=True, width=200)
    print_summary(summary, session.header(), console)
    assert f"numeric tolerance 0.75 logits (calibrated on {tolerance.cpu_name()})" in console.export_text()


def test_kvtui_calibrate_numeric_stores_the_measurement(tiny_bf16, cache):
    from typer.testing import CliRunner

    from kvtui.cli import app

    done = CliRunner().invoke(app, ["calibrate", "--numeric", "--model", "tiny-llama", "--dtype", "bfloat16"])
    assert done.exit_code == 0, done.output
    assert "numeric tolerance" in done.stdout and "round 1:" in done.stderr
    assert tolerance.load(tiny_bf16) is not None  # where a bfloat16 run of tiny-llama on this CPU reads it


def test_kvtui_calibrate_numeric_without_dtype_measures_bfloat16_and_float16(cache):
    """With no --dtype it measured nothing (float32, the default) and exited 0: it measures both dtypes whose
    batch rounding the reference detector needs, each stored where that dtype's runs read it."""
    from typer.testing import CliRunner

    from kvtui.cli import app
    from kvtui.models import load_model

    done = CliRunner().invoke(app, ["calibrate", "--numeric", "--model", "tiny-llama"])
    assert done.exit_code == 0, done.output
    lines = done.stdout.splitlines()
    assert [line.split(": ")[0] for line in lines] == ["bfloat16", "bfloat16", "float16", "float16"]
    assert [line.split(": ")[1].split()[:2] for line in lines] == [["numeric", "tolerance"], ["stored", "in"]] * 2
    for dtype in ("bfloat16", "float16"):
        assert tolerance.load(load_model("tiny-llama", dtype=dtype, progress=False)) is not None


def test_kvtui_calibrate_numeric_of_float32_says_what_to_pass():
    from typer.testing import CliRunner

    from kvtui.cli import app

    float32 = CliRunner().invoke(app, ["calibrate", "--numeric", "--model", "tiny-llama", "--dtype", "float32"])
    assert float32.exit_code == 2 and float32.stdout == ""
    assert float32.stderr.splitlines() == [
        "error: --dtype float32: --numeric measures the batch rounding of bfloat16 and float16; float32 keeps the "
        "built-in tolerance (0.001 logits, far above its rounding): pass --dtype bfloat16 or --dtype float16, or "
        "leave --dtype out to measure both"]
