"""Bad input never crashes: a KV pool larger than the machine, huge prompt files, YAML 1.1's '1e3',
timeline events after the arrivals end, control characters and rich markup in names. Each gives one
line and exit 2 (or a warning line), never a traceback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from kvtui.cli import app
from kvtui.engine import kv_pool
from kvtui.engine.kv_pool import KVPool
from kvtui.memory import available_memory_bytes
from kvtui.models import load_model
from kvtui.scenario import ScenarioError, load_scenario, parse_scenario
from kvtui.scenario.base import MAX_PROMPT_CHARS
from kvtui.scenario.prompts import MAX_PROMPT_FILE_BYTES


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def write(tmp_path: Path, text: str, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- KV pool size --------------------------------------------------------------------------------------

def test_available_memory_reads_meminfo(tmp_path: Path):
    meminfo = write(tmp_path, "MemTotal:       24576000 kB\nMemAvailable:    1234567 kB\n", "meminfo")
    assert available_memory_bytes(str(meminfo)) == 1234567 * 1024
    fallback = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert available_memory_bytes(str(tmp_path / "missing")) == pytest.approx(fallback, rel=0.2)


@pytest.mark.parametrize("engine,path,fix", [
    ("{slots: 4096, max_len: 1000000}", "engine", "lower engine.slots or engine.max_len"),
    ("{kv_budget_bytes: 1125899906842624}", "engine.kv_budget_bytes", "lower engine.kv_budget_bytes"),
])
def test_validate_refuses_a_pool_larger_than_memory(tmp_path: Path, engine, path, fix):
    scenario = write(tmp_path, f"max_requests: 2\nmodel: tiny-llama\nengine: {engine}\n")
    result = invoke("validate", str(scenario))
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: {scenario}:3: {path}: KV pool of ") and line.endswith(f"; {fix}"), line
    assert "of memory available" in line and "tiny-llama (float32)" in line


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_pool_size_follows_the_model_geometry_and_dtype(dtype):
    # bytes per cached token from transformers' own cache of the same model: K and V of every layer
    model = load_model("tiny-llama", dtype=dtype, progress=False).model
    cache = model(input_ids=torch.tensor([[5, 6]]), use_cache=True)
    per_token = sum(layer.keys[0, :, 0].numel() * layer.keys.element_size() * 2 for layer in cache.past_key_values.layers)
    need = 4096 * 1_000_000 * (per_token + 8)  # + the pool's int64 writer tag per position
    with pytest.raises(ScenarioError) as info:
        parse_scenario(f"max_requests: 2\nmodel: tiny-llama\ndtype: {dtype}\n"
                       "engine: {slots: 4096, max_len: 1000000}\n", source="s.yaml")
    assert f"needs {need / 2**30:.1f} GiB for tiny-llama ({dtype})" in info.value.errors[0]


def test_budget_that_holds_no_slot_is_refused_at_validation():
    # the default model (SmolLM2-135M): 30 layers x 3 KV heads x 64 dims x 2 (K, V) x 4 bytes x 512 tokens
    with pytest.raises(ScenarioError) as info:
        parse_scenario("max_requests: 2\nengine: {kv_budget_bytes: 1000000}\n", source="s.yaml")
    assert info.value.errors == [
        (f"s.yaml:2: engine.kv_budget_bytes: kv_budget_bytes 1000000 holds no slot: one slot of max_len 512 needs "
        f"{30 * 3 * 64 * 2 * 4 * 512} bytes for SmolLM2-135M-Instruct (float32); raise engine.kv_budget_bytes or "
        "lower engine.max_len")]


def test_kv_pool_refuses_before_allocating():
    with pytest.raises(ValueError) as info:
        KVPool(num_layers=2, num_kv_heads=2, head_dim=16, num_slots=4096, max_len=1_000_000, dtype=torch.float32)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("KV pool of 4096 slots x 1000000 tokens needs ")
    assert msg.endswith("of cpu memory available; lower engine.slots or engine.max_len")


def test_kv_pool_allocation_failure_is_one_line(monkeypatch):
    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    monkeypatch.setattr(kv_pool.torch, "zeros", no_memory)
    with pytest.raises(ValueError) as info:
        KVPool(num_layers=2, num_kv_heads=2, head_dim=16, num_slots=2, max_len=64, dtype=torch.float32,
               kv_budget_bytes=10**6)
    assert str(info.value) == ("KV pool of 30 slots x 64 tokens (975.0 KiB) could not be allocated (CUDA out of "
                               "memory. Tried to allocate 2.00 GiB); lower engine.kv_budget_bytes")


def test_run_turns_a_pool_that_does_not_fit_into_one_line(tmp_path: Path, monkeypatch):
    scenario = write(tmp_path, "max_requests: 2\nmodel: tiny-llama\nengine: {slots: 4, max_len: 256}\n")
    monkeypatch.setattr(kv_pool, "available_memory_bytes", lambda: 1 << 18)  # the engine's view only
    result = invoke("run", str(scenario), "--headless")
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        (f"error: {scenario}: KV pool of 4 slots x 256 tokens needs 520.0 KiB, more than the 256.0 KiB of cpu memory "
        "available; lower engine.slots or engine.max_len")]


# -- prompt files ---------------------------------------------------------------------------------------

def test_one_huge_prompt_line_is_refused_at_validation(tmp_path: Path):
    (tmp_path / "big.txt").write_text("short prompt\n" + "x" * 10_000_000 + "\n")
    scenario = write(tmp_path, "max_requests: 2\nmodel: tiny-llama\nprompts: {kind: file, path: big.txt}\n")
    with pytest.raises(ScenarioError) as info:
        load_scenario(scenario)
    assert info.value.errors == [
        (f"{scenario}:3: prompts.path: big.txt line 2: prompt of 10000000 characters, over the {MAX_PROMPT_CHARS} "
        "character limit; shorten or split it (for long inputs of a given length use `kind: synthetic` with "
        "prompt_tokens)")]


def test_huge_chat_prompt_in_jsonl_is_refused(tmp_path: Path):
    content = "y" * (MAX_PROMPT_CHARS // 2 + 1)
    line = '{"messages": [{"role": "system", "content": "%s"}, {"role": "user", "content": "%s"}]}' % (content, content)
    (tmp_path / "p.jsonl").write_text('"hello"\n' + line + "\n")
    with pytest.raises(ScenarioError, match=r"p.jsonl line 2: prompt of 100002 characters, over the 100000"):
        parse_scenario("max_requests: 2\nprompts: {kind: file, path: p.jsonl}\n", base_dir=tmp_path)


def test_prompt_file_over_the_size_limit_names_its_size(tmp_path: Path):
    with open(tmp_path / "huge.txt", "wb") as f:  # sparse: no disk used
        f.truncate(MAX_PROMPT_FILE_BYTES + 1)
    with pytest.raises(ScenarioError) as info:
        parse_scenario("max_requests: 2\nprompts: {kind: file, path: huge.txt}\n", source="s.yaml", base_dir=tmp_path)
    assert info.value.errors == [
        (f"s.yaml:2: prompts.path: prompt file huge.txt is {MAX_PROMPT_FILE_BYTES + 1} bytes, over the "
        f"{MAX_PROMPT_FILE_BYTES} byte (16 MiB) limit; use a smaller file")]


# -- YAML 1.1 numbers -----------------------------------------------------------------------------------

@pytest.mark.parametrize("written,read,fixes", [
    ("1e3", "'1e3'", ["1000", "1.0e+3"]),
    ("2.5e2", "'2.5e2'", ["250", "2.5e+2"]),
    ("5E-1", "'5E-1'", ["0.5", "5.0e-1"]),
])
def test_exponent_without_dot_and_sign_says_why_and_how(written, read, fixes):
    assert isinstance(yaml.safe_load(f"x: {written}")["x"], str)  # the reason: PyYAML (YAML 1.1) reads text
    with pytest.raises(ScenarioError) as info:
        parse_scenario(f"max_requests: 2\narrivals: {{process: poisson, rate_per_s: {written}}}\n", source="s.yaml")
    (line,) = info.value.errors
    assert line == (f"s.yaml:2: arrivals.rate_per_s: expected a number, got {read} (text: YAML 1.1 reads an "
                    f"exponent without a dot and a sign as text); write {' or '.join(fixes)}")
    for fix in fixes:  # both suggestions really are numbers to YAML and pass
        spec = parse_scenario(f"max_requests: 2\narrivals: {{process: poisson, rate_per_s: {fix}}}\n")
        assert spec.arrivals.rate_per_s == float(written)


def test_exponent_in_a_whole_number_field_and_a_timeline_knob():
    with pytest.raises(ScenarioError) as info:
        parse_scenario("max_requests: 1e3\n", source="s.yaml")
    assert info.value.errors[0].endswith("YAML 1.1 reads an exponent without a dot and a sign as text); write 1000")
    with pytest.raises(ScenarioError, match=r"timeline.0.set.arrivals.rate_per_s: .*'2e1'.*write 20 or 2.0e\+1"):
        parse_scenario("max_requests: 2\narrivals: {process: poisson, rate_per_s: 1.0}\n"
                       "timeline: [{at_s: 1, set: {arrivals.rate_per_s: 2e1}}]\n", source="s.yaml")


# -- timeline after the end -----------------------------------------------------------------------------

def test_timeline_event_after_duration_warns(tmp_path: Path):
    scenario = write(tmp_path, "duration_s: 5\nmodel: tiny-llama\narrivals: {process: constant, rate_per_s: 1.0}\n"
                               "timeline:\n  - {at_s: 10, marker: late}\n  - {at_s: 2, marker: fine}\n"
                               "output_tokens: 2\n")
    assert load_scenario(scenario).warnings == [
        (f"{scenario}:5: timeline.0.at_s: at 10 s, after duration_s (5 s): it applies only if requests are still "
        "running then, else never; move it earlier or raise duration_s")]
    result = invoke("validate", str(scenario))
    assert result.exit_code == 0
    assert result.stderr.splitlines() == ["warning: " + load_scenario(scenario).warnings[0]]
    assert "marker: late" in result.stdout
    run = invoke("run", str(scenario), "--headless", "--detectors", "none")
    assert run.exit_code == 0, run.output
    assert run.stderr.splitlines() == result.stderr.splitlines() + [
        "warning: 1 timeline event(s) came after the run's end and were not applied (first at 10 s)"]


def test_timeline_event_after_the_last_arrival_warns():
    spec = parse_scenario("max_requests: 3\narrivals: {process: constant, rate_per_s: 2.0}\n"
                          "timeline:\n  - {at_s: 0.9, marker: fine}\n  - {at_s: 1.5, set: {max_batch_size: 2}}\n",
                          source="s.yaml")
    assert spec.warnings == [
        ("s.yaml:5: timeline.1.at_s: at 1.5 s, after the last planned arrival (1.00 s): it applies only if requests "
        "are still running then, else never; move it earlier or let arrivals run longer")]
    assert parse_scenario("max_requests: 3\narrivals: {process: constant, rate_per_s: 2.0}\n"
                          "timeline: [{at_s: 1.0, marker: at the last arrival}]\n").warnings == []


# -- names with control characters and markup -----------------------------------------------------------

def test_control_characters_and_markup_in_names_are_shown_escaped(tmp_path: Path):
    scenario = write(tmp_path, 'name: "evil\\x1b[31m[/]\\x07 [bold]name"\nmax_requests: 2\nmodel: tiny-llama\n'
                               "output_tokens: 2\narrivals: {process: constant, rate_per_s: 10.0}\n")
    result = invoke("run", str(scenario), "--headless", "--detectors", "none")
    assert result.exit_code == 0, result.output
    title = result.stdout.splitlines()[0]
    assert title.startswith("evil\\x1b[31m[/]\\x07 [bold]name on tiny-llama"), title
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout


def test_control_characters_in_a_prompt_file_name_are_escaped_in_errors(tmp_path: Path):
    scenario = write(tmp_path, 'max_requests: 2\nprompts: {kind: file, path: "p\\x07[/x].txt"}\n')
    result = invoke("validate", str(scenario))
    assert result.exit_code == 2
    (line,) = result.stderr.splitlines()
    assert "prompt file p\\x07[/x].txt not found" in line and "\x07" not in line
