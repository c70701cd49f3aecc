"""reference: each finished request's tokens vs the same request run solo (batch of one, fresh
cache, same sampling seed). The first divergent token is reported with both texts; when the top-2
logit gap at that token (the smaller of the batched and the solo run's) is within the dtype's
tolerance, the divergence is a near tie flipped by numerical batch variance: kind `numeric`, not
contamination. Solo runs are cached by (model, dtype, prompt, sampling) and computed off the
engine's critical path: queued at finish, run when the session is idle or at the end.

Tolerances (logits): float32 1e-3 (batched-vs-solo noise measured here is under 1e-5),
float16 0.1, bfloat16 0.5 (measured on SmolLM2: bf16 greedy batch 16 vs batch 1 agrees on only 9 of 16).
"""

from __future__ import annotations

import torch

from kvtui.config import EngineConfig
from kvtui.engine import Engine
from kvtui.events import Contamination, ReferenceEvidence

TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6, torch.float16: 0.1, torch.bfloat16: 0.5}


def numeric_tolerance(dtype: torch.dtype) -> float:
    """Top-2 logit gap under which a divergence counts as numeric for `dtype` (logits)."""
    return TOLERANCE.get(dtype, 0.5)


class ReferenceDetector:
    """Queue finished requests; `drain()` runs their solo references and yields events."""

    _cache: dict = {}

    def __init__(self, loaded, tokenizer) -> None:
        self.loaded = loaded
        self.tokenizer = tokenizer
        self.tolerance = numeric_tolerance(loaded.dtype)
        self.queue: list[tuple[str, list[int], list[int], list[float], object, list[int]]] = []

    def on_finish(self, request_id: str, prompt_ids, output_ids, gaps, sampling, steps) -> None:
        if output_ids:
            self.queue.append((request_id, list(prompt_ids), list(output_ids), list(gaps), sampling, list(steps)))

    def solo(self, prompt_ids: list[int], sampling) -> tuple[list[int], list[float]]:
        """Solo tokens and top-2 gaps of `prompt_ids` (cached). The engine runs with no EOS so the solo
        run always covers max_new_tokens; comparisons stop at the batched output's length."""
        key = (self.loaded.model_id, str(self.loaded.dtype), tuple(prompt_ids), sampling)
        if key not in self._cache:
            engine = Engine(self.loaded.model, EngineConfig(num_slots=1, max_batch_size=1,
                                                            max_len=len(prompt_ids) + sampling.max_new_tokens + 1),
                            eos_token_ids=())
            state = engine.submit("reference", prompt_ids, sampling)
            engine.run_until_done()
            self._cache[key] = (list(state.generated_ids), list(state.top2_gaps))
        return self._cache[key]

    def drain(self, t: float, limit: int | None = None) -> list[Contamination]:
        """Check up to `limit` queued requests (all when None); return their events."""
        events = []
        while self.queue and (limit is None or limit > 0):
            request_id, prompt, output, gaps, sampling, steps = self.queue.pop(0)
            limit = None if limit is None else limit - 1
            reference, ref_gaps = self.solo(prompt, sampling)
            index = next((i for i, (a, b) in enumerate(zip(output, reference)) if a != b), None)
            if index is None:
                continue
            gap = min(gaps[index] if index < len(gaps) else float("inf"), ref_gaps[index])
            kind = "numeric" if gap <= self.tolerance else "corruption"
            decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
            events.append(Contamination(
                t=t, step=steps[index] if index < len(steps) else -1, detector="reference", kind=kind,
                victim=request_id, source=None,
                evidence=ReferenceEvidence(token_index=index, batched_token=output[index], solo_token=reference[index],
                                           top2_gap=round(gap, 6), tolerance=self.tolerance,
                                           batched_text=decode(output), solo_text=decode(reference[: len(output)]))))
        return events
