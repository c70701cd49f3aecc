"""A hybrid model (tiny-qwen35moe: three gated-delta linear-attention layers, one attention layer) in kvtui's
engine, against transformers' own `generate` on a SEPARATE instance of the same seeded model.

Every configuration below must give each request exactly the greedy tokens `generate` gives it alone: one
request; several batched padded (right and left) and packed; chunked prefill (the state carried from chunk
to chunk); preemption by recompute (the state slot freed, the recompute starting from zero); paged KV with
prefix caching, where a later request hits a shared prefix and its state slot restores the checkpoint kept
with the hit's last block (also through the offload tier); and a hypothesis composition of these knobs.
Plus the state pool's own promises (a slot is zero on allocation whatever its previous owner wrote), the
hit cut back to a checkpoint, and the step events' and summary's state counters.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtui.config import EngineConfig
from kvtui.engine.block_manager import BlockManager
from kvtui.engine.engine import Engine
from kvtui.engine.request import SamplingParams
from kvtui.engine.state_pool import StatePool, state_shape
from kvtui.metrics import SLO, Metrics
from kvtui.model_kinds import ModelKind
from kvtui.models.hybrid import build_hybrid

NEW_TOKENS = 8
PROMPTS = [
    "You are a helpful assistant. Answer briefly. What is the capital of France?",
    "hi",
    "Write one sentence about the sea, the wind and the long grey boats that come home at night.",
    "count: one two three four five six seven",
]
SYSTEM = "You are a careful assistant who keeps every secret it is told and answers in one short line. "


@pytest.fixture(scope="module")
def hybrid():
    """(engine model, oracle model, tokenizer): two separate instances of the seeded hybrid."""
    model, tokenizer = build_hybrid()
    oracle, _ = build_hybrid()
    assert model is not oracle and model.model.embed_tokens.weight.data_ptr() != oracle.model.embed_tokens.weight.data_ptr()
    return model, oracle, tokenizer


_expected: dict[tuple[int, ...], list[int]] = {}


def generate(oracle, ids: list[int]) -> list[int]:
    """transformers' own greedy generate of NEW_TOKENS tokens (no stop), cached per prompt."""
    key = tuple(ids)
    if key not in _expected:
        out = oracle.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=2)
        _expected[key] = out[0, len(ids):].tolist()
    return _expected[key]


def run(model, prompts: list[list[int]], **config) -> tuple[dict[str, list[int]], list]:
    """Each prompt as request r{i}, all submitted at once; (request id -> output ids, step events)."""
    engine = Engine(model, EngineConfig(**{"max_len": 160, **config}), eos_token_ids=())
    for i, ids in enumerate(prompts):
        engine.submit(f"r{i}", ids, SamplingParams(max_new_tokens=NEW_TOKENS))
    events = engine.run_until_done()
    out = {f.request_id: list(f.output_ids) for e in events for f in e.finished}
    return out, events


def check(hybrid, prompts: list[str], **config) -> list:
    model, oracle, tok = hybrid
    ids = [tok(p).input_ids for p in prompts]
    out, events = run(model, ids, **config)
    assert out == {f"r{i}": generate(oracle, x) for i, x in enumerate(ids)}
    return events


def test_the_engine_runs_the_hybrid_as_a_hybrid(hybrid):
    engine = Engine(hybrid[0], EngineConfig(max_len=64))
    assert engine.model_kind is ModelKind.HYBRID and engine.runner.forward_path == "modules"
    assert engine.pool.num_layers == 1  # K/V for the one attention layer only
    assert engine.state.pool.num_slots == 8 and engine.state.pool.shape.linear_layers == (0, 1, 2)
    with pytest.raises(ValueError, match="does not act on hybrid"):
        engine.set_faults(["shared_cache"])


def test_one_request_equals_generate(hybrid):
    events = check(hybrid, PROMPTS[:1])
    assert events[-1].num_state_slots == 8 and events[-1].state_slots_used == 0


@pytest.mark.parametrize("layout, side", [("padded", "right"), ("padded", "left"), ("packed", "right")])
def test_batched_requests_equal_their_solo_generate(hybrid, layout, side):
    events = check(hybrid, PROMPTS, layout=layout, padding_side=side)
    assert max(e.rows if layout == "padded" else e.prefill_tokens and len(e.running) for e in events) == len(PROMPTS)
    assert max(e.state_slots_used for e in events) == len(PROMPTS)


