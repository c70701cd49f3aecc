"""Shared pieces of the scenario schema: the strict pydantic base and limits."""

from __future__ import annotations

import pydantic

# Named isolation faults (DESIGN.md section 4); the engine's faults module implements them.
FAULT_NAMES = (
    "shared_cache", "racy_threads", "no_request_mask", "unmasked_cache_padding",
    "shared_position_offset", "stale_slot", "causal_offset", "fp16_cache",
)
MAX_PLANNED = 100_000  # most requests one scenario may plan
MAX_RATE = 10_000.0  # requests per second
MAX_SECONDS = 7 * 24 * 3600.0  # longest duration or timestamp (seconds)


class Strict(pydantic.BaseModel):
    """Base of every scenario model: frozen, unknown keys rejected, no silent type coercion
    (a quoted "4" is not a number), no inf/nan."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)
