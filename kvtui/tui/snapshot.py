"""Immutable views of the dashboard state: what the worker hands the UI thread.

Everything here is a frozen dataclass of plain values and tuples, so a snapshot can cross threads
and be rendered while the worker goes on changing its own state. Times are seconds on the run's
clock (virtual or wall, as the header says); rates are tokens per second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtui.events import Summary

if TYPE_CHECKING:
    from kvtui.tui.lanes import LaneView
    from kvtui.tui.server_track import ServerView


@dataclass(frozen=True)
class SlotView:
    """One KV slot.

    Attributes:
        index: slot number.
        owner: request id holding the slot, or None when free.
        cache_len: tokens cached in the slot (tokens).
        capacity: tokens one slot can hold (engine max_len).
        color: palette index of the owner (-1 when free).
        just_reused: the slot changed hands within the last REUSE_MARK_STEPS steps.
        previous_owner: the request that held it before the current owner, if any.
        audio: the owner's audio (a speech model's request: its file name), else None.
        image: the owner's pictures (an image request: their names), else None.
    """

    index: int
    owner: str | None
    cache_len: int
    capacity: int
    color: int
    just_reused: bool
    previous_owner: str | None
    audio: str | None = None
    image: str | None = None


@dataclass(frozen=True)
class EncoderView:
    """The encoder cache of the engine (last step): a speech model's cross-attention K/V per audio, or an
    image model's projected rows per picture; entries kept of capacity, those a running request holds,
    lookups that hit / missed since the start, bytes held."""

    entries: int
    capacity: int
    referenced: int
    hits: int
    misses: int
    nbytes: int


@dataclass(frozen=True)
class StateSlotView:
    """One recurrent-state slot of a hybrid model (last step).

    Attributes:
        index: the slot; owner: the request holding it, None when free.
        checkpoint: positions (tokens) of the owner's last state checkpoint (kept with its block, or restored on
            its prefix hit), None before its first.
        color: palette index of the owner (-1: free).
    """

    index: int
    owner: str | None
    checkpoint: int | None
    color: int


@dataclass(frozen=True)
class BlockView:
    """One paged KV block (the null block 0 is left out).

    Attributes:
        index: block id.
        refs: requests holding it (0: free); shared when 2 or more (prefix caching).
        cached: it holds a cached full block (a free one can still be hit until it is evicted).
        owner: the first running request whose block table lists it, or None.
        color: palette index of the owner, or of its tenant when the run has tenants (-1: none).
    """

    index: int
    refs: int
    cached: bool
    owner: str | None
    color: int


@dataclass(frozen=True)
class MapCell:
    """One cell of the block map: a paged KV block, a KV slot, or a hybrid's recurrent-state slot.

    Attributes:
        index: the block id, slot or state slot.
        owner: the request holding it (paged: the first running request whose table lists it), None: free.
        tenant, adapter: the owner's tenant and LoRA adapter (None: none, or free).
        age: steps since its contents began (a slot: its owner took it; a block: it was allocated for what it
            holds; 0: this step); None when free.
        reused: steps since a prefix-cache hit last handed it to a request; None: never (or slots).
        color: palette index of the owner's tenant when the run has tenants, else of the owner (-1: free).
        cached: a free block still cached (a prefix hit may take it back); shared: its holders (paged).
        fault: the last fault that acted on it since its owner took it (kvtui.events.FaultActed), or None.
        detector: the last detector that fired on it since then (its report named it, or its owner as the
            victim), or None.
        previous: the request that held it before its owner (None: none known).
    """

    index: int
    owner: str | None
    tenant: str | None = None
    adapter: str | None = None
    age: int | None = None
    reused: int | None = None
    color: int = -1
    cached: bool = False
    shared: int = 0
    fault: str | None = None
    detector: str | None = None
    previous: str | None = None


@dataclass(frozen=True)
class KVMapView:
    """The block map panel's view: every KV block (paged) or slot (slots), a hybrid's state slots, and the
    bands of what has no cells of its own: the encoder cache (entries, capacity, held by a running request)
    and the KV offload tier (blocks held, capacity); None where the run has none."""

    unit: str  # "block" or "slot"
    cells: tuple[MapCell, ...]
    state: tuple[MapCell, ...] = ()
    encoder: tuple[int, int, int] | None = None
    tier: tuple[int, int] | None = None


@dataclass(frozen=True)
class PagedView:
    """Paged KV figures: block size; prefix-cache tokens looked up / hit and hits from another tenant's
    blocks; preemptions (None before a paged step)."""

    block_size: int
    prefix_queries: int
    prefix_hits: int
    cross_tenant_hits: int
    preemptions: int
    by_tenant: bool
    offload: tuple[int, int, int, int] | None = None  # the KV offload tier: tokens restored, blocks stored, held, capacity


@dataclass(frozen=True)
class RequestView:
    """One row of the request table.

    Attributes:
        id, status: request id; waiting, prefill, decode, or the finish reason (stop, length,
            abort, rejected).
        slot: slot held (None when waiting or finished).
        cache_len: tokens cached for it (tokens); capacity: slot capacity (tokens).
        prompt_tokens, generated_tokens, max_new_tokens: token counts.
        ttft_s: time to first token (seconds) or None.
        text_tail: the end of its generated text (newlines shown as ⏎).
        text_focus: the part of its text that matters, from a little before the first passphrase it holds
            (another request's first, else its own), "…" where text was left out; "" when it holds none.
        passphrase: its own canary passphrase, if the prompt has one.
        leaked: passphrases of OTHER requests the canary detector found in its text (its contamination
            events: the dashboard does no matching of its own, so it cannot disagree with the detector).
        leak_sources: the requests those passphrases belong to (ids).
        matched: the text the canary matched for each leak, as its evidence says (the passphrase or a
            fragment of it, matched ignoring case): what the row highlights.
        echoed: its own passphrase is in its final text, as its finish event says (False before then).
        contamination: kinds reported against it by detectors (cross_request, corruption, numeric).
        attention_mass: latest share of its attention on other requests' keys (0..1) or None.
        color: palette index.
        tenant: who sent it (None: one tenant); blocks: paged KV blocks in its table.
        sampling: its row's tags, short: its LoRA adapter (lora:<name>), its pictures (img:<name>) and its
            per-row sampling state ("pen bias ban min"); "" for a plain request.
    """

    id: str
    status: str
    slot: int | None
    cache_len: int
    capacity: int
    prompt_tokens: int
    generated_tokens: int
    max_new_tokens: int
    ttft_s: float | None
    text_tail: str
    passphrase: str | None
    leaked: tuple[str, ...]
    leak_sources: tuple[str, ...]
    echoed: bool
    contamination: tuple[str, ...]
    attention_mass: float | None
    color: int
    tenant: str | None = None
    blocks: int = 0
    text_focus: str = ""
    matched: tuple[str, ...] = ()
    sampling: str = ""

    @property
    def active(self) -> bool:
        return self.status in ("prefill", "decode")


@dataclass(frozen=True)
class ContaminationView:
    """One detector report: `victim` got information from `source` (None when unknown)."""

    t: float
    step: int | None
    detector: str
    kind: str
    victim: str | None
    source: str | None
    evidence: str


@dataclass(frozen=True)
class LogLine:
    """One event-log entry. kind: marker, timeline, fault, reject, error, info."""

    seq: int
    t: float
    kind: str
    text: str


@dataclass(frozen=True)
class Latency:
    """p50 and p95 of a latency (seconds), None until known."""

    p50: float | None
    p95: float | None


@dataclass(frozen=True, eq=False)
class Snapshot:
    """The whole dashboard at one moment (identity equality: a new snapshot is always new).

    Attributes:
        seq: how many events the state had applied.
        scenario, model, dtype, clock, layout: from the header.
        step: last engine step index (-1 before the first); t: run clock (seconds).
        active_faults: faults on now; isolation_faults: the set `i` switches on (() before the header arrives).
        slots, requests: the slot map and the request table rows (active, waiting, then the most
            recently finished), at most MAX_TABLE_ROWS rows.
        arrived, running, waiting, finished, rejected: request counts.
        prefill_rate, decode_rate: tokens/s over the last second of run clock.
        prefill_history, decode_history: tokens/s per HISTORY_WINDOW_S window, oldest first.
        padding_ratio, key_padding_ratio: last step's (0..1); padding_history: per step.
        kv_usage, occupancy: last step's (0..1; occupancy is slots owned of num_slots, or with paged KV
            running requests of max_batch_size); kv_history: per step.
        ttft, tpot: latency percentiles (seconds).
        contamination: latest detector reports, oldest first; by_detector, by_kind: counts.
        log: latest event-log lines, oldest first.
        done: the run has ended (summary seen); summary: the (frozen) summary event or None.
        findings: findings per kind (reports on one victim joined; kvtui/detect/findings.py).
        reference: the reference detector's (checked, skipped, pending), or None before its first report.
        kv: "slots" or "paged"; blocks: the paged block map (empty with slots); paged: its figures.
        server: a run against a target server (`kvtui run --target`): what the server exposes, which the
            slot map and the stats panel show instead of engine internals; None for a local run.
        pace: on the paced clock, modeled seconds per wall second lately (1.0: real time; below: the
            machine is slower than the model); None on other clocks or before it is known.
        encoder: a speech model's encoder cache (EncoderView), else None.
        prefix_caching: the engine caches prompt prefixes (paged KV), as the header says.
        state_slots: a hybrid model's recurrent-state slots (StateSlotView each); empty for other models.
        kv_map: the block map panel's view (KVMapView); None for a run against a target server.
        lanes: per-request timelines of the latest steps (kvtui.tui.lanes.LaneView), in arrival order.
    """

    seq: int
    scenario: str
    model: str
    dtype: str
    clock: str
    model_kind: str | None
    layout: str
    step: int
    t: float
    active_faults: tuple[str, ...]
    isolation_faults: tuple[str, ...]
    slots: tuple[SlotView, ...]
    requests: tuple[RequestView, ...]
    arrived: int
    running: int
    waiting: int
    finished: int
    rejected: int
    prefill_rate: float
    decode_rate: float
    prefill_history: tuple[float, ...]
    decode_history: tuple[float, ...]
    padding_ratio: float
    key_padding_ratio: float
    padding_history: tuple[float, ...]
    kv_usage: float
    occupancy: float
    kv_history: tuple[float, ...]
    ttft: Latency
    tpot: Latency
    contamination: tuple[ContaminationView, ...]
    by_detector: tuple[tuple[str, int], ...]
    by_kind: tuple[tuple[str, int], ...]
    log: tuple[LogLine, ...]
    done: bool
    summary: Summary | None
    findings: tuple[tuple[str, int], ...] = ()
    reference: tuple[int, int, int] | None = None
    kv: str = "slots"
    blocks: tuple[BlockView, ...] = ()
    paged: PagedView | None = None
    server: ServerView | None = None
    pace: float | None = None
    encoder: EncoderView | None = None
    prefix_caching: bool = False
    state_slots: tuple[StateSlotView, ...] = ()
    kv_map: KVMapView | None = None
    lanes: tuple[LaneView, ...] = ()

    @property
    def isolation_on(self) -> bool:
        """True when no fault is active."""
        return not self.active_faults

    @property
    def leaks(self) -> int:
        """Findings of information crossing between requests (or tenants), whichever detector saw them."""
        return sum(n for kind, n in self.findings if kind in ("cross_request", "cross_tenant"))
