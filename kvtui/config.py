"""Engine configuration: one frozen dataclass, validated when it is built."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Layout = Literal["padded", "packed"]
PaddingSide = Literal["right", "left"]
SlotReuse = Literal["reuse", "reallocate"]
TooLong = Literal["reject", "cap"]
Clock = Literal["virtual", "paced", "wall"]
DType = Literal["float32", "bfloat16", "float16"]
KVMode = Literal["slots", "paged"]


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

    def __post_init__(self) -> None:
        checks = [
            (self.num_slots >= 1, f"{self.num_slots = } must be >= 1"),
            (self.max_len >= 2, f"{self.max_len = } must be >= 2"),
            (self.kv_budget_bytes is None or self.kv_budget_bytes > 0, f"{self.kv_budget_bytes = } must be > 0"),
            (self.max_batch_size >= 1, f"{self.max_batch_size = } must be >= 1"),
            (self.max_tokens_per_step >= 1, f"{self.max_tokens_per_step = } must be >= 1"),
            (self.layout in ("padded", "packed"), f"{self.layout = } must be 'padded' or 'packed'"),
            (self.padding_side in ("right", "left"), f"{self.padding_side = } must be 'right' or 'left'"),
            (0.0 <= self.bucket_tolerance <= 10.0, f"{self.bucket_tolerance = } must be in [0, 10]"),
            (self.slot_reuse in ("reuse", "reallocate"), f"{self.slot_reuse = } must be 'reuse' or 'reallocate'"),
            (self.on_too_long in ("reject", "cap"), f"{self.on_too_long = } must be 'reject' or 'cap'"),
            (self.max_waiting is None or self.max_waiting >= 0, f"{self.max_waiting = } must be >= 0"),
            (isinstance(self.faults, frozenset), f"faults must be a frozenset of fault names, got {self.faults!r}"),
            (self.kv in ("slots", "paged"), f"{self.kv = } must be 'slots' or 'paged'"),
            (1 <= self.block_size <= 64, f"{self.block_size = } must be in 1..64"),
            (self.num_blocks is None or self.num_blocks >= 2, f"{self.num_blocks = } must be >= 2"),
            (0.0 <= self.watermark <= 0.5, f"{self.watermark = } must be in [0, 0.5]"),
            (self.kv == "paged" or not self.prefix_caching, "prefix_caching needs kv = 'paged'"),
            (self.kv == "paged" or self.num_blocks is None, "num_blocks needs kv = 'paged'"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
