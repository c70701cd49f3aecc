"""Timeline: knobs changed at given times during a run.

YAML: `timeline: [{at_s: 5.0, set: {arrivals.rate_per_s: 4.0}, marker: "rate doubles"}]`.
`set` keys are the runtime knobs below, written as scenario field paths (the `engine.` prefix may be
left out); a fault is switched with `set: {fault: stale_slot, on: true}` (`on` defaults to true).

Arrival knobs (arrivals.*) are applied when requests are planned (`plan_requests`); the rest are
applied by the session at `at_s`: `TimelineEvent.engine_overrides()` gives EngineConfig field names.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import pydantic
from pydantic import Field, TypeAdapter

from kvtui.config import KNOB_BOUNDS, Layout, PaddingSide, SlotReuse, TooLong
from kvtui.names import did_you_mean
from kvtui.scenario.base import FAULT_NAMES, MAX_RATE, MAX_SECONDS, Strict
from kvtui.scenario.errors import Problem, describe, short
from kvtui.scenario.lora import ReloadName

_strict = pydantic.ConfigDict(strict=True, allow_inf_nan=False)


def _adapter(tp: Any) -> TypeAdapter:
    return TypeAdapter(tp, config=_strict)


def bounded(engine_field: str) -> Any:
    """The pydantic type of EngineConfig field `engine_field`: its type within its bounds, read from
    kvtui.config.KNOB_BOUNDS (the scenario's engine section and the timeline both use it)."""
    bound = KNOB_BOUNDS[engine_field]
    return Annotated[bound.type, Field(**bound.pydantic())]


# knob -> (EngineConfig field or None for arrival/fault knobs, value validator)
RUNTIME_KNOBS: dict[str, tuple[str | None, TypeAdapter]] = {
    "arrivals.rate_per_s": (None, _adapter(Annotated[float, Field(ge=0, le=MAX_RATE)])),
    "arrivals.burstiness": (None, _adapter(Annotated[float, Field(gt=0, le=1000)])),
    "engine.max_batch_size": ("max_batch_size", _adapter(bounded("max_batch_size"))),
    "engine.max_tokens_per_step": ("max_tokens_per_step", _adapter(bounded("max_tokens_per_step"))),
    "engine.layout": ("layout", _adapter(Layout)),
    "engine.padding_side": ("padding_side", _adapter(PaddingSide)),
    "engine.bucketing.enabled": ("bucketing", _adapter(bool)),
    "engine.bucketing.tolerance": ("bucket_tolerance", _adapter(bounded("bucket_tolerance"))),
    "engine.slot_reuse": ("slot_reuse", _adapter(SlotReuse)),
    "engine.on_too_long": ("on_too_long", _adapter(TooLong)),
    "engine.max_waiting": ("max_waiting", _adapter(bounded("max_waiting") | None)),
    "fault": (None, _adapter(Literal[FAULT_NAMES])),
    "lora.reload": (None, _adapter(ReloadName)),  # a LoRA adapter loaded again with new weights (scenario/lora.py)
    "on": (None, _adapter(bool)),
}


def canonical_knob(key: object) -> str | None:
    """'max_batch_size' -> 'engine.max_batch_size'; None for an unknown key."""
    if not isinstance(key, str):
        return None
    if key in RUNTIME_KNOBS:
        return key
    return f"engine.{key}" if f"engine.{key}" in RUNTIME_KNOBS else None


def _check_set(value: object) -> dict:
    if not isinstance(value, dict):
        raise Problem(f"expected a mapping of knob: value, got {short(value)}",
                      "write e.g. `set: {arrivals.rate_per_s: 4.0}`")
    out: dict = {}
    for key, v in value.items():
        knob = "on" if key is True else canonical_knob(key)  # YAML 1.1 reads a bare `on` key as true
        if knob is None:
            names = list(RUNTIME_KNOBS) + [k.removeprefix("engine.") for k in RUNTIME_KNOBS]
            raise Problem(f"unknown knob {short(key)}{did_you_mean(key, names)}",
                          f"use one of: {', '.join(RUNTIME_KNOBS)}", (key,))
        if knob in out:
            raise Problem(f"knob {knob} given twice", "keep one", (knob,))
        try:
            out[knob] = RUNTIME_KNOBS[knob][1].validate_python(v)
        except pydantic.ValidationError as e:
            problem, fix, _ = describe(e.errors()[0], lambda loc: [])
            raise Problem(problem, fix, (key if isinstance(key, str) else knob,)) from None
    if "on" in out and "fault" not in out:
        raise Problem("`on` without `fault`", "add `fault: <name>` next to `on`", ("on",))
    if "fault" in out:
        out.setdefault("on", True)
    return out


class TimelineEvent(Strict):
    """At `at_s` seconds: apply `set`, and show `marker` (text) on the dashboard and in the recording.
    Arrival knobs change the arrivals planned from `at_s` on; engine knobs and fault switches take effect
    at the first step boundary at or after `at_s`. An event after the arrivals end (after duration_s, or
    after the last planned arrival) applies only if requests are still running then; validation warns."""

    at_s: Annotated[float, Field(ge=0, le=MAX_SECONDS)] = Field(description="when (seconds from the start)")
    set: Annotated[dict[str, Any], pydantic.BeforeValidator(_check_set)] = Field(
        {}, description="`{knob: value}`, knobs from the table below; `{fault: NAME, on: true}` switches a fault")
    marker: Annotated[str, Field(max_length=200)] = Field(
        "", description="text shown on the dashboard and written to the recording")

    @pydantic.model_validator(mode="after")
    def _not_empty(self):
        if not self.set and not self.marker:
            raise Problem("event does nothing", 'add `set: {...}` or `marker: "text"`')
        return self

    def engine_overrides(self) -> dict[str, Any]:
        """EngineConfig field -> new value, for `dataclasses.replace(config, **overrides)`."""
        return {RUNTIME_KNOBS[k][0]: v for k, v in self.set.items() if RUNTIME_KNOBS[k][0]}

    def arrival_changes(self) -> dict[str, float]:
        """{'rate_per_s': ..., 'burstiness': ...} for the ones this event sets."""
        return {k.removeprefix("arrivals."): v for k, v in self.set.items() if k.startswith("arrivals.")}

    @property
    def lora_reload(self) -> str | None:
        """The LoRA adapter this event reloads with new weights (scenario/lora.py), or None."""
        return self.set.get("lora.reload")

    @property
    def fault_switch(self) -> tuple[str, bool] | None:
        """(fault name, on) when this event switches a fault."""
        return (self.set["fault"], self.set["on"]) if "fault" in self.set else None
