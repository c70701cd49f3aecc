"""Masked keys contribute exactly zero, whatever they hold.

A slot's previous owner may leave NaN or inf past the next owner's length (an fp16 overflow, a
poisoned embedding row). The next owner, batched beside a longer request, must still produce its
solo tokens, in every layout and attention path. The oracle is transformers' own attention on a
separate model instance, greedy, with no cache and no kvtui code.
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_engine

from kvtui.config import EngineConfig
from kvtui.engine import Engine, SamplingParams
from kvtui.engine.attention import kvtui_attention
from kvtui.models import build_tiny

GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def oracle():
    """A separate tiny-llama instance (same seed, same weights) on transformers' eager attention."""
    model, _ = build_tiny("tiny-llama")
    model.set_attn_implementation("eager")
    return model.eval()


@torch.inference_mode()
def reference_tokens(model, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from re-running the whole sequence each step: no cache, transformers' attention."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


def poison(engine: Engine, slot: int, start: int, value: float) -> None:
    """Leave `value` in every layer's K and V of `slot` from position `start` on, written straight into the
    pool's tensors as a previous owner, a buggy writer or stray memory could leave it: none of the pool's
    own bookkeeping is told (test_fused_forward leaves NaN there through real writes)."""
    for layer in range(engine.pool.num_layers):
        engine.pool.keys[layer][slot, :, start:] = value
        engine.pool.values[layer][slot, :, start:] = value


CLEAN = [17, 42, 99, 7, 250]  # 5 tokens
LONG = [(i * 37) % 250 + 3 for i in range(30)]  # 30 tokens


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("layout,side", [("padded", "right"), ("padded", "left"), ("packed", "right")])
@pytest.mark.parametrize("measure_flow", [False, True], ids=["sdpa", "eager-flow"])
def test_a_clean_request_in_a_poisoned_slot_gives_its_solo_tokens(tiny, oracle, value, layout, side, measure_flow):
    loaded = tiny["tiny-llama"]
    engine = make_engine(loaded.model, num_slots=2, max_len=64, layout=layout, padding_side=side)
    engine.measure_flow = measure_flow
    engine.submit("previous", [5, 6, 7, 8, 9, 10], SamplingParams(max_new_tokens=2, ignore_eos=True))
    engine.run_until_done()
    assert engine.pool.previous_owner[0] == "previous"
    poison(engine, slot=0, start=5, value=value)  # what the previous owner left past position 5
    clean = engine.submit("clean", CLEAN, GREEDY)  # takes slot 0 (lowest free)
    long = engine.submit("long", LONG, GREEDY)  # slot 1: the batch's keys run to 30+ positions
    reports = engine.run_until_done()
    assert reports[0].running[0].slot == 0 and reports[0].rows == (2 if layout == "padded" else 1)
    assert not any(r.nonfinite for report in reports for r in report.running)
    assert clean.generated_ids == reference_tokens(oracle, CLEAN, 8)
    assert long.generated_ids == reference_tokens(oracle, LONG, 8)


def test_the_mask_path_ignores_non_finite_values_at_masked_keys_and_keeps_them_where_weighed():
    """The attention function's mask path (used while a mask fault is on), on one layer's tensors."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    allowed = torch.ones(2, 1, 3, 6, dtype=torch.bool)
    allowed[0, :, :, 4:] = False  # row 0 may not see keys 4-5
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    clean, _ = kvtui_attention(None, q, k, v, mask)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[0, :, 4:] = float("nan")
    v_bad[0, :, 4:] = float("inf")
    out, _ = kvtui_attention(None, q, k_bad, v_bad, mask)
    assert torch.equal(out, clean)  # exactly: masked cells add zero
    v_bad[1, :, 2] = float("nan")  # row 1 may see key 2: its NaN must show
    out, _ = kvtui_attention(None, q, k_bad, v_bad, mask)
    assert torch.isnan(out[1]).all() and torch.equal(out[0], clean[0])


def test_a_non_finite_read_from_another_request_is_a_cross_request_finding_naming_it(tmp_path):
    """r000's prompt holds a token whose embedding row is NaN, so its K/V are NaN from there on. With
    stale_slot on, r001 takes r000's slot and continues from its KV: its logits turn NaN. Every
    detector names r000 instead of going blind: slot_taint and attention_flow from the non-finite
    positions' writer, reference from the replay alone (clean) and its suspects; one finding."""
    from kvtui.models import load_model
    from kvtui.scenario import parse_scenario
    from kvtui.session import Session

    loaded = load_model("tiny-llama", progress=False)  # a separate instance: we poison its embeddings
    poisoned = loaded.tokenizer.encode("~")[0]
    with torch.no_grad():
        loaded.model.get_input_embeddings().weight[poisoned] = float("nan")
    (tmp_path / "prompts.txt").write_text("ab~cdefgh\nhello there\n")
    spec = parse_scenario("""
name: nan-neighbour
max_requests: 2
model: tiny-llama
engine: {slots: 1, max_len: 64, faults: [stale_slot]}
arrivals: {process: constant, rate_per_s: 20}
prompts: {kind: file, path: prompts.txt}
output_tokens: 4
sampling: {ignore_eos: true}
""", base_dir=tmp_path)
    session = Session(spec, loaded)
    summary = session.run()
    on_r001 = [e for e in session.contamination if e.victim == "r001"]
    assert {e.detector for e in on_r001} == {"slot_taint", "attention_flow", "reference"}
    assert {(e.kind, e.source) for e in on_r001} == {("cross_request", "r000")}
    nonfinite = [e for e in on_r001 if e.evidence.nonfinite]
    assert {e.detector for e in nonfinite} == {"slot_taint", "attention_flow", "reference"}
    assert {e.finding for e in on_r001} == {2}  # r000's own corruption is finding 1
    on_r000 = [e for e in session.contamination if e.victim == "r000"]
    assert on_r000 and {e.kind for e in on_r000} == {"corruption"} and {e.source for e in on_r000} == {None}
    assert summary.findings_by_kind == {"corruption": 1, "cross_request": 1}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_poisoned_slot_is_harmless_in_half_precision_too(dtype):
    """The same NaN tail with the model in float16 / bfloat16: the clean request's tokens equal its run in a
    fresh engine (same dtype, nothing poisoned), with and without the measuring (eager) path."""
    from kvtui.models import load_model

    model = load_model("tiny-llama", dtype=dtype, progress=False).model
    for measure_flow in (False, True):
        fresh = make_engine(model, num_slots=1, max_len=64)
        alone = fresh.submit("clean", CLEAN, GREEDY)
        fresh.run_until_done()
        engine = make_engine(model, num_slots=2, max_len=64)
        engine.measure_flow = measure_flow
        engine.submit("previous", [5, 6, 7, 8, 9, 10], SamplingParams(max_new_tokens=2, ignore_eos=True))
        engine.run_until_done()
        poison(engine, slot=0, start=5, value=float("nan"))
        clean = engine.submit("clean", CLEAN, GREEDY)
        engine.submit("long", LONG, GREEDY)
        engine.run_until_done()
        assert clean.generated_ids == alone.generated_ids and len(clean.generated_ids) == 8


@pytest.mark.parametrize("path", ["sdpa", "kernel"])
def test_decode_steps_batch_their_rows_in_one_call_over_a_nan_tail_too(tiny, oracle, monkeypatch, path):
    """The fast decode paths run whether or not a slot holds NaN past its next owner's length, and give the
    oracle's tokens both ways: SDPA in one call over the slots' view, each row masked past its own length (the
    pool zeroes what a row reads past its own length before the shared call reads it), and kvtui's C++ kernel
    (engine/cpu_kernels.py), one call per layer that reads each row's own keys and nothing past them."""
    from kvtui.engine import attention, cpu_kernels

    if path == "kernel" and cpu_kernels.problem() is not None:
        pytest.skip(f"kvtui's decode kernel cannot run here: {cpu_kernels.problem()}")
    monkeypatch.setenv(cpu_kernels.ENV, path)
    calls = []
    module, name = (attention, "_decode_span") if path == "sdpa" else (cpu_kernels, "decode_attention")
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(1) or real(*a))

    def run(poisoned: bool):
        engine = make_engine(tiny["tiny-llama"].model, num_slots=3, max_len=64)
        engine.submit("previous", [5, 6, 7, 8, 9, 10], SamplingParams(max_new_tokens=2, ignore_eos=True))
        engine.run_until_done()
        calls.clear()  # the previous request's own decode step
        if poisoned:
            poison(engine, slot=0, start=5, value=float("nan"))
        states = [engine.submit(name, prompt, GREEDY) for name, prompt in (("a", CLEAN), ("b", LONG), ("c", LONG[:12]))]
        engine.run_until_done()
        return [s.generated_ids for s in states]

    expected = [reference_tokens(oracle, p, 8) for p in (CLEAN, LONG, LONG[:12])]
    assert run(poisoned=False) == expected and len(calls) == 7 * 2  # 7 decode steps x 2 layers, batched
    calls.clear()
    assert run(poisoned=True) == expected and len(calls) == 7 * 2  # the NaN tail: batched all the same


