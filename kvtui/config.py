"""Engine configuration: one frozen dataclass, validated when it is built, and the one table of its
numeric knobs' bounds (KNOB_BOUNDS) and of the knobs a running engine may change (RUNTIME_FIELDS).
The scenario schema, the timeline, `kvtui serve`'s flags and Engine.reconfigure read them from here, and
the modes in which LoRA adapters cannot run (lora_mode_problem)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Literal, get_args

Layout = Literal["padded", "packed"]
PaddingSide = Literal["right", "left"]
SlotReuse = Literal["reuse", "reallocate"]
TooLong = Literal["reject", "cap"]
Clock = Literal["virtual", "paced", "wall"]
DType = Literal["float32", "bfloat16", "float16"]
KVMode = Literal["slots", "paged"]


@dataclass(frozen=True)
class Bound:
    """The values one numeric EngineConfig field takes: `low` to `high`, both included unless `low_open`.

    `high` is a limit of the engine itself when `engine_high` (EngineConfig refuses a value past it);
    otherwise it only caps what a scenario file or command line may ask for, and EngineConfig checks
    `low` alone. Units are the field's (tokens, requests, bytes, a share).
    """

    type: type
    low: int | float
    high: int | float
    low_open: bool = False
    engine_high: bool = False

    def pydantic(self) -> dict[str, int | float]:
        """The bound as pydantic Field keywords: {"ge" or "gt": low, "le": high}."""
        return {"gt" if self.low_open else "ge": self.low, "le": self.high}

    def problem(self, name: str, value: int | float) -> str | None:
        """EngineConfig's message for `value` of field `name` out of range (None: in range)."""
        if self.engine_high:
            if self.low <= value <= self.high:
                return None
            span = f"{self.low}..{self.high}" if self.type is int else f"[{self.low}, {self.high}]"
            return f"self.{name} = {value!r} must be in {span}"
        if (value > self.low) if self.low_open else (value >= self.low):
            return None
        return f"self.{name} = {value!r} must be {'>' if self.low_open else '>='} {self.low}"


# EngineConfig field -> its bounds: the one place each is written.
KNOB_BOUNDS: dict[str, Bound] = {
    "num_slots": Bound(int, 1, 4096),
    "max_len": Bound(int, 2, 1_000_000),
    "kv_budget_bytes": Bound(int, 0, 2**50, low_open=True),
    "max_batch_size": Bound(int, 1, 4096),
    "max_tokens_per_step": Bound(int, 1, 1_000_000),
    "bucket_tolerance": Bound(float, 0, 10, engine_high=True),
    "max_waiting": Bound(int, 0, 10**9),
    "block_size": Bound(int, 1, 64, engine_high=True),
    "num_blocks": Bound(int, 2, 10_000_000),
    "watermark": Bound(float, 0, 0.5, engine_high=True),
    "kv_offload_blocks": Bound(int, 0, 10_000_000),
}

# EngineConfig field -> the values it takes, for the fields that take one of a few names.
KNOB_CHOICES: dict[str, tuple[str, ...]] = {
    "layout": get_args(Layout), "padding_side": get_args(PaddingSide), "slot_reuse": get_args(SlotReuse),
    "on_too_long": get_args(TooLong), "kv": get_args(KVMode),
}