def test_chunked_prefill_carries_the_state_from_chunk_to_chunk(hybrid):
    events = check(hybrid, PROMPTS, max_tokens_per_step=5)
    assert max(e.prefill_tokens for e in events) <= 5
    assert sum(1 for e in events if e.prefill_tokens) >= 8  # every long prompt took several chunks


def test_preemption_by_recompute_starts_the_state_from_zero(hybrid):
    events = check(hybrid, PROMPTS, kv="paged", block_size=4, num_blocks=17, max_len=64)
    assert sum(e.num_preemptions for e in events) > 0


def test_a_prefix_hit_restores_the_checkpoint_kept_with_its_last_block(hybrid):
    model, oracle, tok = hybrid
    first, second = tok(SYSTEM + "The code word is heron.").input_ids, tok(SYSTEM + "What is two and two?").input_ids
    engine = Engine(model, EngineConfig(max_len=160, kv="paged", block_size=8, prefix_caching=True), eos_token_ids=())
    engine.submit("first", first, SamplingParams(max_new_tokens=NEW_TOKENS))
    events = engine.run_until_done()
    engine.submit("second", second, SamplingParams(max_new_tokens=NEW_TOKENS))
    events += engine.run_until_done()
    out = {f.request_id: list(f.output_ids) for e in events for f in e.finished}
    assert out == {"first": generate(oracle, first), "second": generate(oracle, second)}
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b) // 8 * 8  # whole blocks in common
    hits = sum(e.prefix_cache_hits for e in events)
    assert hits == shared >= 16
    assert sum(e.state_restores for e in events) == 1 and sum(e.state_checkpoint_hits for e in events) == shared
    assert sum(e.state_checkpoints for e in events) >= (len(first) + NEW_TOKENS) // 8  # one per block crossed
    metrics = Metrics(SLO(1.0, 1.0))
    for event in events:
        metrics.add_event(event)
    summary = metrics.summary()
    assert (summary.state_restores, summary.state_checkpoint_hits) == (1, shared)
    assert summary.state_checkpoints == sum(e.state_checkpoints for e in events)


def test_the_offload_tier_restores_a_blocks_checkpoint_with_its_kv(hybrid):
    """A pool so small that the first request's cached blocks are evicted to the tier before the second,
    sharing its prefix, comes: the tier gives back K/V and state checkpoint together."""
    model, oracle, tok = hybrid
    first, second = tok(SYSTEM + "The code word is heron.").input_ids, tok(SYSTEM + "What is two and two?").input_ids
    other = tok("an unrelated prompt that takes nearly all of the pool's blocks for itself, and then it goes on and on "
                "about nothing much at all, the weather, the road, the price of bread, the old dog asleep by the fire "
                "and the").input_ids
    assert len(other) + NEW_TOKENS > 48  # 7 of the 8 blocks: the first request's cached ones but its first go
    engine = Engine(model, EngineConfig(max_len=64, kv="paged", block_size=8, num_blocks=9, prefix_caching=True,
                                        kv_offload_blocks=16), eos_token_ids=())
    events = []
    for rid, ids in (("first", first), ("other", other), ("second", second)):
        engine.submit(rid, ids, SamplingParams(max_new_tokens=NEW_TOKENS))
        events += engine.run_until_done()
    out = {f.request_id: list(f.output_ids) for e in events for f in e.finished}
    assert out == {"first": generate(oracle, first), "other": generate(oracle, other), "second": generate(oracle, second)}
    assert sum(e.kv_offload_hits for e in events) >= 8 and sum(e.kv_offload_stores for e in events) >= 2
    assert sum(e.state_restores for e in events) == 1


