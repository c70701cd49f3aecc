"""The scenario document: top-level fields, engine, sampling, SLO and expectations.

Fields (defaults in brackets; seconds and tokens as named):
  name [file stem], description [""], seed [0]
  max_requests, duration_s: stop conditions, whichever comes first (an endless arrival process
      needs at least one)
  model [default]: default | tiny-llama | tiny-gpt2 | any engine model of kvtui.models.registry (e.g.
      tiny-qwen35moe, the hybrid) | a folder or .gguf path (relative to the file)
  dtype [float32]: float32 | bfloat16 | float16
  engine: slots [8] or kv_budget_bytes, max_len [512], max_batch_size [8], max_tokens_per_step [1024],
      layout [padded|packed], padding_side [right|left], bucketing {enabled [false], tolerance [0.2]}
      (or `bucketing: true`), slot_reuse [reuse|reallocate], on_too_long [reject|cap],
      max_waiting [null = unbounded], faults [[]]: faults on from the start,
      kv [slots|paged], block_size [16], num_blocks [null], prefix_caching [false], watermark [0.01],
      batch_invariant [null: on for bfloat16/float16 with the reference detector]
  tenants: count [1], assign [random|round_robin], cache_salt [per_tenant|none]
  lora [null]: adapters [[lora-a|lora-b|lora-c|none]], assign [round_robin|random] (lora.py)
  request_ids [null]: clients' own request ids, a --target audit (request_ids.py)
  arrivals [{process: poisson, rate_per_s: 1.0}]: see arrivals.py
  prompts [{kind: passphrase}]: see prompts.py
  output_tokens [32]: a length distribution (lengths.py): max new tokens per request
  sampling [greedy]: temperature [0], top_k [0], top_p [1], ignore_eos [false], stop [[]],
      n [1], n_fraction [1]: parallel sampling, structured [null]: {fraction, json_schema | json_object |
      regex | choice | grammar}
      frequency_penalty, presence_penalty, repetition_penalty, logit_bias, min_tokens, bad_words
      [null: off], mix [[]]: [{fraction, ...}] (sampling.py)
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

from kvtui.config import EngineConfig, KVMode, Layout, PaddingSide, SlotReuse, TooLong, lora_mode_problem
from kvtui.faults import FAULTS
from kvtui.memory import available_memory_bytes, gib, pool_bytes
from kvtui.models.compat import IncompatibleModel, check_batch_invariant, check_max_len, read_config, shape_from_config
from kvtui.models.labels import model_label
from kvtui.models.registry import engine_names
from kvtui.names import did_you_mean
from kvtui.scenario.arrivals import RATE_PROCESSES, ArrivalSpec, Burst, Gamma, Poisson, Rounds
from kvtui.scenario.base import FAULT_NAMES, MAX_PLANNED, MAX_SECONDS, Strict
from kvtui.scenario.errors import Problem, printable
from kvtui.scenario.lengths import Fixed, LengthDist
from kvtui.scenario.lora import LoraSection
from kvtui.scenario.prompts import PassphrasePrompts, PromptSpec
from kvtui.scenario.request_ids import RequestIds
from kvtui.scenario.sampling import Mix, PenaltyFields, check_mix
from kvtui.scenario.tenants import Tenants
from kvtui.scenario.timeline import TimelineEvent, bounded
from kvtui.scenario.trace import resolve

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}  # bytes per element of each scenario dtype
_D = EngineConfig()  # defaults come from the engine's own config


class Bucketing(Strict):
    """Length bucketing: a step batches only requests whose context lengths (cached + fed this step)
    lie within `tolerance` of each other, relative to the shorter; the others wait. `bucketing: true`
    is short for `{enabled: true}`."""

    enabled: bool = Field(_D.bucketing, description="turn bucketing on")
    tolerance: bounded("bucket_tolerance") = Field(
        _D.bucket_tolerance, description="largest relative length spread in a batch: 0.2 = the longest is at most "
                                          "20% longer than the shortest")


class EngineSection(Strict):
    """The engine: KV slot pool, scheduler and batch layout (kvtui.config.EngineConfig). The pool must
    fit in the machine's available memory; for a model whose geometry is known without loading it (the
    named models, a folder's config.json, a .gguf's metadata) validation checks that, and that max_len
    stays within a learned position table (GPT-2's n_positions)."""

    slots: bounded("num_slots") | None = Field(
        None, description="KV slots, the most requests running at once; null with kv_budget_bytes",
        json_schema_extra={"x-default": f"{_D.num_slots} (null with kv_budget_bytes)"})
    max_len: bounded("max_len") = Field(
        _D.max_len, description="tokens one slot holds: prompt + generated tokens of one request")
    kv_budget_bytes: bounded("kv_budget_bytes") | None = Field(
        None, description="size the pool in bytes instead of slots: slots = budget / bytes per slot (2 x layers x "
                          "KV heads x max_len x head size x bytes per value)")
    max_batch_size: bounded("max_batch_size") = Field(
        _D.max_batch_size, description="most requests in one step (rows of the padded layout)")
    max_tokens_per_step: bounded("max_tokens_per_step") = Field(
        _D.max_tokens_per_step, description="token budget of one step, prefill + decode, pads excluded; a longer "
                                            "prompt is fed in chunks over several steps (chunked prefill)")
    layout: Layout = Field(
        _D.layout, description="`padded`: one row per request, padded to the longest; `packed`: all tokens in "
                               "one row with a block-diagonal causal mask")
    padding_side: PaddingSide = Field(_D.padding_side, description="padded layout only")
    bucketing: Annotated[Bucketing, pydantic.BeforeValidator(
        lambda v: {"enabled": v} if isinstance(v, bool) else v)] = Field(
        Bucketing(), description="length bucketing (see Bucketing), or true / false")
    slot_reuse: SlotReuse = Field(
        _D.slot_reuse, description="`reuse` the preallocated slots, or give each admitted request a freshly "
                                   "allocated (zeroed) slot")
    on_too_long: TooLong = Field(
        _D.on_too_long, description="a request whose prompt + max new tokens exceed max_len is rejected, or "
                                    "its max new tokens lowered to fit; a prompt that alone does not fit is "
                                    "always rejected")
    max_waiting: bounded("max_waiting") | None = Field(
        _D.max_waiting, description="most requests queued for a slot; later arrivals are rejected; null = no limit")
    faults: Annotated[list[Literal[FAULT_NAMES]], Field(max_length=len(FAULT_NAMES))] = Field(
        [], description="isolation faults on from the start (docs/faults.md)")
    kv: KVMode = Field(
        _D.kv, description="`slots`: one region of max_len tokens per running request; `paged`: blocks of "
                           "block_size tokens reached through per-request block tables, as vLLM does (then "
                           "max_batch_size also bounds the requests running at once)")
    block_size: bounded("block_size") = Field(_D.block_size, description="tokens per KV block (paged)")
    num_blocks: bounded("num_blocks") | None = Field(
        None, description="KV blocks, the null block 0 included (paged); null: from kv_budget_bytes (budget / "
                          "bytes per block), else slots x ceil(max_len / block_size) + 1, the slot pool's memory; "
                          "must hold one request of max_len")
    prefix_caching: bool = Field(
        _D.prefix_caching, description="reuse the cached full blocks of a request's longest cached prompt prefix "
                                       "(paged only); a block's key chains its parent's key, its tokens and the "
                                       "tenant's cache_salt")
    kv_offload_blocks: bounded("kv_offload_blocks") | None = Field(
        None, description="blocks a host-memory offload tier under the prefix cache holds (LRU): evicted full "
                          "blocks are stored there and restored on a later prefix hit, as LMCache and vLLM's "
                          "offloading connector do; null or 0: no tier (paged KV with prefix_caching); a block "
                          "takes the pool's bytes per block, and the tier with the pool must fit in the memory "
                          "available (validate checks it from the model's geometry)")
    watermark: bounded("watermark") = Field(
        _D.watermark, description="share of the usable blocks admission keeps free (paged; vLLM V0's default)")
    batch_invariant: bool | None = Field(
        None, description="every row's logits bitwise independent of the batch (fixed row tiles, attention per "
                          "query position), so the reference check counts any differing token with no "
                          "tolerance; Llama-family models, slower (docs/faults.md); null: on for bfloat16 and "
                          "float16 runs whose reference detector runs, off otherwise (and with a `lora` section, "
                          "whose adapters the mode cannot run: true is refused there)")

    @pydantic.model_validator(mode="before")
    @classmethod
    def _default_slots(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("slots") is None and data.get("kv_budget_bytes") is None:
            return {**data, "slots": _D.num_slots}  # absent, or null with no budget: the default
        return data

    @pydantic.model_validator(mode="after")
    def _consistent(self):
        if self.slots is not None and self.kv_budget_bytes is not None:
            raise Problem("both slots and kv_budget_bytes given", "keep one: the budget decides the slots")
        if len(set(self.faults)) != len(self.faults):
            raise Problem("a fault is listed twice", "list each fault once", ("faults",))
        if self.num_blocks is not None and self.kv_budget_bytes is not None:
            raise Problem("both num_blocks and kv_budget_bytes given", "keep one: the budget decides the blocks")
        if self.kv == "slots" and (self.num_blocks is not None or self.prefix_caching):
            key = "num_blocks" if self.num_blocks is not None else "prefix_caching"
            raise Problem(f"{key} needs paged KV", "add `kv: paged` to the engine section", (key,))
        if self.kv_offload_blocks and not self.prefix_caching:
            raise Problem("kv_offload_blocks needs the prefix cache: the tier restores blocks on a prefix hit",
                          "add `kv: paged` and `prefix_caching: true` to the engine section", ("kv_offload_blocks",))
        for name in self.faults:
            check_fault_fits(name, self, ("faults",))
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
            on_too_long=self.on_too_long, max_waiting=self.max_waiting, faults=frozenset(self.faults),
            kv=self.kv, block_size=self.block_size, num_blocks=self.num_blocks, prefix_caching=self.prefix_caching,
            watermark=self.watermark, batch_invariant=bool(self.batch_invariant),
            kv_offload_blocks=self.kv_offload_blocks)
        return EngineConfig(**{**fields, **overrides})

    def pool_blocks(self, block_bytes: int) -> int:
        """Paged KV: blocks of the pool (null block included) for blocks of `block_bytes` bytes."""
        if self.num_blocks is not None:
            return self.num_blocks
        if self.kv_budget_bytes is not None:
            return self.kv_budget_bytes // block_bytes
        return (self.slots or _D.num_slots) * -(-self.max_len // self.block_size) + 1


def check_fault_fits(name: str, engine: EngineSection, where: tuple, layout: str | None = None) -> None:
    """A fault must act in the engine's KV mode, have what it needs (prefix caching) and act in the layout
    in effect when it is switched on (`layout`, default engine.layout). Raises Problem naming what it needs."""
    fault = FAULTS[name]
    if fault.scope == "server":
        raise Problem(f"fault {name} acts in kvtui serve's HTTP layer, not in kvtui's engine", f"drop it here; serve "
                      f"with `kvtui serve --fault {name}` and audit that server with `kvtui run --target`", where)
    if engine.kv not in fault.kv:
        raise Problem(f"fault {name} acts with kv: {' or '.join(fault.kv)} only", f"set engine.kv: {fault.kv[0]} "
                      f"or drop {name}", where)
    if "prefix_caching" in fault.needs and not engine.prefix_caching:
        raise Problem(f"fault {name} acts in the prefix cache", "set engine.prefix_caching: true", where)
    if "kv_offload" in fault.needs and not engine.kv_offload_blocks:
        raise Problem(f"fault {name} acts in the KV offload tier", "set engine.kv_offload_blocks (e.g. 64)", where)
    layout = layout or engine.layout
    if layout not in fault.layouts:
        fix = f"set engine.layout: {fault.layouts[0]} or drop {name}"
        if layout != engine.layout:
            fix = f"switch it on while engine.layout is {fault.layouts[0]}, or drop it"
        raise Problem(f"fault {name} acts in the {' or '.join(fault.layouts)} layout only, not {layout}: it would "
                      "never fire and the run would test nothing", fix, where)


class StructuredSection(Strict):
    """Structured output for a share of the requests, as vLLM's `structured_outputs` names it: exactly
    one of `json_schema` (vLLM's `json`), `json_object`, `regex`, `choice` or `grammar` (EBNF, xgrammar's GBNF).
    Each constrained request samples only what its grammar allows next (an xgrammar matcher and a
    per-row token bitmask) and stops once its grammar is complete. A grammar that does not compile
    rejects each such request at submit (`invalid_structured_output`)."""

    fraction: Annotated[float, Field(ge=0, le=1)] = Field(
        1.0, description="share of the requests that are constrained (drawn by the seed); the rest are plain")
    json_schema: dict[str, Any] | None = Field(
        None, description="a JSON schema the output follows (vLLM's `structured_outputs.json`)")
    json_object: bool = Field(False, description="true: the output is any JSON object")
    regex: Annotated[str, Field(min_length=1)] | None = Field(None, description="a regular expression the output matches")
    choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=64)] | None = Field(
        None, description="the output is exactly one of these strings")
    grammar: Annotated[str, Field(min_length=1)] | None = Field(
        None, description="an EBNF grammar (xgrammar's GBNF dialect, rule `root`) the output follows")

    @pydantic.model_validator(mode="after")
    def _exactly_one(self):
        given = [k for k in ("json_schema", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise Problem(f"needs exactly one of json_schema, json_object, regex, choice, grammar; got "
                          f"{', '.join(given) or 'none'}", "keep one, e.g. `structured: {regex: \"[0-9]+\"}`", ())
        return self

    def spec(self):
        """The engine's StructuredOutputs (kvtui.engine.request) for a constrained request."""
        from kvtui.engine.request import StructuredOutputs

        schema = json.dumps(self.json_schema, sort_keys=True) if self.json_schema is not None else None
        return StructuredOutputs(json=schema, regex=self.regex, choice=tuple(self.choice) if self.choice else None,
                                 grammar=self.grammar, json_object=self.json_object)


class SamplingSection(PenaltyFields):
    """How every request picks its tokens. Temperature 0 is greedy (argmax). Otherwise each request
    samples with its own generator, seeded from the scenario seed and its index, so its draws do not
    depend on its slot or its neighbours. `sampling: greedy` is short for the defaults. Penalties,
    logit_bias, min_tokens and bad_words (OpenAI's and vLLM's names and ranges) apply to every
    request, or through `mix` to a fraction of them: each request takes one entry (or none) with the
    entry's probability, drawn from the seed's own stream, and the entry's fields replace these."""

    temperature: Annotated[float, Field(ge=0, le=100)] = Field(0.0, description="0 = greedy")
    top_k: Annotated[int, Field(ge=0, le=1_000_000)] = Field(0, description="keep the k most likely tokens; 0 = all")
    top_p: Annotated[float, Field(gt=0, le=1)] = Field(
        1.0, description="keep the smallest set of tokens whose probability reaches top_p")
    ignore_eos: bool = Field(False, description="true: every request generates exactly its output length")
    stop: Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=16)] = Field(
        [], description="stop strings: a request ends once its text contains one")
    include_stop_str_in_output: bool = Field(
        False, description="keep the stop string in the returned text (vLLM's option); by default it is cut, "
                           "as in the OpenAI API")
    # -- parallel sampling ----------------------------------------------------------------------
    n: Annotated[int, Field(ge=1, le=16)] = Field(
        1, description="sequences per request (parallel sampling, vLLM's and OpenAI's `n`): the prompt is "
                       "prefilled once and forked; sequence i of request R is `i_R` and samples with seed + i")
    n_fraction: Annotated[float, Field(ge=0, le=1)] = Field(
        1.0, description="share of the requests that sample `n` sequences (drawn by the seed); the rest sample one")
    # -- structured output ----------------------------------------------------------------------
    structured: StructuredSection | None = Field(
        None, description="structured output for a share of the requests (see sampling.structured); null = none")
    mix: Annotated[Mix, pydantic.AfterValidator(check_mix)] = Field(
        [], description="[{fraction, ...sampling fields}]: a share of the requests and the sampling it takes")


