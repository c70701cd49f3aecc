"""kvtui's fused forward (kvtui/engine/fused.py) against transformers' own modules: which models take it,
that its hidden states and logits equal transformers' forward on a separate instance, and that the
detectors report the same findings on both paths (the truth-table loads of test_faults)."""

from dataclasses import replace

import pytest
import torch
from helpers import make_engine, oracle_model
from test_faults import scenario

from kvtui.config import EngineConfig
from kvtui.engine import SamplingParams
from kvtui.faults import FAULTS
from kvtui.model_kinds import ModelKind
from kvtui.session import Session


def test_llama_models_take_the_fused_forward_and_others_the_modules(tiny):
    config = EngineConfig(num_slots=2, max_len=64)
    assert make_engine(tiny["tiny-llama"].model, config).runner.forward_path == "fused"
    assert make_engine(tiny["tiny-llama"].model, replace(config, enforce_eager=True)).runner.forward_path == "modules"
    assert make_engine(tiny["tiny-gpt2"].model, config).runner.forward_path == "modules"


@pytest.mark.parametrize("kernel", ["linear", "tiled", "input_major", "prepacked", "zentorch"])
def test_the_models_own_linears_still_compute_the_same_after_the_relayout(kernel, monkeypatch):
    """The fused forward re-lays the model's q/k/v/o/gate/up/down weights for whichever kernel the CPU
    measurement chooses (forced here), holding each weight once: views into the fused tensors, or
    (prepacked) PackedSlice modules over the one packed weight. The modules' forward (model.generate,
    --enforce-eager) gives the logits of a separate untouched instance, and so does the fused step."""
    from kvtui.engine import linear
    from kvtui.models import build_tiny

    if kernel == "zentorch" and not linear.zentorch_available(torch.float32):
        pytest.skip("zentorch is not installed or cannot run here (pip install 'kvtui[zentorch]')")
    monkeypatch.setenv(linear.ENV, kernel)
    monkeypatch.setattr(linear, "TILE", 48)  # tiled: qkv (128 wide), o, gate_up, down and the head (259) in tiles
    model, _ = build_tiny("tiny-llama")  # a fresh instance: the kernel is chosen when it is first fused
    cfg = model.config
    engine = make_engine(model, num_slots=1, max_len=64)
    fused = model._kvtui_fused
    attn = model.model.layers[0].self_attn
    assert fused.kernel == kernel and fused.layers[0].qkv.kernel == kernel
    if kernel in linear.OPAQUE:
        assert type(attn.q_proj).__name__ == "PackedSlice" and attn.q_proj.fused is fused.layers[0].qkv
        assert not any("q_proj" in name for name, _ in model.named_parameters())  # no second copy kept
    else:
        assert attn.q_proj.weight.data_ptr() == fused.layers[0].qkv.weight.data_ptr()  # a view, not a copy
        width = attn.q_proj.in_features
        assert attn.q_proj.weight.stride() == ((1, cfg.hidden_size + 2 * attn.k_proj.out_features)
                                               if kernel == "input_major" else (width, 1))
    oracle = oracle_model("tiny-llama", "sdpa")
    ids = torch.tensor([[5, 9, 11, 40, 77, 3, 120]])
    with torch.inference_mode():
        ours = model(input_ids=ids).logits
        theirs = oracle(input_ids=ids).logits
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5), (ours - theirs).abs().max()
    state = engine.submit("r", ids[0].tolist(), SamplingParams(max_new_tokens=1, ignore_eos=True))
    kept = []
    sample = engine.output.sample
    engine.output.sample = lambda request, logits, *a, **k: kept.append(logits.clone()) or sample(request, logits,
                                                                                                   *a, **k)
    engine.step()
    assert state.prefill_done == 7 and torch.allclose(kept[0], theirs[0, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_step_logits_equal_transformers_forward_on_a_separate_instance(tiny, enforce_eager):
    """A batched prefill's last-position logits, per request, equal a separate instance's own forward
    on that prompt alone (sdpa), within float32 rounding."""
    prompts = [[5, 6, 7], list(range(30, 70)), [200, 3, 9, 14, 250, 1, 8, 8]]
    engine = make_engine(tiny["tiny-llama"].model, num_slots=3, max_len=64, enforce_eager=enforce_eager)
    logged = []
    original = engine.runner.forward

    def keep(*args, **kwargs):
        logits, state = original(*args, **kwargs)
        logged.append(logits.clone())
        return logits, state

    engine.runner.forward = keep
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, SamplingParams(max_new_tokens=1, ignore_eos=True))
    engine.step()
    oracle = oracle_model("tiny-llama", "sdpa")
    with torch.inference_mode():
        theirs = torch.stack([oracle(input_ids=torch.tensor([p])).logits[0, -1] for p in prompts])
    assert logged[0].shape == theirs.shape
    assert torch.allclose(logged[0], theirs, atol=1e-5, rtol=1e-5), (logged[0] - theirs).abs().max()


CASES = [(name, layout, kv) for name, fault in FAULTS.items() for layout in fault.layouts for kv in fault.kv
         if name != "racy_threads" and ModelKind.DECODER_ONLY in fault.models
         and not name.startswith("lora_")]  # adapters run on the fused forward only: --enforce-eager refuses them  # the fused forward runs text models  # racy_threads runs per-thread forwards through the same layers; below


@pytest.mark.parametrize("name,layout,kv", CASES)
def test_every_fault_gives_the_same_reports_on_both_paths(tiny, name, layout, kv):
    """The detectors see on the fused forward what they see on transformers' modules: the same
    detectors, kinds, victims, sources and steps for every fault of the catalogue."""
    spec = scenario(layout, faults=[name], kv=kv)
    reports = {}
    for eager in (False, True):
        session = Session(spec, tiny["tiny-llama"], clock="virtual", engine_overrides={"enforce_eager": eager})
        session.run()
        assert session.engine.runner.forward_path == ("modules" if eager else "fused")
        reports[eager] = sorted((e.detector, e.kind, e.victim, e.source, e.step) for e in session.contamination)
    assert reports[False] == reports[True]
    assert reports[False], f"{name} gave no report at all"


def test_racy_threads_is_caught_on_the_fused_forward_too(tiny):
    spec = scenario("padded", faults=["racy_threads"])
    session = Session(spec, tiny["tiny-llama"], clock="virtual")
    session.run()
    assert session.engine.runner.forward_path == "fused"
    assert {e.kind for e in session.contamination if e.counts} >= {"cross_request"}


@pytest.mark.smollm
def test_smollm2_fused_tokens_equal_transformers_forward(smollm2):
    """On the real weights (SmolLM2-135M, float32): three prompts of different lengths batched
    together on the fused forward decode the tokens a separate instance's own forward (sdpa) picks
    greedily at every position of prompt + answer."""
    tok = smollm2.tokenizer
    texts = ["The capital of France is", "Remember this passphrase: VELVET-ORCHID-42.", "def fib(n):"]
    prompts = [tok(t)["input_ids"] for t in texts]
    engine = make_engine(smollm2.model, num_slots=3, max_len=64)
    assert engine.runner.forward_path == "fused"
    states = [engine.submit(f"r{i}", p, SamplingParams(max_new_tokens=6, ignore_eos=True)) for i, p in enumerate(prompts)]
    engine.run_until_done()
    from kvtui.models import load_model

    other = load_model("default", dtype=torch.float32, progress=False).model.eval()
    other.set_attn_implementation("sdpa")
    for p, s in zip(prompts, states):
        ids = torch.tensor([p + list(s.generated_ids[:-1])])
        with torch.inference_mode():
            greedy = other(input_ids=ids).logits[0, len(p) - 1 :].argmax(-1).tolist()
        assert greedy == list(s.generated_ids)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_measured_decode_attention_equals_transformers_eager_weights(tiny, layout, enforce_eager):
    """attention_flow's sums on a decode step (one batched exact-eager attention over the rows' slots)
    equal transformers' own eager attention weights on a separate instance, summed over layers and
    heads, for each request run alone; and a slot's stale keys past a row's end add nothing."""
    prompts = [[5, 6, 7], list(range(30, 52)), [200, 3, 9, 14, 250, 1, 8, 8]]
    engine = make_engine(tiny["tiny-llama"].model, num_slots=3, max_len=64, layout=layout, enforce_eager=enforce_eager)
    engine.pool.keys[0][:, :, 40:] = float("nan")  # garbage past every row's end must not reach anything
    engine.pool.values[0][:, :, 40:] = float("nan")
    engine.measure_flow = True
    states = []
    original = engine.runner.forward

    def keep(*args, **kwargs):
        logits, state = original(*args, **kwargs)
        states.append(state)
        return logits, state

    engine.runner.forward = keep
    requests = [engine.submit(f"r{i}", p, SamplingParams(max_new_tokens=2, ignore_eos=True)) for i, p in enumerate(prompts)]
    engine.step()  # the prefill
    engine.step()  # one decode token per request: the measured decode path
    decode = states[1]
    assert all(s.num_tokens == 1 for s in decode.batch.segments) and decode.flow_plan("cpu") is not None
    oracle = oracle_model("tiny-llama", "eager")
    for seg, prompt, request in zip(decode.batch.segments, prompts, requests):
        ids = torch.tensor([prompt + [request.generated_ids[0]]])
        with torch.inference_mode():
            weights = oracle(input_ids=ids, output_attentions=True).attentions  # per layer [1, Hq, L, L]
        theirs = sum(w[0, :, -1].sum(dim=0) for w in weights)  # [L]
        ours = decode.attn_sum[seg.row, seg.q_start, seg.key_start : seg.key_start + seg.end_pos]
        assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()
        assert decode.attn_sum[seg.row, seg.q_start].sum().item() == pytest.approx(decode.flow_terms, rel=1e-5)
    assert all(torch.isfinite(torch.tensor(list(r.top2_gaps))).all() for r in requests)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_nan_keys_a_finished_request_left_in_its_slot_never_reach_the_next_owner(layout, monkeypatch):
    """Decode chunks share one attention call over a span of slots, and a masked key adds exactly 0 only if
    it is finite. A request whose layer-0 K/V come out NaN (forced here on its writes) leaves them in its
    slot; the request that reuses the slot, shorter, decodes next to a longer one (so NaN keys would lie
    past its end inside the shared call's range, had the pool not zeroed them), and still answers what
    a separate instance's `generate` answers."""
    from kvtui.models import build_tiny

    model, _ = build_tiny("tiny-llama")
    engine = make_engine(model, num_slots=2, max_len=64, layout=layout, max_batch_size=2)
    layer = model._kvtui_fused.layers[0]
    qkv, poison = layer.qkv, {"on": True}

    def poisoned(x):
        out = qkv(x)
        if poison["on"]:
            out[..., layer.q_size:] = float("nan")  # this request's K and V
        return out

    monkeypatch.setattr(layer, "qkv", poisoned)
    first = engine.submit("a", list(range(10, 50)), SamplingParams(max_new_tokens=1, ignore_eos=True))
    engine.run_until_done()
    assert first.finish_reason == "length" and torch.isnan(engine.pool.keys[0][0, :, :40]).all()  # and later layers
    poison["on"] = False
    prompts = [[5, 6, 7], list(range(60, 80))]
    states = [engine.submit(f"r{i}", p, SamplingParams(max_new_tokens=6, ignore_eos=True)) for i, p in enumerate(prompts)]
    engine.run_until_done()
    oracle = oracle_model("tiny-llama", "sdpa")
    for p, state in zip(prompts, states):
        expected = oracle.generate(torch.tensor([p]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
        assert list(state.generated_ids) == expected[0, len(p):].tolist()