@pytest.mark.parametrize("paged", [{}, {"kv": "paged", "block_size": 4, "prefix_caching": True}])
def test_parallel_sampling_siblings_fork_the_leads_state(hybrid, paged):
    """n = 3: each sibling forks the lead's state after the prompt and draws with seed + i, so it gives the
    tokens a solo request seeded seed + i gives."""
    ids = hybrid[2](PROMPTS[0]).input_ids

    def sample(n: int, seed: int) -> dict:
        engine = Engine(hybrid[0], EngineConfig(max_len=128, **paged), eos_token_ids=())
        engine.submit("a", ids, SamplingParams(max_new_tokens=6, n=n, temperature=1.0, seed=seed))
        return {f.request_id: f.output_ids for e in engine.run_until_done() for f in e.finished}

    family = sample(3, 5)
    assert [family[f"{i}_a"] for i in range(3)] == [sample(1, 5 + i)["a"] for i in range(3)]
    assert len(set(family.values())) == 3


def test_a_hit_is_cut_back_to_the_longest_block_with_a_checkpoint():
    manager = BlockManager(8, 4, caching=True)
    manager.needs_state = True
    prompt = list(range(13))  # three full blocks and one token
    manager.admit("a", prompt)
    manager.commit("a", prompt, 13, prompt_len=13)
    manager.publish_state("a", 0, "after 4")
    manager.publish_state("a", 1, "after 8")  # block 2 keeps none
    manager.free("a")
    admission = manager.admit("b", prompt)
    assert admission.hit_tokens == 8 and manager.state_at("b", 8) == "after 8"
    manager.needs_state = False
    manager.free("b")
    assert manager.admit("c", prompt).hit_tokens == 12  # attention-only: every cached block


def test_a_state_slot_is_zero_on_allocation_whatever_its_previous_owner_wrote(hybrid):
    pool = StatePool(state_shape(hybrid[0].config), num_slots=2)
    slot = pool.allocate("a")
    for layer in pool.shape.linear_layers:
        pool.conv[layer][slot].fill_(7.0)
        pool.recurrent[layer][slot].fill_(float("nan"))
    checkpoint = pool.snapshot(slot, 16)
    pool.free(slot)
    assert pool.allocate("b") == slot
    for layer in pool.shape.linear_layers:
        assert torch.count_nonzero(pool.conv[layer][slot]) == 0 and torch.count_nonzero(pool.recurrent[layer][slot]) == 0
    pool.restore(slot, checkpoint)
    assert all(bool((pool.conv[layer][slot] == 7.0).all()) for layer in pool.shape.linear_layers)
    assert (checkpoint.writer, checkpoint.num_tokens, pool.num_used) == ("a", 16, 1)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=st.sampled_from(["padded", "packed"]), budget=st.sampled_from([3, 8, 1024]),
       kv=st.sampled_from(["slots", "paged", "paged-cached", "paged-small"]), batch=st.integers(1, 4))
def test_any_composition_of_the_knobs_gives_each_request_its_generate_tokens(hybrid, layout, budget, kv, batch):
    paged = dict(kv="paged", block_size=4) if kv != "slots" else {}
    if kv == "paged-cached":
        paged["prefix_caching"] = True
    if kv == "paged-small":
        paged.update(num_blocks=17, max_len=64)
    prompts = [SYSTEM + "Say yes.", SYSTEM + "Say no.", *PROMPTS[1:]]
    check(hybrid, prompts, layout=layout, max_tokens_per_step=budget, max_batch_size=batch, **paged)


def test_the_hybrid_chat_scenario_validates_and_runs_clean(tmp_path):
    """scenarios/hybrid_chat.yaml (model: tiny-qwen35moe) validates and runs headless to exit 0 with no
    finding; its prefix hits restore checkpoints (about 40 s)."""
    import subprocess
    import sys
    from pathlib import Path

    from kvtui.record import read_recording
    from kvtui.scenario import load_scenario

    path = Path(__file__).parents[2] / "scenarios" / "hybrid_chat.yaml"
    assert load_scenario(path).model == "tiny-qwen35moe"
    recording = tmp_path / "hybrid.jsonl"
    out = subprocess.run([sys.executable, "-m", "kvtui.cli", "run", str(path), "--headless", "--record", str(recording)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    _, _, summary, _ = read_recording(recording)
    assert summary.contamination_total() == 0 and summary.reference_checked == 12
    assert summary.state_restores > 0 and summary.state_checkpoint_hits > 0 and summary.prefix_cache_hits > 0
