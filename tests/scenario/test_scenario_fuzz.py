"""Loader fuzzing: whatever the input, parse_scenario returns a Scenario or raises ScenarioError whose
lines are well formed; it never raises anything else and never reports an internal error. The same
through the CLI: `kvtui validate` on hostile YAML (wrong types, huge numbers, nested junk, control
characters, unicode, rich markup) exits 0 or 2, never with a traceback, one stderr line per problem."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvtui.cli import app
from kvtui.scenario import Scenario, ScenarioError, parse_scenario

LINE_RE = re.compile(r"^<fuzz>(:\d+)?: \S.*: .+; .+$")
FUZZ = settings(max_examples=int(os.environ.get("KVTUI_FUZZ_EXAMPLES", "150")),  # more: KVTUI_FUZZ_EXAMPLES=5000
                 deadline=None, suppress_health_check=[HealthCheck.too_slow])

VALID = {
    "name": "fuzz", "seed": 1, "max_requests": 4, "duration_s": 10.0, "model": "tiny-llama", "dtype": "float32",
    "engine": {"slots": 2, "max_len": 128, "max_batch_size": 4, "max_tokens_per_step": 256, "layout": "packed",
               "padding_side": "left", "bucketing": {"enabled": True, "tolerance": 0.2}, "slot_reuse": "reuse",
               "on_too_long": "cap", "max_waiting": 3, "faults": ["stale_slot"]},
    "arrivals": {"process": "gamma", "rate_per_s": 2.0, "burstiness": 0.5},
    "prompts": {"kind": "synthetic", "prompt_tokens": {"dist": "lognormal", "mean": 20, "sigma": 0.5, "max": 64},
                "shared_prefix_tokens": 4},
    "output_tokens": {"dist": "choice", "values": [4, 8], "weights": [1, 2]},
    "sampling": {"temperature": 0.5, "top_k": 10, "top_p": 0.9, "ignore_eos": True, "stop": ["."]},
    "slo": {"ttft_s": 1.0, "tpot_s": 0.1},
    "timeline": [{"at_s": 1.0, "set": {"arrivals.rate_per_s": 4.0, "max_batch_size": 2}, "marker": "m"},
                 {"at_s": 2.0, "set": {"fault": "shared_cache", "on": False}}],
    "expect": {"contamination": "detected"},
}

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-10**20, 10**20), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20), st.sampled_from(["poisson", "gamma", "fixed", "synthetic", "passphrase", "padded",
                                           "greedy", "stale_slot", "arrivals.rate_per_s", "on", "~", "1e400"]),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.text(max_size=12), st.integers()), inner, max_size=4)),
    max_leaves=12)


def check(text: str) -> None:
    try:
        result = parse_scenario(text, source="<fuzz>")
    except ScenarioError as e:
        assert e.errors
        for line in e.errors:
            assert LINE_RE.match(line), line
            assert "internal error" not in line, line
        return
    assert isinstance(result, Scenario)
    again = parse_scenario(yaml.safe_dump(result.normalized()), source="<fuzz>")  # normalized round-trips
    assert again.content_hash() == result.content_hash()


def mutate(data: object, path: list, value: object) -> object:
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(data, dict) and data:
        k = list(data)[key % len(data)]
        return {**data, k: mutate(data[k], rest, value)}
    if isinstance(data, list) and data:
        i = key % len(data)
        return data[:i] + [mutate(data[i], rest, value)] + data[i + 1:]
    return value


def test_valid_fixture_is_valid():
    check(yaml.safe_dump(VALID))
    parse_scenario(yaml.safe_dump(VALID))


@FUZZ
@given(st.text(max_size=300))
def test_arbitrary_text(text):
    check(text)


@FUZZ
@given(st.text(alphabet=":-[]{}&*!|>'\"%@`#,? \n\tabcx0123.~", max_size=200))
def test_yaml_punctuation(text):
    check(text)


@FUZZ
@given(values)
def test_arbitrary_documents(doc):
    check(yaml.safe_dump(doc))


@FUZZ
@given(st.lists(st.integers(0, 50), max_size=4), values)
def test_mutated_valid_scenario(path, value):
    check(yaml.safe_dump(mutate(VALID, path, value)))


@FUZZ
@given(st.lists(st.integers(0, 50), min_size=1, max_size=4), st.text(max_size=12), values)
def test_added_keys(path, key, value):
    target = mutate(VALID, path[:-1], None)  # noqa: F841 - only to pick a container below
    doc = mutate(VALID, path, {key: value})
    check(yaml.safe_dump(doc))


def test_nasty_yaml():
    for text in ["a: &a [*a]", "&a [*a, *a]", "[" * 5000, "a: !!python/object:os.system ls",
                 "? [1, 2]\n: 3", "x: !!binary aGVsbG8=", "<<: {max_requests: 3}\nseed: 1",
                 "a: &x [1,1,1,1,1,1,1,1,1]\nb: &y [*x,*x,*x,*x,*x,*x,*x,*x,*x]\nc: [*y,*y,*y,*y,*y,*y,*y,*y,*y]",
                 "max_requests: 1\ntimeline: &t [{at_s: 1, set: *t}]", "\x00", "max_requests: 0x10",
                 "max_requests: 1_000", "seed: 12345678901234567890123", "max_requests: 4\nname: ''",
                 "max_requests: 4\nsampling: {}", "max_requests: 4\nsampling: greedy\n---\nx: 1"]:
        check(text)


# -- the CLI: `kvtui validate` on hostile documents -------------------------------------------------------

CLI_LINE = re.compile(r"^(error|warning): \S.*: .+; .+$")
_FUZZ_DIR = Path(tempfile.mkdtemp(prefix="kvtui-fuzz-"))
hostile_text = st.text(alphabet=st.one_of(st.characters(max_codepoint=0x1F), st.sampled_from("\x7f\x1b[]/\\:{}'\""),
                                          st.characters()), max_size=24)
hostile_scalars = st.one_of(
    scalars, hostile_text, st.integers(-10**30, 10**30), st.floats(min_value=-1e308, max_value=1e308),
    st.sampled_from([2**63, 2**50, 10**6, 4096, "1e3", "1.0e+3", "[/]", "[bold red]x", "\u202e", "\ufeff", "\x00"]),
)
hostile_values = st.recursive(hostile_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.one_of(hostile_text, st.integers()), inner, max_size=4)),
    max_leaves=16)
hostile_docs = st.one_of(
    hostile_values,
    st.dictionaries(st.sampled_from(list(VALID)), hostile_values, max_size=6),
    st.builds(lambda path, value: mutate(VALID, path, value), st.lists(st.integers(0, 50), max_size=4),
              hostile_values),
)


def validate_cli(text: str):
    """`kvtui validate` in-process on `text`; checks the contract and returns the result."""
    path = _FUZZ_DIR / "fuzz.yaml"
    path.write_text(text, encoding="utf-8")
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code in (0, 2), (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    for line in lines:
        assert CLI_LINE.match(line), line
        assert all(c.isprintable() for c in line), line
        assert "internal error" not in line, line
    errors = [line for line in lines if line.startswith("error: ")]
    assert bool(errors) == (result.exit_code == 2), result.stderr
    if result.exit_code == 0:
        assert isinstance(yaml.safe_load(result.stdout), dict)
    return result


@FUZZ
@given(hostile_docs)
def test_validate_cli_on_hostile_documents(doc):
    validate_cli(yaml.safe_dump(doc, allow_unicode=True))


@FUZZ
@given(st.text(max_size=300))
def test_validate_cli_on_arbitrary_text(text):
    validate_cli(text)


def test_validate_cli_examples():
    assert validate_cli(yaml.safe_dump(VALID)).exit_code == 0
    for text in ["name: \"\\x1b[31m[/]\"\nmax_requests: 1e3\n", "max_requests: 4\nengine: {slots: 4096, max_len: 1000000}\n",
                 "max_requests: 4\nunknown_[/]: 1\n", "max_requests: 4\nmodel: \"[bold]\\x07\"\n", "\x00", "[" * 5000]:
        assert validate_cli(text).exit_code == 2, text
