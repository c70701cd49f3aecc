"""Batched == solo: the isolation property of the engine, on tiny Llama (GQA) and GPT-2, against
kvtui's own solo run AND against transformers' own attention (eager and sdpa) on a separate model
instance, so kvtui's attention is never only compared with itself."""

import pytest
from helpers import assert_equals_solo, assert_matches_oracle, oracle_model, oracle_tokens, run_batched, solo
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtui.config import EngineConfig
from kvtui.engine import SamplingParams

MODELS = ("tiny-llama", "tiny-gpt2")


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", MODELS)
def test_solo_engine_matches_transformers_attention(tiny, name, attn):
    """The solo path itself is right: pooled cache + kvtui attention == transformers' own attention on a
    separate instance, full-sequence forward, greedy and seeded sampling."""
    oracle = oracle_model(name, attn)
    for prompt in ([5], [7, 8, 9, 10, 11, 12, 13], list(range(40, 103))):
        for params in (SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=12, temperature=0.9,
                                                                         top_k=20, top_p=0.9, seed=7)):
            theirs, gaps = oracle_tokens(oracle, prompt, params)
            assert_matches_oracle(solo(tiny[name], prompt, params), theirs, gaps, f"{name} {attn} {len(prompt)}")


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 12))
    vocab = 250  # byte ids only: no special tokens
    prompts = [draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=64)) for _ in range(n)]
    arrivals = [draw(st.integers(0, 12)) for _ in range(n)]
    sampled = draw(st.booleans())
    params = []
    for _ in range(n):
        max_new = draw(st.integers(1, 12))
        if sampled:
            params.append(SamplingParams(temperature=draw(st.sampled_from([0.7, 1.0, 1.5])),
                                         top_k=draw(st.sampled_from([0, 5, 50])),
                                         top_p=draw(st.sampled_from([1.0, 0.9, 0.5])),
                                         seed=draw(st.integers(0, 2**31 - 1)), max_new_tokens=max_new))
        else:
            params.append(SamplingParams(max_new_tokens=max_new))
    slots = draw(st.integers(1, max(1, n - 1)))  # fewer slots than requests: slots get reused
    config = EngineConfig(
        num_slots=slots, max_len=80, max_batch_size=draw(st.integers(1, 12)),
        max_tokens_per_step=draw(st.sampled_from([8, 24, 64, 1024])),  # small budgets force chunked prefill
        layout=draw(st.sampled_from(["padded", "packed"])), padding_side=draw(st.sampled_from(["right", "left"])),
        bucketing=draw(st.booleans()), bucket_tolerance=draw(st.sampled_from([0.0, 0.2, 0.5])),
    )
    return draw(st.sampled_from(MODELS)), prompts, arrivals, params, config


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workloads())
def test_batched_equals_solo(tiny, workload):
    name, prompts, arrivals, params, config = workload
    loaded = tiny[name]
    states = {}
    engine, outputs, reports = run_batched(loaded, prompts, params, arrivals, config, states)
    oracle = oracle_model(name, ("eager", "sdpa")[len(prompts) % 2])
    for i, prompt in enumerate(prompts):
        state = states[i]
        assert_equals_solo(loaded, prompt, params[i], outputs[i], state.top2_gaps, state.draws, f"request r{i}")
        assert len(outputs[i]) == params[i].max_new_tokens
        if params[i].greedy:  # sampled requests: the oracle's sampling is exercised in the solo test above
            theirs, gaps = oracle_tokens(oracle, prompt, params[i])
            assert_matches_oracle(outputs[i], theirs, gaps, f"request r{i}")
    if len(prompts) > config.num_slots:
        assert sum(engine.pool.times_used) == len(prompts)  # every request got a slot, some reused
        assert max(engine.pool.times_used) >= 2
    assert engine.pool.num_used == 0  # every slot freed at the end
    assert max(r.slots_used for r in reports) <= config.num_slots
