"""Per-request token choice: greedy, or seeded temperature / top-k / top-p sampling.

Each sampling request owns a torch.Generator seeded from its SamplingParams.seed and draws exactly
one uniform number per generated token, so its tokens do not depend on its slot, its row or its
neighbours in the batch: the same request run solo draws the same numbers.
"""

from __future__ import annotations

import torch

from kvtui.engine.request import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A CPU generator seeded with params.seed, or None for greedy requests."""
    if params.greedy:
        return None
    generator = torch.Generator(device="cpu")
    generator.manual_seed(params.seed)
    return generator


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token id from one row of logits.

    Args:
        logits: [V] float32 logits of the last position of one request.
        params: greedy when temperature == 0, else temperature, top_k, top_p.
        generator: the request's own generator (None for greedy).
    Returns:
        The token id (int). Ties in greedy mode go to the lowest id (torch.argmax).
    Raises:
        ValueError: a sampling request without a generator.
    """
    if params.greedy:
        return int(torch.argmax(logits))
    if generator is None:
        raise ValueError("sampling with temperature > 0 needs the request's generator")
    logits = logits.float().cpu()
    scaled = logits / params.temperature
    if not torch.isfinite(scaled).all() and torch.isfinite(logits).all():
        # a temperature so small (1e-300 is 0 in float32) that the division overflows to inf, and softmax
        # to NaN: take the limit instead, every probability on the top logit (shared by exact ties)
        scaled = torch.where(logits == logits.max(), 0.0, -torch.inf)
    probs = torch.softmax(scaled, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if 0 < params.top_k < keep.numel():  # a top_k at or past the vocabulary keeps every token
        keep[params.top_k :] = False
    if params.top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        keep &= before < params.top_p
    kept = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    cdf = torch.cumsum(kept / kept.sum(), dim=-1)
    u = torch.rand((), generator=generator, dtype=torch.float64).item()
    index = int(torch.searchsorted(cdf.double(), torch.tensor([u], dtype=torch.float64)).clamp(max=len(cdf) - 1))
    return int(order[index])
