"""Helpers of the batch-invariance tests: run requests batched (joining at chosen steps) and each alone,
keeping every logits row the sampler saw, so a test can compare them bit for bit."""

from __future__ import annotations

from dataclasses import replace

import torch
from helpers import make_engine

from kvtui.config import EngineConfig
from kvtui.engine import SamplingParams


def run_keeping_logits(model, config: EngineConfig, requests: list[tuple[list[int], SamplingParams, int]],
                       image_encoder=None) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
    """Run (prompt ids or RequestInput, sampling, join step) requests in one engine (with `image_encoder`
    for pictures), each submitted once the engine has run `join step` steps. Returns (request id ->
    generated ids, request id -> the [V] float32 logits row of each generated token, as the forward gave
    it)."""
    engine = make_engine(model, config, image_encoder=image_encoder)
    kept: dict[str, list[torch.Tensor]] = {}
    sample = engine.output.sample

    def keep(request, logits, *args, **kwargs):
        kept.setdefault(request.request_id, []).append(logits.clone())
        return sample(request, logits, *args, **kwargs)

    engine.output.sample = keep
    states, pending, step = {}, sorted(enumerate(requests), key=lambda item: item[1][2]), 0
    while pending or engine.has_unfinished():
        while pending and pending[0][1][2] <= step:
            i, (prompt, sampling, _) = pending.pop(0)
            states[f"r{i}"] = engine.submit(f"r{i}", prompt, sampling)
        if engine.has_unfinished():
            engine.step()
        step += 1
    return {rid: list(s.generated_ids) for rid, s in states.items()}, kept


def solo_config(config: EngineConfig, max_len: int) -> EngineConfig:
    """The engine a request runs alone in: one slot of its own, padded, no prefix cache, whole prefill."""
    return replace(config, num_slots=1, max_batch_size=1, max_len=max_len, kv="slots", num_blocks=None,
                   prefix_caching=False, layout="padded", padding_side="right", max_tokens_per_step=1024)


def first_mismatch(batched: list[torch.Tensor], solo: list[torch.Tensor]) -> tuple[int, float] | None:
    """(token index, largest |difference|) of the first logits row that is not bitwise equal, or None."""
    for i, (a, b) in enumerate(zip(batched, solo)):
        if not torch.equal(a, b):
            return i, float((a - b).abs().nan_to_num(float("inf")).max())
    return None
