"""Parallel sampling (n > 1) on tiny models: one prefill forked into n sequences (slots: a copy of the
prompt's KV; paged: shared blocks with copy-on-write of the partial last block). Every sequence i equals
a solo run of its prompt with seed + i (vLLM's seeding of a request's children), and transformers' own
forward on a separate model instance (greedy: its generate); the cow_missing fault breaks exactly that."""

import random

import pytest
import torch
from helpers import assert_equals_solo, assert_matches_oracle, make_engine, oracle_model, oracle_tokens, solo
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtui.config import EngineConfig
from kvtui.engine import SamplingParams
from kvtui.engine.parallel import child_sampling
from kvtui.scenario import ScenarioError, parse_scenario

MAX_LEN = 96
PROMPT = [random.Random(1).randrange(250) for _ in range(21)]  # 21 tokens: a partial last block of 4 or 16


def run(loaded, submissions, config: EngineConfig):
    """submissions: (step, request id, prompt, SamplingParams). Returns (engine, {id: output ids}, reports,
    {id: finished report})."""
    engine = make_engine(loaded.model, config)
    pending, reports, finished = sorted(submissions, key=lambda s: s[0]), [], {}
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= len(reports):
            _, request_id, prompt, params = pending.pop(0)
            engine.submit(request_id, prompt, params)
        reports.append(engine.step())
        finished.update({f.request_id: f for f in reports[-1].finished})
        assert len(reports) < 3000
    return engine, {k: list(f.output_ids) for k, f in finished.items()}, reports, finished


