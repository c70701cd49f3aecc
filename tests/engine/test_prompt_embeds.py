"""Prompt embeddings (RequestInput with supplied rows): answers equal transformers' own
`generate(inputs_embeds=...)` on a separate model instance; batched equals solo in slots and paged,
padded and packed, with requests joining and leaving; the prefix cache keys the supplied rows and the
mask; the embeds faults share KV they must not, and the detectors name victim and source."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import make_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtui.config import EngineConfig
from kvtui.engine import Engine, SamplingParams
from kvtui.engine.inputs import PLACEHOLDER_ID, PromptEmbeds, RequestInput
from kvtui.models import build_tiny

MAX_LEN = 64


@pytest.fixture(scope="module")
def oracle():
    """A SEPARATE tiny-llama instance (same seed, same weights) on transformers' eager attention."""
    model, _ = build_tiny("tiny-llama")
    model.set_attn_implementation("eager")
    return model.eval()


def _oracle_generate(model, inp: RequestInput, n: int) -> list[int]:
    """transformers' own greedy `generate(inputs_embeds=...)`: the embedding table's rows at token positions,
    the supplied rows elsewhere (built here from the request's fields, not by kvtui's runner)."""
    with torch.inference_mode():
        table = model.get_input_embeddings()
        embeds = table(torch.tensor([list(inp.prompt_ids)]))[0].clone()
        if inp.embeds is not None:
            for p in inp.embeds.supplied_positions:
                embeds[p] = inp.embeds.rows[p].to(embeds.dtype)
        out = model.generate(inputs_embeds=embeds[None], attention_mask=torch.ones(1, len(inp.prompt_ids),
                             dtype=torch.long), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                             pad_token_id=0, eos_token_id=None)
    return out[0].tolist()[-n:]


def _random_input(rng: random.Random, hidden: int, length: int, mode: str) -> RequestInput:
    ids = [rng.randrange(3, 250) for _ in range(length)]
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    rows = torch.randn(length, hidden, generator=gen) * 0.05
    if mode == "tokens":
        return RequestInput(tuple(ids))
    if mode == "all":
        return RequestInput.from_embeds(rows)
    mask = [rng.random() < 0.5 for _ in range(length)]
    mask[0] = True
    return RequestInput.from_embeds(rows, ids, mask)


def _engine(loaded, config: EngineConfig) -> Engine:
    return make_engine(loaded.model, config)


def _solo(loaded, inp: RequestInput, n: int) -> list[int]:
    engine = _engine(loaded, EngineConfig(num_slots=1, max_len=MAX_LEN, max_batch_size=1))
    state = engine.submit("solo", inp, SamplingParams(max_new_tokens=n))
    engine.run_until_done()
    return list(state.generated_ids)


def test_all_embeds_prompt_equals_generate_with_inputs_embeds(tiny, oracle):
    loaded = tiny["tiny-llama"]
    hidden = loaded.model.config.hidden_size
    rng = random.Random(3)
    for mode in ("all", "mixed", "tokens"):
        inp = _random_input(rng, hidden, 11, mode)
        ours = _solo(loaded, inp, 8)
        assert ours == _oracle_generate(oracle, inp, 8), mode


def test_embedding_rows_of_the_tokens_themselves_answer_as_the_tokens(tiny):
    """A prompt given as its own tokens' embedding rows answers exactly as the token ids do."""
    loaded = tiny["tiny-llama"]
    ids = [5, 17, 99, 42, 7, 130]
    with torch.no_grad():
        rows = loaded.model.get_input_embeddings().weight[ids].clone()
    assert _solo(loaded, RequestInput.from_embeds(rows), 6) == _solo(loaded, RequestInput(tuple(ids)), 6)


@st.composite
def workloads(draw):
    rng = random.Random(draw(st.integers(0, 2**31)))
    n = draw(st.integers(2, 6))
    modes = [draw(st.sampled_from(["tokens", "all", "mixed"])) for _ in range(n)]
    lengths = [draw(st.integers(2, 20)) for _ in range(n)]
    arrivals = [draw(st.integers(0, 6)) for _ in range(n)]
    outputs = [draw(st.integers(1, 8)) for _ in range(n)]
    kv = draw(st.sampled_from(["slots", "paged"]))
    config = EngineConfig(kv=kv, num_slots=4, max_len=MAX_LEN, block_size=draw(st.sampled_from([2, 4, 16])),
                          prefix_caching=kv == "paged", max_batch_size=draw(st.integers(1, 4)),
                          max_tokens_per_step=draw(st.sampled_from([8, 1024])),
                          layout=draw(st.sampled_from(["padded", "packed"])))
    return rng, modes, lengths, arrivals, outputs, config


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_batched_embeds_equal_solo_runs(tiny, workload):
    rng, modes, lengths, arrivals, outputs, config = workload
    loaded = tiny["tiny-llama"]
    hidden = loaded.model.config.hidden_size
    inputs = [_random_input(rng, hidden, n, m) for n, m in zip(lengths, modes)]
    if len(inputs) > 2:  # the same embeddings twice: a prefix-cache hit must give the same answer
        inputs[-1] = inputs[0]
    engine = _engine(loaded, config)
    states, step = {}, 0
    order = sorted(range(len(inputs)), key=lambda i: arrivals[i])
    while order or engine.has_unfinished():
        while order and arrivals[order[0]] <= step:
            i = order.pop(0)
            states[i] = engine.submit(f"r{i}", inputs[i], SamplingParams(max_new_tokens=outputs[i]))
        engine.step()
        step += 1
        assert step < 2000
    for i, inp in enumerate(inputs):
        assert list(states[i].generated_ids) == _solo(loaded, inp, outputs[i]), f"r{i} ({modes[i]})"