# -- unused KV memory filled with NaN / inf before any request arrives ----------------------------------------------

FILL_PROMPTS = [[5, 6, 7], LONG, LONG[:12], list(range(60, 80))]
FILL_ARRIVALS = [0, 0, 0, 3]  # the last one arrives while the others decode: a step with prefill and decode chunks
FILL_NEW = [8, 4, 8, 8]  # r1 ends first: its free slot then lies inside the others' span of slots, read and dropped


def fill_unused(pool, keys: float, values: float) -> None:
    """Write `keys` / `values` straight into every layer's K / V of the whole pool (every slot or block, the
    null block too): what an earlier process, a buggy writer or stray memory could leave there. Nothing of
    the pool's own bookkeeping is told."""
    for layer in range(pool.num_layers):
        pool.keys[layer].fill_(keys)
        pool.values[layer].fill_(values)


@pytest.mark.parametrize("fill", [(float("nan"), float("nan")), (float("inf"), float("-inf")),
                                  (float("-inf"), float("inf"))], ids=["nan", "inf,-inf", "-inf,inf"])
@pytest.mark.parametrize("kv", ["slots", "paged"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("path", ["fused", "eager", "invariant", "flow"])
@pytest.mark.parametrize("decode", ["kernel", "sdpa"])
def test_unused_kv_filled_with_nan_or_inf_before_requests_arrive_changes_no_answer(tiny, fill, kv, layout, path,
                                                                                   decode, monkeypatch):
    """Every slot or block of a fresh engine's pool holds NaN or +-inf in K and V before the first request
    arrives. Requests of 3 to 30 prompt tokens then run batched (decode rows of different lengths, and a
    late arrival whose prefill shares steps with the others' decodes), on each attention path: the fused
    forward, transformers' own modules (enforce_eager), the batch-invariant mode and the attention_flow
    measurement. Each request's greedy tokens equal transformers' own `generate` on a separate instance,
    and no step reports a non-finite logit. Over slots the decode rows share one call over a span of
    slots (padding and the free slot between them included) on every path but the batch-invariant one, or,
    on kvtui's C++ decode kernel, in one call that reads each row's own keys only."""
    from helpers import oracle_model

    from kvtui.engine import attention, cpu_kernels

    monkeypatch.setenv(cpu_kernels.ENV, decode)  # decode rows on kvtui's kernel, or on SDPA (the fallback)
    spans, real, kernel_rows, real_kernel = [], attention._span_plan, [], cpu_kernels.decode_attention
    monkeypatch.setattr(cpu_kernels, "decode_attention",
                        lambda q, *a, **kw: kernel_rows.append(q.shape[0]) or real_kernel(q, *a, **kw))

    def spy(rows, *args):
        plan = real(rows, *args)
        if plan is not None:
            spans.append((plan[1] - plan[0], len(rows)))  # slots the call reads, rows of the step in it
        return plan

    monkeypatch.setattr(attention, "_span_plan", spy)
    config = EngineConfig(num_slots=4, max_len=64, max_batch_size=4, layout=layout, max_tokens_per_step=24,
                          kv=kv, block_size=4, enforce_eager=path == "eager", batch_invariant=path == "invariant")
    engine = make_engine(tiny["tiny-llama"].model, config)
    engine.measure_flow = path == "flow"
    fill_unused(engine.pool, *fill)
    states, reports, waiting = {}, [], list(range(len(FILL_PROMPTS)))
    while waiting or engine.has_unfinished():
        while waiting and FILL_ARRIVALS[waiting[0]] <= len(reports):
            i = waiting.pop(0)
            states[i] = engine.submit(f"r{i}", FILL_PROMPTS[i], SamplingParams(max_new_tokens=FILL_NEW[i],
                                                                               ignore_eos=True))
        reports.append(engine.step())
        assert len(reports) < 200, "the engine did not finish"
    assert any(len(r.running) == 4 for r in reports)  # the late arrival ran beside the other three
    oracle = oracle_model("tiny-llama", "sdpa")
    for i, prompt in enumerate(FILL_PROMPTS):
        with torch.inference_mode():
            out = oracle.generate(torch.tensor([prompt]), max_new_tokens=FILL_NEW[i], min_new_tokens=FILL_NEW[i],
                                  do_sample=False, pad_token_id=0)
        assert list(states[i].generated_ids) == out[0, len(prompt):].tolist(), f"r{i}"
    assert [r.request_id for report in reports for r in report.running if r.nonfinite] == []
    kernel = decode == "kernel" and cpu_kernels.problem() is None and kv == "slots" and path in ("fused", "eager", "flow")
    if kernel:  # kvtui's C++ kernel (the suite forces it where it builds): each row over its own keys only
        assert 3 in kernel_rows and spans == []  # slots 0, 2 and 3 decode in one call; slot 1 never read
    elif kv == "slots" and path != "invariant":
        assert (4, 3) in spans  # slots 0, 2 and 3 decode: slot 1, free, read and dropped
    else:
        assert spans == [] and kernel_rows == []  # paged KV and the batch-invariant mode: own positions only
