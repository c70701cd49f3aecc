"""plan_requests: deterministic by seed, honours stop conditions, builds prompts and sampling."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtui.engine.request import SamplingParams
from kvtui.request import PromptFacts
from kvtui.scenario import PlannedRequest, derive_seed, parse_scenario, plan_requests
from kvtui.scenario.prompts import WORDS, to_id_list


class FakeTokenizer:
    """Just enough of a transformers tokenizer: bytes -> ids 3.., specials 0-2, chat template returns
    a BatchEncoding-like dict as transformers 5 does."""

    vocab_size = 300
    all_special_ids = [0, 1, 2]
    chat_template = "fake"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [3 + b for b in text.encode()]

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        ids = [1]
        for m in messages:
            ids += self.encode(f"{m['role']}\n{m['content']}") + [2]
        return {"input_ids": ids + ([1] + self.encode("assistant\n") if add_generation_prompt else [])}


TOK = FakeTokenizer()


def plan(text: str, **kw) -> list[PlannedRequest]:
    return plan_requests(parse_scenario(text), TOK, **kw)


BASE = "seed: 3\nmax_requests: 12\narrivals: {process: poisson, rate_per_s: 2}\noutput_tokens: {dist: uniform, min: 4, max: 40}\n"


def test_same_seed_same_plan_and_other_seed_differs():
    a, b = plan(BASE), plan(BASE)
    assert a == b
    c = plan(BASE.replace("seed: 3", "seed: 4"))
    assert [r.passphrase for r in a] != [r.passphrase for r in c]
    assert [r.arrival_s for r in a] != [r.arrival_s for r in c]


def test_ids_order_and_sampling():
    reqs = plan(BASE + "sampling: {temperature: 0.7, top_k: 50, top_p: 0.9, stop: ['.']}\n")
    assert [r.request_id for r in reqs] == [f"r{i:03d}" for i in range(12)]
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs) and reqs[0].arrival_s == 0.0
    s = reqs[0].sampling
    assert isinstance(s, SamplingParams) and (s.temperature, s.top_k, s.top_p, s.stop) == (0.7, 50, 0.9, (".",))
    assert len({r.sampling.seed for r in reqs}) == 12
    assert reqs[5].sampling.seed == derive_seed(3, "sampling:5")
    assert all(4 <= r.sampling.max_new_tokens <= 40 for r in reqs)


def test_passphrases_unique_well_formed_and_in_prompt():
    reqs = plan("max_requests: 200\narrivals: {process: constant, rate_per_s: 100}\n")
    phrases = [r.passphrase for r in reqs]
    assert len(set(phrases)) == 200
    for r, p in zip(reqs, phrases):
        a, b, nn = p.split("-")
        assert a in WORDS and b in WORDS and a != b and 10 <= int(nn) <= 99
        assert p in r.text
        assert r.prompt_ids == TOK.apply_chat_template(
            [{"role": "user", "content": r.text}], add_generation_prompt=True)["input_ids"]


def test_stop_conditions_whichever_first():
    assert len(plan(BASE)) == 12
    by_time = plan(BASE.replace("max_requests: 12", "duration_s: 3.0"))
    assert by_time and all(r.arrival_s < 3.0 for r in by_time)
    both = plan(BASE.replace("max_requests: 12", "max_requests: 1000\nduration_s: 3.0"))
    assert both == by_time
    assert len(plan(BASE, limit=5)) == 5
    assert plan(BASE, limit=5) == plan(BASE)[:5]


def test_engine_changes_leave_plan_unchanged():
    """A bucketing on/off or reuse/reallocate pair plans the same requests."""
    on = plan(BASE + "engine: {bucketing: {enabled: true}, slot_reuse: reallocate}\n")
    assert on == plan(BASE)


def test_synthetic_prompts_prefix_lengths_and_no_special_ids():
    reqs = plan("max_requests: 30\narrivals: {process: poisson, rate_per_s: 5}\n"
                "prompts: {kind: synthetic, prompt_tokens: {dist: uniform, min: 5, max: 50}, shared_prefix_tokens: 16}\n")
    prefix = reqs[0].prompt_ids[:16]
    for r in reqs:
        assert r.prompt_ids[:16] == prefix
        assert 21 <= len(r.prompt_ids) <= 66 and r.facts == PromptFacts(prompt_tokens=len(r.prompt_ids), shared_prefix_tokens=16)
        assert not set(r.prompt_ids) & set(TOK.all_special_ids)
        assert all(0 <= i < TOK.vocab_size for i in r.prompt_ids)
    assert len({tuple(r.prompt_ids) for r in reqs}) == 30


def test_timeline_rate_change_applies_to_plan():
    reqs = plan("duration_s: 20\narrivals: {process: constant, rate_per_s: 1}\n"
                "timeline: [{at_s: 10, set: {arrivals.rate_per_s: 4}, marker: faster}]\n")
    assert sum(r.arrival_s < 10 for r in reqs) == 10
    # at the change the pending gap is dropped and a new one drawn from 10 s: 10.25, ..., 19.75
    assert sum(r.arrival_s >= 10 for r in reqs) == 39


def test_trace_times_and_lengths(tmp_path: Path):
    (tmp_path / "t.csv").write_text("# a comment\ntimestamp,prompt_tokens,output_tokens\n"
                                    "100.0,8,3\n101.0,20,5\n103.0,12,7\n")
    s = parse_scenario("arrivals: {process: trace, file: t.csv, time_scale: 0.5}\nprompts: {kind: synthetic}\n",
                       base_dir=tmp_path)
    reqs = plan_requests(s, TOK)
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 1.5]
    assert [len(r.prompt_ids) for r in reqs] == [8, 20, 12]
    assert [r.sampling.max_new_tokens for r in reqs] == [3, 5, 7]
    passphrase = plan_requests(parse_scenario("arrivals: {process: trace, file: t.csv}", base_dir=tmp_path), TOK)
    assert [r.facts.trace_prompt_tokens for r in passphrase] == [8, 20, 12]


def test_scripted_requests(tmp_path: Path):
    reqs = plan("arrivals:\n  process: scripted\n  requests:\n"
                "    - {at_s: 2.0, prompt: 'second', max_new_tokens: 5}\n"
                "    - {at_s: 0.5, prompt: 'raw text', chat: false}\n"
                "    - {at_s: 1.0}\n")
    assert [r.arrival_s for r in reqs] == [0.5, 1.0, 2.0]
    assert reqs[0].prompt_ids == TOK.encode("raw text") and (reqs[0].text, reqs[0].canary, reqs[0].facts) == ("raw text", None, PromptFacts())
    assert reqs[1].canary is not None  # no prompt: from the prompts section
    assert reqs[2].sampling.max_new_tokens == 5


def test_file_prompts_cycle_text_and_jsonl(tmp_path: Path):
    (tmp_path / "p.txt").write_text("first prompt\n\nsecond prompt\n")
    (tmp_path / "p.jsonl").write_text('"a"\n{"prompt": "b"}\n{"messages": [{"role": "user", "content": "c"}]}\n')
    reqs = plan_requests(parse_scenario("max_requests: 3\narrivals: {process: constant, rate_per_s: 1}\n"
                                        "prompts: {kind: file, path: p.txt, chat: false}", base_dir=tmp_path), TOK)
    assert [r.text for r in reqs] == ["first prompt", "second prompt", "first prompt"]
    assert reqs[0].prompt_ids == TOK.encode("first prompt")
    reqs = plan_requests(parse_scenario("max_requests: 3\narrivals: {process: constant, rate_per_s: 1}\n"
                                        "prompts: {kind: file, path: p.jsonl}", base_dir=tmp_path), TOK)
    assert [r.text for r in reqs] == ["a", "b", "c"]


def test_to_id_list_normalizes_tokenizer_outputs():
    import torch

    assert to_id_list([1, 2]) == [1, 2]
    assert to_id_list({"input_ids": [[4, 5]]}) == [4, 5]
    assert to_id_list(torch.tensor([[7, 8]])) == [7, 8]


@pytest.fixture(scope="module")
def tiny_tokenizer():
    try:
        from kvtui.models import load_model
    except ImportError as e:
        pytest.skip(f"kvtui.models.load_model not available yet ({e})")
    return load_model("tiny-llama", progress=False).tokenizer


def test_plan_with_real_tiny_tokenizer(tiny_tokenizer):
    s = parse_scenario("max_requests: 6\narrivals: {process: poisson, rate_per_s: 2}\n")
    reqs = plan_requests(s, tiny_tokenizer)
    assert reqs == plan_requests(s, tiny_tokenizer)
    for r in reqs:
        assert r.prompt_ids and all(type(i) is int for i in r.prompt_ids)
        text = tiny_tokenizer.decode(r.prompt_ids)
        assert r.passphrase in text and re.search(r"assistant\s*$", text)
    syn = plan_requests(parse_scenario("max_requests: 4\narrivals: {process: constant, rate_per_s: 1}\n"
                                       "prompts: {kind: synthetic, prompt_tokens: 32}"), tiny_tokenizer)
    special = set(tiny_tokenizer.all_special_ids)
    assert all(len(r.prompt_ids) == 32 and not set(r.prompt_ids) & special for r in syn)
