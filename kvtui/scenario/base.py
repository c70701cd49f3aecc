"""Shared pieces of the scenario schema: the strict pydantic base and limits."""

from __future__ import annotations

import pydantic

from kvtui.faults import FAULT_NAMES  # the catalogue owns the fault names

__all__ = ["FAULT_NAMES", "MAX_PLANNED", "MAX_PROMPT_CHARS", "MAX_RATE", "MAX_SECONDS", "Strict"]
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
