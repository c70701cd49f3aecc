"""The scenario document: top-level fields, engine, sampling, SLO and expectations.

Fields (defaults in brackets; seconds and tokens as named):
  name [file stem], description [""], seed [0]
  max_requests, duration_s: stop conditions, whichever comes first (an endless arrival process
      needs at least one)
  model [default]: default | tiny-llama | tiny-gpt2 | a folder or .gguf path (relative to the file)
  dtype [float32]: float32 | bfloat16 | float16
  engine: slots [8] or kv_budget_bytes, max_len [512], max_batch_size [8], max_tokens_per_step [1024],
      layout [padded|packed], padding_side [right|left], bucketing {enabled [false], tolerance [0.2]}
      (or `bucketing: true`), slot_reuse [reuse|reallocate], on_too_long [reject|cap],
      max_waiting [null = unbounded], faults [[]]: faults on from the start
  arrivals [{process: poisson, rate_per_s: 1.0}]: see arrivals.py
  prompts [{kind: passphrase}]: see prompts.py
  output_tokens [32]: a length distribution (lengths.py): max new tokens per request
  sampling [greedy]: temperature [0], top_k [0], top_p [1], ignore_eos [false], stop [[]]
  slo: ttft_s, tpot_s [null: no limit], for goodput
  timeline [[]]: [{at_s, set: {knob: value}, marker}], see timeline.py
  expect: contamination [none|detected]

Every model is frozen and rejects unknown keys; `Scenario.normalized()` is the document with every
default filled in (what `kvtui validate` prints and a recording's header stores).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
from pydantic import Field

from kvtui.config import EngineConfig
from kvtui.scenario.arrivals import RATE_PROCESSES, ArrivalSpec, Burst, Gamma, Poisson
from kvtui.scenario.base import FAULT_NAMES, MAX_PLANNED, MAX_SECONDS, Strict
from kvtui.scenario.errors import Problem, did_you_mean
from kvtui.scenario.lengths import Fixed, LengthDist
from kvtui.scenario.prompts import PassphrasePrompts, PromptSpec
from kvtui.scenario.timeline import TimelineEvent
from kvtui.scenario.trace import resolve

MODEL_NAMES = ("default", "tiny-llama", "tiny-gpt2")
_D = EngineConfig()  # defaults come from the engine's own config


class Bucketing(Strict):
    enabled: bool = _D.bucketing
    tolerance: Annotated[float, Field(ge=0, le=10)] = _D.bucket_tolerance  # relative length spread


class EngineSection(Strict):
    """Maps onto kvtui.config.EngineConfig (see its docstring for each field's meaning)."""

    slots: Annotated[int, Field(ge=1, le=4096)] | None = None  # None with kv_budget_bytes
    max_len: Annotated[int, Field(ge=2, le=1_000_000)] = _D.max_len  # tokens per slot
    kv_budget_bytes: Annotated[int, Field(gt=0, le=2**50)] | None = None
    max_batch_size: Annotated[int, Field(ge=1, le=4096)] = _D.max_batch_size
    max_tokens_per_step: Annotated[int, Field(ge=1, le=1_000_000)] = _D.max_tokens_per_step
    layout: Literal["padded", "packed"] = _D.layout
    padding_side: Literal["right", "left"] = _D.padding_side
    bucketing: Annotated[Bucketing, pydantic.BeforeValidator(
        lambda v: {"enabled": v} if isinstance(v, bool) else v)] = Bucketing()
    slot_reuse: Literal["reuse", "reallocate"] = _D.slot_reuse
    on_too_long: Literal["reject", "cap"] = _D.on_too_long
    max_waiting: Annotated[int, Field(ge=0, le=10**9)] | None = _D.max_waiting  # None = unbounded
    faults: Annotated[list[Literal[FAULT_NAMES]], Field(max_length=len(FAULT_NAMES))] = []  # on from the start

    @pydantic.model_validator(mode="before")
    @classmethod
    def _default_slots(cls, data: Any) -> Any:
        if isinstance(data, dict) and "slots" not in data and data.get("kv_budget_bytes") is None:
            return {**data, "slots": _D.num_slots}
        return data

    @pydantic.model_validator(mode="after")
    def _consistent(self):
        if self.slots is not None and self.kv_budget_bytes is not None:
            raise Problem("both slots and kv_budget_bytes given", "keep one: the budget decides the slots")
        if len(set(self.faults)) != len(self.faults):
            raise Problem("a fault is listed twice", "list each fault once", ("faults",))
        try:
            self.config()
        except ValueError as e:
            raise Problem(str(e), "fix the engine value") from None
        return self

    def config(self, **overrides: Any) -> EngineConfig:
        fields = dict(
            num_slots=self.slots or _D.num_slots, max_len=self.max_len, kv_budget_bytes=self.kv_budget_bytes,
            max_batch_size=self.max_batch_size, max_tokens_per_step=self.max_tokens_per_step,
            layout=self.layout, padding_side=self.padding_side, bucketing=self.bucketing.enabled,
            bucket_tolerance=self.bucketing.tolerance, slot_reuse=self.slot_reuse,
            on_too_long=self.on_too_long, max_waiting=self.max_waiting, faults=frozenset(self.faults))
        return EngineConfig(**{**fields, **overrides})


class SamplingSection(Strict):
    """temperature 0 = greedy; per-request seeds come from the scenario seed (see plan.py)."""

    temperature: Annotated[float, Field(ge=0, le=100)] = 0.0
    top_k: Annotated[int, Field(ge=0, le=1_000_000)] = 0  # 0 = all tokens
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    ignore_eos: bool = False  # True: every request generates exactly its output length
    stop: Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=16)] = []
    include_stop_str_in_output: bool = False  # vLLM's option: keep the stop string in the returned text


