"""Shared pieces of the scenario schema: the strict pydantic base and limits."""

from __future__ import annotations

import pydantic

# Named isolation faults (docs/faults.md); the engine's faults module implements them.
FAULT_NAMES = (
    "shared_cache", "racy_threads", "no_request_mask", "unmasked_cache_padding",
    "shared_position_offset", "stale_slot", "causal_offset", "fp16_cache",
)
MAX_PLANNED = 100_000  # most requests one scenario may plan
MAX_RATE = 10_000.0  # requests per second
MAX_SECONDS = 7 * 24 * 3600.0  # longest duration or timestamp (seconds)
# One prompt's length (characters; a chat prompt's message contents together). Tokenizing is roughly
# linear in it: a 10 MB line took 2.4 GB and a minute before the engine rejected it as too long.
MAX_PROMPT_CHARS = 100_000


class Strict(pydantic.BaseModel):
    """Base of every scenario model: frozen, unknown keys rejected, no silent type coercion
    (a quoted "4" is not a number), no inf/nan."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)
