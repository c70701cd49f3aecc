"""Loader fuzzing: whatever the input, parse_scenario returns a Scenario or raises ScenarioError whose
lines are well formed; it never raises anything else and never reports an internal error."""

from __future__ import annotations

import os
import re

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