class SLO(Strict):
    """Service level objective: goodput counts the finished requests per second that meet both limits."""

    ttft_s: Annotated[float, Field(gt=0, le=MAX_SECONDS)] | None = Field(
        None, description="time to first token limit (seconds); null = no limit")
    tpot_s: Annotated[float, Field(gt=0, le=MAX_SECONDS)] | None = Field(
        None, description="time per output token limit, first token excluded (seconds); null = no limit")


class Expect(Strict):
    """What a headless run of this scenario should find; it decides the exit code."""

    contamination: Literal["none", "detected"] = Field(
        "none", description="`none`: exit 1 if any cross_request or corruption event appears; `detected`: "
                            "exit 1 if none does")


class Dashboard(Strict):
    """How `kvtui run` shows the scenario live (headless runs ignore this section; `--clock` overrides it)."""

    clock: Literal["wall", "paced", "virtual"] = Field(
        "wall", description="the dashboard's clock: `wall` (real time: latencies as this machine serves them), "
                            "`paced` (the virtual clock held to real time: the same steps and tokens as a headless "
                            "run, on any machine; the header says the pace when the machine is slower) or `virtual` "
                            "(as fast as the engine goes)")


class ThinkTime(Strict):
    """Seconds a user thinks between an answer and the next turn, drawn from the seed's own stream:
    `fixed` (always mean_s), `uniform` (in [min_s, max_s]) or `exponential` (mean mean_s, as think times are
    usually modelled)."""

    distribution: Literal["fixed", "uniform", "exponential"] = Field("fixed", description="its shape")
    mean_s: Annotated[float, Field(ge=0, le=MAX_SECONDS)] = Field(
        1.0, description="fixed: the time; exponential: its mean (seconds)")
    min_s: Annotated[float, Field(ge=0, le=MAX_SECONDS)] = Field(0.0, description="uniform: shortest (seconds)")
    max_s: Annotated[float, Field(ge=0, le=MAX_SECONDS)] = Field(2.0, description="uniform: longest (seconds)")

    @pydantic.model_validator(mode="after")
    def _ordered(self):
        if self.distribution == "uniform" and self.max_s < self.min_s:
            raise Problem(f"max_s {self.max_s} is below min_s {self.min_s}", "raise max_s", ("max_s",))
        return self

    def sample(self, rng) -> float:
        """One think time (seconds) drawn with `rng` (random.Random)."""
        if self.distribution == "uniform":
            return rng.uniform(self.min_s, self.max_s)
        if self.distribution == "exponential":
            return rng.expovariate(1.0 / self.mean_s) if self.mean_s > 0 else 0.0
        return self.mean_s