# EngineConfig fields a running engine may change between steps (the timeline's engine knobs); the
# others size or place the KV pool, or are switched otherwise (faults: Engine.set_faults).
RUNTIME_FIELDS = frozenset({"max_batch_size", "max_tokens_per_step", "layout", "padding_side", "bucketing",
                            "bucket_tolerance", "slot_reuse", "on_too_long", "max_waiting"})


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches and where it keeps the KV cache.

    Attributes:
        num_slots: KV slots in the pool (requests that can run at once). Ignored when
            kv_budget_bytes is set: then slots = budget // bytes per slot.
        max_len: tokens one slot holds (prompt + generated).
        kv_budget_bytes: optional pool size in bytes; see num_slots.
        max_batch_size: most requests in one step (rows of the padded layout).
        max_tokens_per_step: token budget of one step (prefill + decode tokens, pads excluded);
            a prompt longer than what is left is fed in chunks (chunked prefill).
        layout: "padded" (a row per request) or "packed" (all tokens in one row).
        padding_side: "right" or "left", padded layout only.
        bucketing: batch together only requests whose lengths differ by at most bucket_tolerance
            (relative, 0.2 = 20%: a small spread keeps padding, and so wasted compute, low).
        slot_reuse: "reuse" keeps the preallocated pool; "reallocate" gives each admitted request
            a freshly allocated (zeroed) slot tensor, to compare the cost of allocating per request.
        on_too_long: a request with prompt + max_new_tokens > max_len is "reject"ed, or "cap"ped
            (max_new_tokens lowered to fit); a prompt that alone does not fit is always rejected.
        max_waiting: most requests queued for a slot; later arrivals are rejected (None = unbounded).
        device: torch device string.
        faults: isolation faults on from the start (names from kvtui.faults), a frozenset.
        kv: "slots" (one region of max_len tokens per running request) or "paged" (blocks of
            block_size tokens through per-request block tables, as vLLM).
        block_size: tokens per KV block (paged; 1..64, vLLM's default 16).
        num_blocks: KV blocks including the null block 0 (paged). None: from kv_budget_bytes, else
            num_slots x ceil(max_len / block_size) + 1 (the memory of the slot pool).
        prefix_caching: reuse cached full blocks of a request's longest cached prefix (paged only).
        watermark: share of the usable blocks admission keeps free (paged; vLLM V0's 0.01).
        enforce_eager: run the model through transformers' own modules instead of kvtui's fused
            forward (kvtui/engine/fused.py; Llama-family models only, the others always run the
            modules). Same answers; the fused forward is faster (docs/performance.md). vLLM's flag name.
        batch_invariant: every row's logits bitwise independent of its neighbours and of the batch's
            shape (kvtui/engine/invariant.py), so a solo rerun reproduces them exactly and the
            reference detector counts any differing token, with no tolerance. Llama-family models on
            the fused forward only; slower (docs/performance.md).
        kv_offload_blocks: blocks of a host-memory KV offload tier under the prefix cache (LRU; evicted
            full blocks stored, restored on a later prefix hit: kvtui/engine/offload.py); None or 0: none.
        compile: the fused forward's decode steps as one compiled inductor graph (kvtui/engine/compiled.py):
            True compiles where it can run, False (the default: on the CPUs measured it was no faster than
            the eager step, docs/performance.md) never, None where it can run unless $KVTUI_COMPILE=0.
            Where it cannot (no C++ compiler, --enforce-eager, the batch-invariant mode, a model the fused
            forward does not run) the step runs eagerly; the runner's compile_note says why.

    Raises:
        ValueError: a field out of range, named as `field = value`.
    """

    num_slots: int = 8
    max_len: int = 512
    kv_budget_bytes: int | None = None
    max_batch_size: int = 8
    max_tokens_per_step: int = 1024
    layout: Layout = "padded"
    padding_side: PaddingSide = "right"
    bucketing: bool = False
    bucket_tolerance: float = 0.2
    slot_reuse: SlotReuse = "reuse"
    on_too_long: TooLong = "reject"
    max_waiting: int | None = None
    device: str = "cpu"
    faults: frozenset[str] = field(default_factory=frozenset)
    kv: KVMode = "slots"
    block_size: int = 16
    num_blocks: int | None = None
    prefix_caching: bool = False
    watermark: float = 0.01
    enforce_eager: bool = False
    batch_invariant: bool = False
    kv_offload_blocks: int | None = None
    compile: bool | None = False

    def __post_init__(self) -> None:
        for f in fields(self):  # in field order: the first bad field is the one named
            problem = _field_problem(f.name, getattr(self, f.name), f.default)
            if problem is not None:
                raise ValueError(problem)
        if self.kv != "paged" and self.prefix_caching:
            raise ValueError("prefix_caching needs kv = 'paged'")
        if self.kv != "paged" and self.num_blocks is not None:
            raise ValueError("num_blocks needs kv = 'paged'")
        if self.kv_offload_blocks and not self.prefix_caching:
            raise ValueError("kv_offload_blocks needs prefix_caching (and kv = 'paged')")

    def reconfigured(self, **changes) -> EngineConfig:
        """This config with `changes` (field -> value) made to fields a running engine may change
        (RUNTIME_FIELDS), as Engine.reconfigure does between steps.

        Raises:
            ValueError: another field (what sizes or places the KV pool: num_slots, max_len, kv,
                block_size, ...; faults change through Engine.set_faults), or a bad value.
            TypeError: a name that is no EngineConfig field.
        """
        fixed = sorted(set(changes) & {f.name for f in fields(self)} - RUNTIME_FIELDS)
        if fixed:
            also = "; use set_faults" if fixed[0] == "faults" else ""
            raise ValueError(f"{fixed[0]} cannot change during a run{also}")
        return replace(self, **changes)


def _field_problem(name: str, value, default) -> str | None:
    """Why `value` is no value of EngineConfig field `name` (KNOB_BOUNDS, KNOB_CHOICES), or None.
    None passes for the fields whose default is None."""
    if name == "faults" and not isinstance(value, frozenset):
        return f"faults must be a frozenset of fault names, got {value!r}"
    if name in KNOB_CHOICES and value not in KNOB_CHOICES[name]:
        return f"self.{name} = {value!r} must be {' or '.join(map(repr, KNOB_CHOICES[name]))}"
    if name in KNOB_BOUNDS and not (value is None and default is None):
        return KNOB_BOUNDS[name].problem(name, value)
    return None


def lora_mode_problem(*, enforce_eager: bool = False, batch_invariant: bool = False) -> str | None:
    """Why an engine in these modes cannot run LoRA adapters, or None: they run in kvtui's fused forward,
    which enforce_eager replaces and the batch-invariant mode does not extend to. The sentence names the
    mode; each caller adds the fix where the mode was set (a flag, engine.batch_invariant). Needs no model
    and imports nothing, so every command asks it before loading one: `kvtui serve` of its flags, the
    scenario schema of engine.batch_invariant (`kvtui validate`, `kvtui run`), `kvtui run` of its flags;
    engine/lora.py lora_problem adds the model's family."""
    if enforce_eager:
        return "LoRA adapters run on kvtui's fused forward, which --enforce-eager replaces"
    if batch_invariant:
        return "LoRA adapters are not supported in the batch-invariant mode"
    return None
