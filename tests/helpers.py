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