@torch.inference_mode()
def hf_greedy(model, prompt, n):
    """transformers' own generate, greedy, on a separate model instance (no kvtui code)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def config(kv, layout, **kw):
    pool = dict(kv="paged", block_size=4, num_blocks=80) if kv == "paged" else dict(num_slots=8)
    return EngineConfig(max_len=MAX_LEN, layout=layout, **{**pool, **kw})


@pytest.mark.parametrize("kv", ["slots", "paged"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_every_sequence_equals_its_solo_run_and_transformers(tiny, kv, layout):
    loaded = tiny["tiny-llama"]
    oracle = oracle_model("tiny-llama", "eager")
    sampled = SamplingParams(temperature=1.0, seed=40, max_new_tokens=14, n=3)
    greedy = SamplingParams(max_new_tokens=10, n=2)
    other = [7, 8, 9, 10, 11]
    engine, out, reports, finished = run(loaded, [
        (0, "s", PROMPT, sampled), (0, "g", PROMPT[:13], greedy),
        (2, "plain", other, SamplingParams(max_new_tokens=6))], config(kv, layout))
    assert sorted(out) == ["0_g", "0_s", "1_g", "1_s", "2_s", "plain"]
    for i in range(3):
        params = child_sampling(sampled, i)
        assert params.seed == 40 + i and params.n == 1 and finished[f"{i}_s"].sampling == params
        assert out[f"{i}_s"] == solo(loaded, PROMPT, params), f"{i}_s differs from its solo run"
        theirs, gaps = oracle_tokens(oracle, PROMPT, params)
        assert_matches_oracle(out[f"{i}_s"], theirs, gaps, f"{i}_s")
    assert len({tuple(out[f"{i}_s"]) for i in range(3)}) == 3  # three seeds, three answers
    assert out["0_g"] == out["1_g"] == hf_greedy(oracle, PROMPT[:13], 10)
    assert out["plain"] == hf_greedy(oracle, other, 6)
    # each prompt was prefilled once: prefill tokens are the three prompts', not the five sequences'
    assert sum(r.prefill_tokens for r in reports) == len(PROMPT) + 13 + len(other)
    if kv == "paged":
        assert engine.kv.manager.copies == 2 + 1  # n - 1 copy-on-write copies of each partial block
        assert engine.kv.manager.tables == {} and engine.kv.manager.num_free == engine.kv.manager.num_usable


def test_paged_sequences_share_the_prompt_blocks_until_they_write(tiny):
    loaded = tiny["tiny-llama"]
    params = SamplingParams(temperature=1.0, seed=3, max_new_tokens=6, n=3)
    _, _, reports, _ = run(loaded, [(0, "s", PROMPT, params)], config("paged", "padded"))
    fork = next(r for r in reports if r.running and r.running[0].token_id is not None)
    tables = dict(fork.block_tables)
    assert sorted(tables) == ["0_s", "1_s", "2_s"] and len({tables[k] for k in tables}) == 1  # all shared
    shared = tables["0_s"]
    assert len(shared) == 6 and all(fork.block_state[b] == "3" for b in shared)  # 21 tokens in blocks of 4
    after = dict(reports[reports.index(fork) + 1].block_tables)
    assert [after[k][:5] for k in after] == [shared[:5]] * 3  # full blocks still shared
    assert len({after[k][5] for k in after}) == 3  # the partial block: two copies and the original
    assert shared[5] in {after[k][5] for k in after}


def test_a_sequence_without_a_free_slot_prefills_itself_and_still_equals_its_solo_run(tiny):
    loaded = tiny["tiny-llama"]
    params = SamplingParams(temperature=1.0, seed=9, max_new_tokens=8, n=3)
    _, out, reports, _ = run(loaded, [(0, "s", PROMPT, params)], config("slots", "padded", num_slots=2))
    fed = [e.query_tokens for r in reports for e in r.running if e.request_id == "2_s" and e.phase == "prefill"]
    assert sum(fed) == len(PROMPT)  # no slot at the fork: it waited and prefilled the prompt itself
    for i in range(3):
        assert out[f"{i}_s"] == solo(loaded, PROMPT, child_sampling(params, i))


def test_abort_and_rejection_reach_every_sequence(tiny):
    loaded = tiny["tiny-llama"]
    engine = make_engine(loaded.model, config("slots", "padded"))
    engine.submit("long", PROMPT, SamplingParams(max_new_tokens=MAX_LEN, n=2))
    engine.submit("a", PROMPT, SamplingParams(max_new_tokens=20, n=3))
    assert engine.sequence_ids("a") == ("0_a", "1_a", "2_a")
    first = engine.step()
    engine.abort("a")
    finished = {f.request_id: f for r in (first, engine.step()) for f in r.finished}
    assert {k: (f.finish_reason, f.code) for k, f in finished.items()} == {
        "0_long": ("rejected", "too_long"), "1_long": ("rejected", "too_long"),
        "0_a": ("abort", ""), "1_a": ("abort", ""), "2_a": ("abort", "")}
    assert not engine.has_unfinished() and engine.pool.num_free == engine.pool.num_slots
    assert engine.sequence_ids("a") == ("a",) and engine.families.members == {}  # forgotten once reported
    engine.submit("x", PROMPT, SamplingParams(n=2))
    with pytest.raises(ValueError, match="duplicate"):
        engine.submit("x", PROMPT, SamplingParams(n=2))


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_cow_missing_lets_a_sibling_overwrite_the_shared_block(tiny, layout):
    loaded = tiny["tiny-llama"]
    params = SamplingParams(temperature=1.0, seed=5, max_new_tokens=12, n=3)
    engine = make_engine(loaded.model, config("paged", layout, faults=frozenset({"cow_missing"})))
    engine.detect_taint = True
    engine.submit("s", PROMPT, params)
    reports = engine.run_until_done()
    out = {f.request_id: list(f.output_ids) for r in reports for f in r.finished}
    taint = {(t.request_id, s) for r in reports for t in r.taint for s in t.sources}
    assert engine.kv.manager.copies == 0
    assert taint and {v for v, _ in taint} < {"0_s", "1_s", "2_s"}
    assert all(s in {"0_s", "1_s", "2_s"} and s != v for v, s in taint)  # victim and source: siblings
    changed = {k for k in out if out[k] != solo(loaded, PROMPT, child_sampling(params, int(k[0])))}
    assert changed and changed <= {v for v, _ in taint}  # the victims drift; the last writer is unharmed


@st.composite
def workloads(draw):
    rng = random.Random(draw(st.integers(0, 2**31)))
    count = draw(st.integers(1, 4))
    subs = []
    for i in range(count):
        prompt = [rng.randrange(250) for _ in range(draw(st.integers(1, 30)))]
        temp = draw(st.sampled_from([0.0, 0.9]))
        params = SamplingParams(temperature=temp, seed=draw(st.integers(0, 2**31)), n=draw(st.integers(1, 4)),
                                max_new_tokens=draw(st.integers(1, 10)))
        subs.append((draw(st.integers(0, 6)), f"r{i}", prompt, params))
    kv = draw(st.sampled_from(["slots", "paged"]))
    if kv == "paged":
        block = draw(st.sampled_from([1, 4, 16]))
        least = -(-MAX_LEN // block) + 1  # one request of max_len and the null block
        extra = dict(block_size=block, prefix_caching=draw(st.booleans()),
                     num_blocks=draw(st.integers(least, 3 * least)))
    else:
        extra = dict(num_slots=draw(st.integers(1, 6)))
    cfg = config(kv, draw(st.sampled_from(["padded", "packed"])), max_batch_size=draw(st.integers(1, 8)),
                 max_tokens_per_step=draw(st.sampled_from([8, 1024])), **extra)
    return subs, cfg


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_parallel_loads_equal_solo(tiny, workload):
    subs, cfg = workload
    loaded = tiny["tiny-llama"]
    engine, out, _, finished = run(loaded, subs, cfg)
    for _, request_id, prompt, params in subs:
        for i in range(params.n):
            name = request_id if params.n == 1 else f"{i}_{request_id}"
            report = finished[name]
            assert_equals_solo(loaded, prompt, child_sampling(params, i), out[name], report.top2_gaps, report.draws,
                               name)
    if cfg.kv == "paged":
        assert engine.kv.manager.tables == {} and engine.kv.manager.num_free == engine.kv.manager.num_usable


def test_scenario_n_and_n_fraction_plan_and_cow_missing_needs_forks():
    from test_scenario_plan import FakeTokenizer

    from kvtui.scenario import plan_requests

    base = "max_requests: 40\nmodel: tiny-llama\nprompts: {kind: synthetic}\nsampling: {temperature: 0.5%s}"
    plain = plan_requests(parse_scenario(base % ""), FakeTokenizer())
    mixed = plan_requests(parse_scenario(base % ", n: 4, n_fraction: 0.5"), FakeTokenizer())
    assert [p.prompt_ids for p in plain] == [p.prompt_ids for p in mixed]  # n draws from its own stream
    assert [p.sampling.seed for p in plain] == [p.sampling.seed for p in mixed]
    ns = [p.sampling.n for p in mixed]
    assert set(ns) == {1, 4} and 10 <= ns.count(4) <= 30
    with pytest.raises(ScenarioError, match="cow_missing acts on the sequences of a request with n > 1"):
        parse_scenario("max_requests: 2\nmodel: tiny-llama\nengine: {kv: paged, faults: [cow_missing]}")


@st.composite
def mixed_sessions(draw):
    """Random scenarios mixing parallel sampling and structured output, slots or paged KV."""
    kv = draw(st.sampled_from(["slots", "paged"]))
    pool = (f"kv: paged, block_size: {draw(st.sampled_from([4, 16]))}, prefix_caching: "
            f"{str(draw(st.booleans())).lower()}" if kv == "paged" else f"slots: {draw(st.integers(1, 4))}")
    structured = draw(st.sampled_from(["", ', structured: {regex: "[a-z]{1,12}", fraction: 0.5}',
                                       ', structured: {choice: [alpha, beta], fraction: 0.7}']))
    return parse_scenario(f"""