class SLO(Strict):
    """Service level objective for goodput; None = not constrained."""

    ttft_s: Annotated[float, Field(gt=0, le=MAX_SECONDS)] | None = None  # time to first token, seconds
    tpot_s: Annotated[float, Field(gt=0, le=MAX_SECONDS)] | None = None  # time per output token, seconds


class Expect(Strict):
    """What a run of this scenario should find (checked by tests and `kvtui run --check`)."""

    contamination: Literal["none", "detected"] = "none"


class Scenario(Strict):
    """A load scenario: who arrives when, saying what, served by which engine."""

    name: Annotated[str, Field(min_length=1, max_length=200)]
    description: Annotated[str, Field(max_length=10_000)] = ""
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] = 0
    max_requests: Annotated[int, Field(ge=1, le=MAX_PLANNED)] | None = None  # stop after this many
    duration_s: Annotated[float, Field(gt=0, le=MAX_SECONDS)] | None = None  # no arrivals after this
    model: Annotated[str, Field(min_length=1, max_length=4096)] = "default"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    engine: EngineSection = EngineSection()
    arrivals: ArrivalSpec = Poisson(process="poisson", rate_per_s=1.0)
    prompts: PromptSpec = PassphrasePrompts(kind="passphrase")
    output_tokens: LengthDist = Fixed(value=32)  # max new tokens per request
    sampling: Annotated[SamplingSection, pydantic.BeforeValidator(
        lambda v: {} if v == "greedy" else v)] = SamplingSection()
    slo: SLO = SLO()
    timeline: Annotated[list[TimelineEvent], Field(max_length=10_000),
                        pydantic.AfterValidator(lambda v: sorted(v, key=lambda e: e.at_s))] = []  # by at_s
    expect: Expect = Expect()
    _base_dir: Path | None = pydantic.PrivateAttr(default=None)

    @pydantic.model_validator(mode="after")
    def _semantics(self, info: pydantic.ValidationInfo):
        self._base_dir = (info.context or {}).get("base_dir")
        self._check_model()
        self._check_stop()
        self._check_timeline()
        return self

    def _check_model(self) -> None:
        m = self.model
        if m in MODEL_NAMES:
            return
        if "/" in m or "\\" in m or m.endswith(".gguf") or m.startswith((".", "~")):
            try:
                exists = resolve(m, self._base_dir).exists()
            except (OSError, ValueError):
                exists = False
            if not exists:
                raise Problem(f"model path {m} does not exist", "give an existing folder or .gguf file "
                              f"(relative to the scenario file) or one of {', '.join(MODEL_NAMES)}", ("model",))
            return
        raise Problem(f"unknown model {m!r}{did_you_mean(m, MODEL_NAMES)}",
                      f"use one of {', '.join(MODEL_NAMES)}, or a path to a folder or .gguf file", ("model",))

    def _check_stop(self) -> None:
        a = self.arrivals
        open_ended = isinstance(a, Burst) or (isinstance(a, RATE_PROCESSES) and not a.stages)
        if open_ended and self.max_requests is None and self.duration_s is None:
            raise Problem(f"process {a.process} never stops by itself and no stop condition is set",
                          "add `max_requests: 16` and/or `duration_s: 30` at the top level", ("arrivals",))
        if self.max_requests is None and self.duration_s is not None and open_ended:
            if isinstance(a, Burst):
                expected = a.size * (self.duration_s / a.every_s + 1)
            else:
                rates = [a.rate_per_s] + [e.set.get("arrivals.rate_per_s", 0) for e in self.timeline]
                expected = max(rates) * self.duration_s
            if expected > MAX_PLANNED:
                raise Problem(f"about {expected:.0f} requests in duration_s", f"set max_requests (at most "
                              f"{MAX_PLANNED}) or lower the rate or duration", ("duration_s",))

    def _check_timeline(self) -> None:
        for i, event in enumerate(self.timeline):
            for knob in event.arrival_changes():
                a = self.arrivals
                if not isinstance(a, RATE_PROCESSES) or a.stages:
                    raise Problem(f"arrivals.{knob} can change only for a constant/poisson/gamma process "
                                  "with rate_per_s", "use stages for ramps, or remove this knob",
                                  ("timeline", i, "set", f"arrivals.{knob}"))
                if knob == "burstiness" and not isinstance(a, Gamma):
                    raise Problem("arrivals.burstiness applies to process gamma only",
                                  "set `process: gamma` or remove this knob",
                                  ("timeline", i, "set", "arrivals.burstiness"))

    @property
    def base_dir(self) -> Path | None:
        """Folder relative paths in this scenario are resolved against (None: the working directory)."""
        return self._base_dir

    def model_path(self) -> Path | None:
        """The model as a filesystem path, or None when `model` is a name like 'default'."""
        return None if self.model in MODEL_NAMES else resolve(self.model, self._base_dir)

    def engine_config(self, **overrides: Any) -> EngineConfig:
        """EngineConfig from the `engine:` section; `overrides` are EngineConfig fields (e.g. device)."""
        return self.engine.config(**overrides)

    def normalized(self) -> dict:
        """The scenario with every default filled, as plain JSON-compatible data (union tags such as
        `process` first in their mapping)."""
        data = self.model_dump(mode="json")
        for key in ("arrivals", "prompts", "output_tokens"):
            data[key] = _tag_first(data[key])
        if "prompt_tokens" in data["prompts"]:
            data["prompts"]["prompt_tokens"] = _tag_first(data["prompts"]["prompt_tokens"])
        return data

    def content_hash(self) -> str:
        """sha256 (hex) of the canonical JSON of normalized(): sorted keys, no spaces."""
        text = json.dumps(self.normalized(), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _tag_first(d: dict) -> dict:
    tags = [k for k in ("process", "kind", "dist") if k in d]
    return {**{k: d[k] for k in tags}, **{k: v for k, v in d.items() if k not in tags}}