class Sessions(Strict):
    """Multi-turn chat sessions with the server's real answers (a `kvtui run --target` run; a local run
    sends each session's first turn only and says so). Each planned arrival opens a session: its prompt is
    turn 1; after the server's answer and a think time, turn 2 is sent as a chat of the first user message,
    the answer the server actually gave, and `follow_up`; and so on for `turns` turns. Every turn carries the
    session's passphrase as its canary (another session's passphrase in any answer is a leak), and the
    reference check's solo rerun of a turn replays exactly the conversation that turn sent."""

    turns: Annotated[int, Field(ge=1, le=1000)] = Field(3, description="turns per session, the first included")
    think_time_s: ThinkTime = Field(ThinkTime(), description="between an answer and the next turn (see think time)")
    follow_up: Annotated[str, Field(min_length=1, max_length=10_000)] = Field(
        "What was the passphrase? Reply with only the passphrase.",
        description="the user message of every turn after the first")


class Scenario(Strict):
    """A load scenario: who arrives when, saying what, served by which engine."""

    name: Annotated[str, Field(min_length=1, max_length=200)] = Field(
        description="shown in the summary and the recording", json_schema_extra={"x-default": "the file name"})
    description: Annotated[str, Field(max_length=10_000)] = Field("", description="free text")
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] = Field(
        0, description="fixes every random choice: arrivals, prompts, lengths, sampling")
    max_requests: Annotated[int, Field(ge=1, le=MAX_PLANNED)] | None = Field(
        None, description="stop after this many requests")
    duration_s: Annotated[float, Field(gt=0, le=MAX_SECONDS)] | None = Field(
        None, description="no arrivals at or after this time (seconds); requests already in flight finish")
    model: Annotated[str, Field(min_length=1, max_length=4096)] = Field(
        "default", description="`default` (SmolLM2-135M-Instruct), `tiny-llama`, `tiny-gpt2`, or a Hugging Face "
                               "model folder or .gguf file, relative to the scenario file")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="weights, KV cache and activations")
    engine: EngineSection = Field(EngineSection(), description="see engine")
    tenants: Tenants = Field(Tenants(), description="see tenants")
    lora: LoraSection | None = Field(None, description="LoRA adapters the requests run under (see lora); null: none")
    request_ids: RequestIds | None = Field(
        None, description="clients choose their own request ids, duplicates among them (see request_ids); a "
                          "`kvtui run --target` audit, ignored by a local run; null: kvtui sends none")
    sessions: Sessions | None = Field(
        None, description="multi-turn sessions carrying the server's real answers (see sessions); a `kvtui run "
                          "--target` feature, a local run sends first turns only; null: one request per arrival")
    arrivals: ArrivalSpec = Field(
        Poisson(process="poisson", rate_per_s=1.0), description="when requests arrive: one of the processes "
                                                                "under arrivals, chosen by `process`")
    prompts: PromptSpec = Field(
        PassphrasePrompts(kind="passphrase"), description="what each request says: one of the kinds under "
                                                          "prompts, chosen by `kind`")
    output_tokens: LengthDist = Field(
        Fixed(value=32), description="max new tokens per request: a length distribution, or a plain integer")
    sampling: Annotated[SamplingSection, pydantic.BeforeValidator(
        lambda v: {} if v == "greedy" else v)] = Field(SamplingSection(), description="see sampling")
    slo: SLO = Field(SLO(), description="see slo")
    timeline: Annotated[list[TimelineEvent], Field(max_length=10_000),
                        pydantic.AfterValidator(lambda v: sorted(v, key=lambda e: e.at_s))] = Field(
        [], description="knob changes at given times (see timeline), applied in at_s order")
    expect: Expect = Field(Expect(), description="see expect")
    dashboard: Dashboard = Field(Dashboard(), description="see dashboard")
    _base_dir: Path | None = pydantic.PrivateAttr(default=None)
    _warnings: list[str] = pydantic.PrivateAttr(default_factory=list)

    @pydantic.model_validator(mode="after")
    def _semantics(self, info: pydantic.ValidationInfo):
        self._base_dir = (info.context or {}).get("base_dir")
        self._check_model()
        self._check_fits()
        self._check_stop()
        self._check_timeline()
        self._check_forks()
        self._check_lora()
        return self

    def _check_lora(self) -> None:
        """Adapters need a Llama-family model and an engine mode that runs them (config.py
        lora_mode_problem, as `kvtui serve` and `kvtui run`'s flags ask it); a `lora.reload` event must name
        an adapter the `lora` section loads."""
        loaded = self.lora.loaded if self.lora is not None else ()
        cfg = read_config(self.model, self._base_dir) if loaded else None
        if cfg is not None and cfg.get("model_type") != "llama":
            raise Problem(f"LoRA adapters run on Llama-family models, not {model_label(self.model)} "
                          f"({cfg.get('model_type')})",
                          "drop the `lora` section or choose such a model (default, tiny-llama)", ("lora",))
        problem = loaded and lora_mode_problem(batch_invariant=bool(self.engine.batch_invariant))
        if problem:
            raise Problem(f"{problem}, and the `lora` section loads {', '.join(loaded)}",
                          "set engine.batch_invariant to false or leave it null (off when adapters run), or drop "
                          "the `lora` section", ("engine", "batch_invariant"))
        for i, event in enumerate(self.timeline):
            name = (event.set or {}).get("lora.reload")
            if name is not None and name not in loaded:
                fix = (f"add it to lora.adapters (which load {', '.join(loaded)})" if loaded else
                       f"add a `lora` section that loads it, e.g. `lora: {{adapters: [{name}, none]}}`")
                raise Problem(f"lora.reload names {name!r}, which the `lora` section does not load", fix,
                              ("timeline", i, "set", "lora.reload"))

    def _check_forks(self) -> None:
        """cow_missing acts on forked sequences only: a scenario without parallel sampling never fires it."""
        named = set(self.engine.faults) | {(e.set or {}).get("fault") for e in self.timeline}
        structured = self.sampling.structured
        if "stale_bitmask" in named and (structured is None or structured.fraction == 0):
            raise Problem("fault stale_bitmask acts on the bitmask rows of structured output; this scenario has no "
                          "constrained request, so it would never fire", "add sampling.structured (e.g. "
                          "`{regex: \"[0-9]+\", fraction: 0.5}`), or drop stale_bitmask", ("sampling", "structured"))
        if "cow_missing" in named and (self.sampling.n == 1 or self.sampling.n_fraction == 0):
            raise Problem("fault cow_missing acts on the sequences of a request with n > 1 (parallel sampling); this "
                          "scenario has none, so it would never fire", "set sampling.n: 2 or more (and n_fraction "
                          "above 0), or drop cow_missing", ("sampling", "n"))

    def _check_model(self) -> None:
        m, names = self.model, engine_names()  # a registry name (no alias, no other spelling), or a path
        if m in names:
            return
        if "/" in m or "\\" in m or m.endswith(".gguf") or m.startswith((".", "~")):
            try:
                exists = resolve(m, self._base_dir).exists()
            except (OSError, ValueError):
                exists = False
            if not exists:
                where = "the scenario file" if self._base_dir is not None else "the current folder"
                raise Problem(f"model path {m} does not exist", "give an existing folder or .gguf file "
                              f"(relative to {where}) or one of {', '.join(names)}", ("model",))
            return
        raise Problem(f"unknown model {m!r}{did_you_mean(m, names)}",
                      f"use one of {', '.join(names)}, or a path to a folder or .gguf file", ("model",))

    def _check_fits(self) -> None:
        """The model's limits against the engine section, when the model's config can be read without
        its weights (named models, a folder's config.json, a .gguf's metadata): RoPE that depends on
        the batch, max_len past a learned position table, a KV pool larger than the available memory."""
        cfg = read_config(self.model, self._base_dir)
        if cfg is None:
            return
        try:
            check_batch_invariant(cfg)
        except IncompatibleModel as e:
            raise Problem(f"model {model_label(self.model)}: {e.problem}", e.fix, ("model",)) from None
        try:
            shape = shape_from_config(cfg)
            check_max_len(cfg, self.engine.max_len)
        except IncompatibleModel as e:
            raise Problem(e.problem, e.fix, ("engine", "max_len")) from None
        except ValueError:  # a config without layer/head counts: the run-time checks apply
            return
        per_token = shape.kv_bytes_per_token(ITEMSIZE[self.dtype])
        if self.engine.kv == "paged":
            self._check_paged_memory(per_token * self.engine.block_size)
        else:
            self._check_memory(per_token * self.engine.max_len)

    def _check_paged_memory(self, per_block: int) -> None:
        e = self.engine
        blocks, need = e.pool_blocks(per_block), -(-e.max_len // e.block_size) + 1
        where = ("engine", "kv_budget_bytes") if e.kv_budget_bytes is not None else ("engine", "num_blocks")
        if blocks < need:
            raise Problem(f"a paged KV pool of {blocks} blocks of {e.block_size} tokens cannot hold one request of "
                          f"max_len {e.max_len} (needs {need} blocks with the null block)",
                          f"raise engine.{where[1]} or lower engine.max_len", where)
        total, free = pool_bytes(blocks, e.block_size, per_block), available_memory_bytes()
        if free is not None and total > free:
            raise Problem(f"paged KV pool of {blocks} blocks x {e.block_size} tokens needs {gib(total)} for "
                          f"{model_label(self.model)} ({self.dtype}), more than the {gib(free)} of memory available",
                          f"lower engine.{where[1]}", where)
        tier = (e.kv_offload_blocks or 0) * per_block  # the tier holds whole blocks' K/V, filled as the pool evicts
        if free is not None and tier and total + tier > free:
            raise Problem(f"a KV offload tier of {e.kv_offload_blocks} blocks needs {gib(tier)} of host memory for "
                          f"{model_label(self.model)} ({self.dtype}) beside the KV pool's {gib(total)}, more than "
                          f"the {gib(free)} of memory available", "lower engine.kv_offload_blocks (at most about "
                          f"{max((free - total) // per_block, 0)} blocks fit)", ("engine", "kv_offload_blocks"))

    def _check_memory(self, per_slot: int) -> None:
        e, budget = self.engine, self.engine.kv_budget_bytes
        slots = e.slots if budget is None else budget // per_slot
        where, fix = (("engine", "kv_budget_bytes"), "lower engine.kv_budget_bytes") if budget is not None else \
            (("engine",), "lower engine.slots or engine.max_len")
        if slots < 1:
            raise Problem(f"kv_budget_bytes {budget} holds no slot: one slot of max_len {e.max_len} needs "
                          f"{per_slot} bytes for {model_label(self.model)} ({self.dtype})",
                          "raise engine.kv_budget_bytes or lower engine.max_len", where)
        need, free = pool_bytes(slots, e.max_len, per_slot), available_memory_bytes()
        if free is not None and need > free:
            raise Problem(f"KV pool of {slots} slots x {e.max_len} tokens needs {gib(need)} for "
                          f"{model_label(self.model)} ({self.dtype}), more than the {gib(free)} of memory available",
                          fix, where)

    def _check_stop(self) -> None:
        a = self.arrivals
        if isinstance(a, Rounds) and self.duration_s is not None:
            raise Problem("duration_s cannot end rounds: each round arrives when the one before finished, at a "
                          "time known only while running", "drop duration_s (max_requests or the rounds' counts "
                          "bound the run)", ("duration_s",))
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
        layout = self.engine.layout  # the timeline may change it: each switch is checked in the one in effect
        for i, event in enumerate(self.timeline):
            layout = event.engine_overrides().get("layout", layout)
            if event.fault_switch:  # switching a fault off is checked for its KV mode only
                name, on = event.fault_switch
                check_fault_fits(name, self.engine, ("timeline", i, "set", "fault"),
                                 layout if on else FAULTS[name].layouts[0])
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
    def warnings(self) -> list[str]:
        """Lines about things that are valid but probably not meant (e.g. a timeline event after the
        arrivals end), `<file>:<line>: <field.path>: <what>; <fix>`, control characters escaped."""
        return list(self._warnings)

    def add_warnings(self, lines: list[str]) -> None:
        """Append warning lines (the loader adds them once the document is valid)."""
        self._warnings.extend(printable(line) for line in lines)

    @property
    def base_dir(self) -> Path | None:
        """Folder relative paths in this scenario are resolved against (None: the working directory)."""
        return self._base_dir

    def model_path(self) -> Path | None:
        """The model as a filesystem path, or None when `model` is a name like 'default'."""
        return None if self.model in engine_names() else resolve(self.model, self._base_dir)

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