seed: {draw(st.integers(0, 10_000))}
max_requests: {draw(st.integers(1, 6))}
model: tiny-llama
engine: {{{pool}, max_len: 96, layout: {draw(st.sampled_from(["padded", "packed"]))},
          max_batch_size: {draw(st.integers(1, 8))}}}
arrivals: {{process: poisson, rate_per_s: {draw(st.sampled_from([2.0, 50.0]))}}}
prompts: {{kind: synthetic, prompt_tokens: {{dist: uniform, min: 1, max: 30}}}}
output_tokens: {draw(st.integers(1, 10))}
sampling: {{temperature: {draw(st.sampled_from([0.0, 0.9]))}, n: {draw(st.integers(1, 3))},
           n_fraction: 0.6{structured}}}
""")


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mixed_sessions())
def test_random_sessions_mixing_n_and_structured_output_have_no_findings(tiny, spec):
    pytest.importorskip("xgrammar")
    from kvtui.session import Session

    session = Session(spec, tiny["tiny-llama"], clock="virtual")
    session.run()
    assert [e for e in session.contamination if e.kind in ("cross_request", "cross_tenant", "corruption")] == []
    assert session.summary.finish_reasons.get("rejected", 0) == 0 and session.observer("reference").checked > 0


@pytest.mark.smollm
def test_smollm2_paged_parallel_sampling_equals_solo_per_sequence(smollm2):
    ids = smollm2.tokenizer.encode("Write one line about the sea.")
    params = SamplingParams(temperature=0.8, seed=21, max_new_tokens=12, ignore_eos=True, n=3)
    cfg = EngineConfig(kv="paged", block_size=16, max_len=128, max_batch_size=4)
    engine, out, _, _ = run(smollm2, [(0, "s", ids, params), (1, "other", ids[:5], SamplingParams(max_new_tokens=6))],
                            cfg)
    for i in range(3):
        assert out[f"{i}_s"] == solo(smollm2, ids, child_sampling(params, i)), i
    assert engine.kv.manager.copies == (2 if len(ids) % 16 else 0)
