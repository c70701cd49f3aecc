"""LoRA adapters in a scenario: which adapter each request runs under, and reloads on the timeline.

YAML `lora: {adapters: [lora-a, lora-b, none], assign: round_robin}`: each request runs under one of the
listed adapters (`none`: the base model), in turn or drawn by the seed (its own random stream, so the
rest of the plan stays put). The names are kvtui's built-in local adapters (kvtui/models/lora.py: made
once per model in kvtui's cache with a fixed seed). A timeline event `set: {lora.reload: lora-a}` loads
that adapter again with new weights (the next seed), as vLLM's /v1/load_lora_adapter reloads a name:
its version goes up by one, and requests submitted from then on run under the new weights. `none` is
the base model, whose weights are never reloaded, so it is no reload target (one error line).
"""

from __future__ import annotations

import random
from typing import Annotated, Literal

import pydantic
from pydantic import Field

from kvtui.models.lora import BUILTIN_ADAPTERS
from kvtui.scenario.base import Strict
from kvtui.scenario.errors import Problem

BASE = "none"
AdapterName = Literal[tuple(BUILTIN_ADAPTERS) + (BASE,)]


def _not_base(value):
    """`lora.reload: none` refused in words: `none` is the base model, not an adapter to reload."""
    if value == BASE:
        raise Problem("`none` is the base model, not an adapter: the base model's weights are never reloaded",
                      f"name a built-in adapter the `lora` section loads ({', '.join(BUILTIN_ADAPTERS)}), or drop "
                      "the event")
    return value


# what a timeline's `lora.reload` may name: a built-in adapter (the section must load it: schema.py)
ReloadName = Annotated[Literal[tuple(BUILTIN_ADAPTERS)], pydantic.BeforeValidator(_not_base)]


class LoraSection(Strict):
    """Which LoRA adapter each request runs under (Llama-family models, kvtui's fused forward): one of
    `adapters` per request, `none` for the base model, in turn (`round_robin`) or drawn by the seed
    (`random`)."""

    adapters: Annotated[list[AdapterName], Field(min_length=1, max_length=64)] = Field(
        description=f"built-in adapter names ({', '.join(BUILTIN_ADAPTERS)}) or `none` (the base model)")
    assign: Literal["random", "round_robin"] = Field(
        "round_robin", description="`round_robin`: the adapters in turn; `random`: drawn by the seed")

    @property
    def loaded(self) -> tuple[str, ...]:
        """The adapter names to load (without `none`), in first-listed order."""
        return tuple(dict.fromkeys(a for a in self.adapters if a != BASE))


class LoraPlan:
    """The adapter of each planned request, fixed by the seed (None: the base model).

    Args:
        spec: the `lora` section, or None (no adapters); seed: the scenario seed; derive: derive_seed.
    """

    def __init__(self, spec: LoraSection | None, seed: int, derive) -> None:
        self.spec = spec
        self.rng = random.Random(derive(seed, "lora"))

    def name(self, index: int) -> str | None:
        """The adapter of request `index` (None: none)."""
        if self.spec is None:
            return None
        names = self.spec.adapters
        pick = names[index % len(names)] if self.spec.assign == "round_robin" else self.rng.choice(names)
        return None if pick == BASE else pick


def reload_seed(name: str, version: int) -> int:
    """The seed of built-in adapter `name`'s weights at `version` (1: its own seed; each reload a new one)."""
    return BUILTIN_ADAPTERS[name] + 1000 * (version - 1)
