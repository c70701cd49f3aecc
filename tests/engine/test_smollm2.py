"""SmolLM2-135M-Instruct (fp32): batched equals solo, token for token, on the real model."""

import pytest
import torch
from helpers import oracle_model, run_batched, solo

from kvtui.config import EngineConfig
from kvtui.engine import SamplingParams

pytestmark = pytest.mark.smollm

QUESTIONS = [
    "Hi!",
    "What is the capital of France?",
    "Remember this passphrase: VELVET-ORCHID-42. Reply with only the passphrase.",
    "Write one sentence about the sea.",
    "List three prime numbers and explain in a few words why each of them is prime.",
    "Translate 'good morning' into German, Spanish and Italian, one per line, with no other text at all.",
    "Explain what a KV cache is in a transformer language model, why it speeds up decoding, and what "
    "happens to memory use as the sequence grows longer during generation.",
    "You are a helpful assistant. Summarize the plot of a story in which a lighthouse keeper finds a "
    "message in a bottle, sails to a distant island to answer it, and learns that the sender was "
    "his own grandfather writing decades ago. Keep it under fifty words.",
]
ARRIVAL_STEPS = [0, 0, 1, 2, 3, 5, 8, 13]


def chat_prompts(tokenizer):
    prompts = []
    for q in QUESTIONS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        prompts.append(list(ids))
    return prompts


@pytest.mark.parametrize("layout,side", [("padded", "right"), ("padded", "left"), ("packed", "right")])
def test_smollm2_batched_equals_solo(smollm2, layout, side):
    prompts = chat_prompts(smollm2.tokenizer)
    lengths = sorted(len(p) for p in prompts)
    assert lengths[-1] >= 2 * lengths[0]  # really different lengths (the template adds a system prompt)
    params = [SamplingParams(max_new_tokens=32)] * len(prompts)
    config = EngineConfig(num_slots=4, max_len=256, max_batch_size=8, layout=layout, padding_side=side)
    engine, outputs, reports = run_batched(smollm2, prompts, params, ARRIVAL_STEPS, config)
    oracle = oracle_model("default", "sdpa")  # transformers' own attention, a separate instance, its own cache
    for i, prompt in enumerate(prompts):
        assert outputs[i] == solo(smollm2, prompt, params[i]), f"prompt {i} ({QUESTIONS[i][:30]!r}) differs"
        theirs = generate(oracle, prompt, 32)
        assert outputs[i][: len(theirs)] == theirs, f"prompt {i} ({QUESTIONS[i][:30]!r}) differs from transformers"
    assert max(engine.pool.times_used) >= 2  # 8 requests through 4 slots
    assert max(len(r.running) for r in reports) >= 3  # really batched


@torch.inference_mode()
def generate(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy `generate` (its own cache and attention) up to EOS, EOS excluded."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    tokens = out[0, len(prompt):].tolist()
    return tokens[: next((i for i, t in enumerate(tokens) if t in eos), len(tokens))]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_smollm2_solo_matches_transformers_generate(smollm2, attn):
    prompt = chat_prompts(smollm2.tokenizer)[2]
    ours = solo(smollm2, prompt, SamplingParams(max_new_tokens=16))
    theirs = generate(oracle_model("default", attn), prompt, 16)  # a separate instance on its own attention
    assert len(theirs) >= 10
    assert ours[: len(theirs)] == theirs
    assert "VELVET-ORCHID-42" in smollm2.tokenizer.decode(ours)
