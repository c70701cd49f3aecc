"""Malformed scenarios: each mistake gives exactly one line `file:line: field: problem; fix`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtui.scenario import ScenarioError, load_scenario, parse_scenario

OK = "max_requests: 4\n"  # a stop condition, so only the mistake under test is reported
LINE_RE = re.compile(r"^[^:]+(:\d+)?: \S+: .+; .+$")

# (id, yaml, line, field path, fragments that must appear in the line)
CASES = [
    ("typo-top", "max_request: 8\n", 1, "max_request", ["unknown field", "did you mean 'max_requests'"]),
    ("typo-engine", OK + "engine:\n  slot: 4\n", 3, "engine.slot", ["did you mean 'slots'", "max_len"]),
    ("process", OK + "arrivals: {process: poison, rate_per_s: 2}\n", 2, "arrivals.process",
     ["unknown process 'poison'", "did you mean 'poisson'", "use one of: constant, poisson"]),
    ("no-rate", OK + "arrivals:\n  process: poisson\n", 2, "arrivals", ["exactly one of rate_per_s or stages"]),
    ("neg-rate", OK + "arrivals:\n  process: poisson\n  rate_per_s: -2\n", 4, "arrivals.rate_per_s",
     ["must be > 0", "got -2"]),
    ("burstiness-0", OK + "arrivals: {process: gamma, rate_per_s: 2, burstiness: 0}\n", 2,
     "arrivals.burstiness", ["must be > 0"]),
    ("burst-missing", OK + "arrivals:\n  process: burst\n  size: 4\n", 2, "arrivals.every_s",
     ["required field is missing", "add `every_s: 1.0`"]),
    ("int-text", "max_requests: eight\n", 1, "max_requests", ["expected a whole number", "'eight'"]),
    ("seed-bool", OK + "seed: true\n", 2, "seed", ["expected a whole number"]),
    ("layout", OK + "engine:\n  max_len: 256\n  layout: pded\n", 4, "engine.layout",
     ["unknown value 'pded'", "did you mean 'padded'", "padded, packed"]),
    ("quoted-number", OK + "engine:\n  bucketing: {enabled: true, tolerance: '0.2'}\n", 3,
     "engine.bucketing.tolerance", ["expected a number", "2.0"]),
    ("min-max", OK + "output_tokens: {dist: uniform, min: 50, max: 20}\n", 2, "output_tokens.min",
     ["min (50) is above max (20)", "make min <= max"]),
    ("weights", OK + "output_tokens: {dist: choice, values: [8, 16], weights: [1]}\n", 2,
     "output_tokens.weights", ["1 weights for 2 values"]),
    ("dist-name", OK + "output_tokens: {dist: gauss, mean: 3}\n", 2, "output_tokens.dist",
     ["unknown dist 'gauss'", "normal"]),
    ("no-stop", "arrivals: {process: poisson, rate_per_s: 2}\n", 1, "arrivals",
     ["never stops", "add `max_requests: 16`"]),
    ("too-many", "duration_s: 600000\narrivals: {process: poisson, rate_per_s: 1000}\n", 1, "duration_s",
     ["requests in duration_s", "set max_requests"]),
    ("trace-missing", "arrivals:\n  process: trace\n  file: traces/nope.csv\n", 3, "arrivals.file",
     ["not found", "relative to the scenario file"]),
    ("knob", OK + "timeline:\n  - at_s: 5\n    set: {engine.max_batch: 4}\n", 4,
     "timeline.0.set.engine.max_batch", ["unknown knob", "did you mean 'engine.max_batch_size'"]),
    ("knob-value", OK + "timeline:\n  - at_s: 5\n    set:\n      max_batch_size: 0\n", 5,
     "timeline.0.set.max_batch_size", ["must be >= 1"]),
    ("fault-name", OK + "timeline:\n  - {at_s: 1, set: {fault: shared_cahce}}\n", 3,
     "timeline.0.set.fault", ["did you mean 'shared_cache'", "stale_slot"]),
    ("on-alone", OK + "timeline:\n  - {at_s: 1, set: {on: true}}\n", 3, "timeline.0.set.on",
     ["`on` without `fault`", "add `fault: <name>`"]),
    ("burstiness-knob", OK + "timeline:\n  - {at_s: 1, set: {arrivals.burstiness: 0.5}}\n", 3,
     "timeline.0.set.arrivals.burstiness", ["process gamma only"]),
    ("empty-event", OK + "timeline:\n  - at_s: 1\n", 3, "timeline.0", ["event does nothing"]),
    ("slots-budget", OK + "engine: {slots: 4, kv_budget_bytes: 1000000}\n", 2, "engine",
     ["both slots and kv_budget_bytes", "keep one"]),
    ("yaml-syntax", OK + "engine:\n  slots: [4\n", 4, "(yaml)", ["check indentation"]),
    ("duplicate", OK + "seed: 1\nseed: 2\n", 3, "seed", ["duplicate key (first on line 2)", "keep one"]),
    ("list-doc", "- max_requests: 4\n", 1, "(document)", ["expected a mapping of fields, got a list"]),
    ("model-name", OK + "model: tiny-lama\n", 2, "model", ["did you mean 'tiny-llama'", "or a path"]),
    ("model-path", OK + "model: ./models/nothing-here\n", 2, "model", ["does not exist"]),
    ("dtype", OK + "dtype: fp16\n", 2, "dtype", ["unknown value 'fp16'", "float32, bfloat16, float16"]),
    ("kind-missing", OK + "prompts: {template: 'x {passphrase}'}\n", 2, "prompts",
     ["`kind` is missing", "passphrase, synthetic, file"]),
    ("template", OK + "prompts: {kind: passphrase, template: 'say hello'}\n", 2, "prompts.template",
     ["no {passphrase}"]),
    ("top-p", OK + "sampling: {top_p: 0}\n", 2, "sampling.top_p", ["must be > 0"]),
    ("rate-and-stages", OK + "arrivals:\n  process: constant\n  rate_per_s: 1\n  stages: [{rate_per_s: 2, duration_s: 3}]\n",
     2, "arrivals", ["not both"]),
    ("inf", "duration_s: .inf\n", 1, "duration_s", ["finite number"]),
    ("section-type", OK + "engine: 4\n", 2, "engine", ["expected a mapping", "got an integer"]),
    ("bad-date", OK + "description: 2024-13-45\n", 2, "(yaml)", ["month must be in 1..12", "quote it"]),
    ("empty", "# nothing here\n", 1, "(document)", ["empty"]),
    ("frequency-penalty", OK + "sampling:\n  frequency_penalty: 2.5\n", 3, "sampling.frequency_penalty",
     ["must be <= 2", "got 2.5"]),
    ("repetition-0", OK + "sampling: {mix: [{fraction: 0.5, repetition_penalty: 0}]}\n", 2,
     "sampling.mix.0.repetition_penalty", ["must be > 0"]),
    ("bias-key", OK + "sampling: {logit_bias: {the: -100}}\n", 2, "sampling.logit_bias",
     ["'the' is not a token id", '{"42": -100}']),
    ("bias-range", OK + "sampling: {logit_bias: {\"42\": -150}}\n", 2, "sampling.logit_bias.42", [">= -100"]),
    ("mix-fractions", OK + "sampling: {mix: [{fraction: 0.6}, {fraction: 0.6, min_tokens: 2}]}\n", 2, "sampling.mix",
     ["add up to 1.2", "1 or less"]),
]


@pytest.mark.parametrize("text,line,path,fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_one_clear_line(text, line, path, fragments):
    with pytest.raises(ScenarioError) as info:
        parse_scenario(text, source="bad.yaml")
    errors = info.value.errors
    assert len(errors) == 1, errors
    msg = errors[0]
    assert msg.startswith(f"bad.yaml:{line}: {path}: "), msg
    assert LINE_RE.match(msg) and "\n" not in msg, msg
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)


def test_two_mistakes_two_lines():
    with pytest.raises(ScenarioError) as info:
        parse_scenario("max_requests: 0\ndtype: fp8\n", source="x.yaml")
    assert [e.split(":")[1] for e in info.value.errors] == ["1", "2"]


def test_trace_row_error_names_csv_line(tmp_path: Path):
    (tmp_path / "t.csv").write_text("timestamp,prompt_tokens,output_tokens\n0.0,10,5\n0.5,ten,5\n")
    (tmp_path / "s.yaml").write_text("arrivals:\n  process: trace\n  file: t.csv\n")
    with pytest.raises(ScenarioError) as info:
        load_scenario(tmp_path / "s.yaml")
    (msg,) = info.value.errors
    assert msg.startswith(f"{tmp_path / 's.yaml'}:3: arrivals.file: t.csv line 3: not numbers")


def test_trace_unsorted(tmp_path: Path):
    (tmp_path / "t.csv").write_text("1.0,10,5\n0.5,10,5\n")
    with pytest.raises(ScenarioError, match="sort the trace by timestamp"):
        parse_scenario("arrivals: {process: trace, file: t.csv}", base_dir=tmp_path)


@pytest.mark.parametrize("make,fragment", [
    (lambda p: p / "missing.yaml", "(file): not found"),
    (lambda p: p, "(file): is a folder"),
    (lambda p: (p / "b.yaml").write_bytes(b"name: \xff\xfe") and p / "b.yaml", "(file): not UTF-8"),
])
def test_file_problems(tmp_path: Path, make, fragment):
    path = make(tmp_path)
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    (msg,) = info.value.errors
    assert msg.startswith(f"{path}: ") and fragment in msg, msg


def test_error_is_the_only_exception_type():
    with pytest.raises(ScenarioError):
        parse_scenario(b"max_requests: 4")  # type: ignore[arg-type]