def _paged(faults=()) -> EngineConfig:
    return EngineConfig(kv="paged", block_size=4, num_slots=4, max_len=MAX_LEN, prefix_caching=True,
                        max_batch_size=4, faults=frozenset(faults))


def _run_after(loaded, config, first: RequestInput, second: RequestInput, n: int = 6):
    """`first` to completion, then `second`: (second's tokens, its prefix-hit tokens, the engine's reports)."""
    engine = _engine(loaded, config)
    engine.detect_taint = True
    engine.submit("a", first, SamplingParams(max_new_tokens=n))
    reports = engine.run_until_done()
    state = engine.submit("b", second, SamplingParams(max_new_tokens=n))
    reports += engine.run_until_done()
    return list(state.generated_ids), state.prefix_hit_tokens, reports


def _two_prompts(loaded, length: int = 12):
    hidden = loaded.model.config.hidden_size
    a = torch.randn(length, hidden, generator=torch.Generator().manual_seed(1))
    b = torch.randn(length, hidden, generator=torch.Generator().manual_seed(2))
    return RequestInput.from_embeds(a), RequestInput.from_embeds(b)


def test_prefix_cache_keys_supplied_rows(tiny):
    """Two all-embeds prompts of one length have equal placeholder ids; keyed by their rows they share
    nothing, and the same rows again are a hit."""
    loaded = tiny["tiny-llama"]
    a, b = _two_prompts(loaded)
    tokens, hit, _ = _run_after(loaded, _paged(), a, b)
    assert hit == 0 and tokens == _solo(loaded, b, 6)
    _, hit_same, _ = _run_after(loaded, _paged(), a, a)
    assert hit_same == 8  # two full blocks of 4 (the last position is always computed)


def test_embeds_unkeyed_serves_another_prompts_kv_and_provenance_names_it(tiny):
    loaded = tiny["tiny-llama"]
    a, b = _two_prompts(loaded)
    tokens, hit, reports = _run_after(loaded, _paged(["embeds_unkeyed"]), a, b)
    assert hit == 8
    assert tokens != _solo(loaded, b, 6)
    hits = [h for r in reports for h in r.prefix_hits if h.request_id == "b"]
    assert hits and {blk.writer for blk in hits[0].blocks} == {"a"}
    assert all(blk.writer_key != blk.reader_key for blk in hits[0].blocks)  # the contents are not b's


def _mask_pair(loaded, length: int = 12):
    """Equal normalized ids and an equal full-length tensor, different masks (vLLM #56655's pair): in A
    positions 4..7 are supplied rows, in B they are the placeholder token itself."""
    hidden = loaded.model.config.hidden_size
    rows = torch.zeros(length, hidden)
    rows[4:8] = torch.randn(4, hidden, generator=torch.Generator().manual_seed(5))
    ids = [9 + i for i in range(length)]
    ids[4:8] = [PLACEHOLDER_ID] * 4
    mask_a = [not 4 <= p < 8 for p in range(length)]
    a = RequestInput(tuple(ids), embeds=PromptEmbeds(rows, torch.tensor(mask_a)))
    b = RequestInput(tuple(ids), embeds=PromptEmbeds(rows, torch.ones(length, dtype=torch.bool)))
    return a, b


def test_embeds_mask_unkeyed_shares_kv_across_masks_and_the_keyed_cache_does_not(tiny):
    loaded = tiny["tiny-llama"]
    a, b = _mask_pair(loaded)
    assert a.embeds.supplied_positions == (4, 5, 6, 7) and b.embeds.supplied_positions == ()
    tokens, hit, _ = _run_after(loaded, _paged(), a, b)
    assert hit == 4 and tokens == _solo(loaded, b, 6)  # only block 0 (ids 9..12, all tokens in both) is shared
    tokens, hit, reports = _run_after(loaded, _paged(["embeds_mask_unkeyed"]), a, b)
    assert hit == 8 and tokens != _solo(loaded, b, 6)
    blocks = [h for r in reports for h in r.prefix_hits if h.request_id == "b"][0].blocks
    assert [blk.writer_key == blk.reader_key for blk in blocks] == [True, False]  # block 1 is not what b computes


def test_bad_embeds_are_refused_alone(tiny):
    loaded = tiny["tiny-llama"]
    engine = _engine(loaded, EngineConfig(num_slots=2, max_len=MAX_LEN))
    bad = engine.submit("bad", RequestInput.from_embeds(torch.zeros(4, 7)))
    good = engine.submit("good", [5, 6, 7], SamplingParams(max_new_tokens=3))
    engine.run_until_done()
    assert bad.finish_reason.value == "rejected" and "rows have 7 values" in bad.finish_detail
    assert len(good.generated_ids) == 3
    with pytest.raises(ValueError, match="NaN or inf"):
        PromptEmbeds(torch.full((2, 4), float("nan")))
    with pytest.raises(ValueError, match="2-D"):
        PromptEmbeds(torch.zeros(4))
    with pytest.raises(ValueError, match="3 rows for a prompt of 2"):
        RequestInput((1, 2), embeds=PromptEmbeds(torch.zeros(3, 4)))
