"""DashboardState: the dashboard's model, fed one recording event at a time.

Live runs and replays feed the same events (see recordings/README.md), so one piece of code serves
both. It is plain Python with no Textual import: the live worker thread owns one instance and hands
the UI thread immutable snapshots (snapshot_build.build_snapshot); a replay rebuilds one from the
recording's events.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from kvtui.events import (
    Arrive,
    Contamination,
    FaultActed,
    FaultSwitch,
    Finish,
    FirstToken,
    Header,
    Marker,
    RecordingFailed,
    RunningEntry,
    StepEvent,
    Summary,
    TimelineApplied,
)
from kvtui.faults import isolation_fault_set
from kvtui.metrics import SLO, Metrics
from kvtui.summary import evidence_text, skipped_text
from kvtui.tui.kv_map import KVMapTrack, step_owners
from kvtui.tui.lanes import Lanes
from kvtui.tui.server_track import ServerTrack
from kvtui.tui.snapshot import ContaminationView, LogLine

HISTORY_WINDOW_S = 0.5  # width of one throughput-history bar (seconds of run clock)
HISTORY_LEN = 240  # bars / steps kept in each history
REUSE_MARK_STEPS = 8  # a slot counts as "just reused" for this many steps after changing hands
MAX_TABLE_ROWS = 64  # request rows in a snapshot
MAX_CONTAMINATION = 50  # detector reports kept for the panel
MAX_LOG = 200  # event-log lines kept
TAIL_CHARS = 80  # characters of generated text kept per row
PALETTE_SIZE = 12  # request colours cycle through this many
MAX_FINISHED_KEPT = 512  # finished requests remembered (a long run forgets the oldest unflagged ones)


@dataclass
class _Request:
    id: str
    color: int
    prompt_tokens: int = 0
    max_new_tokens: int = 0
    passphrase: str | None = None
    status: str = "waiting"
    slot: int | None = None
    cache_len: int = 0
    generated: int = 0
    ttft_s: float | None = None
    text: str = ""
    leaked: dict = field(default_factory=dict)  # passphrase -> source id, as the canary detector reported
    matched: list = field(default_factory=list)  # the text the canary matched for each leak (its evidence)
    echoed: bool | None = None  # its own passphrase in its final text, as its finish event says
    contamination: list = field(default_factory=list)  # kinds, in report order, unique
    attention_mass: float | None = None
    finished_order: int = -1
    tenant: str | None = None
    blocks: int = 0  # paged KV: blocks in its table
    sampling: str = ""  # its per-row sampling state's tags ("pen bias"), as its arrive event says
    audio: str | None = None  # a speech request's audio file name
    image: str | None = None  # an image request's pictures, as its arrive event names them
    lora: str | None = None  # the LoRA adapter it runs under, as its arrive event names it


class DashboardState:
    """Everything the panels show, updated by `apply(event)`; snapshot_build.build_snapshot freezes it."""

    def __init__(self) -> None:
        self.header: Header | None = None
        self.metrics = Metrics()
        self.seq = 0
        self.step = -1
        self.t = 0.0
        self.active_faults: tuple[str, ...] = ()
        self.requests: dict[str, _Request] = {}
        self.waiting: dict[str, None] = {}  # ids in arrival order (an ordered set)
        self.active: dict[str, None] = {}
        self.recent_finished: deque = deque(maxlen=MAX_TABLE_ROWS)  # ids, newest first
        self.flagged: dict[str, None] = {}  # ids with a leak or a detector report
        self.slot_owner: dict[int, str] = {}
        self.slot_cache: dict[int, int] = {}
        self.slot_prev: dict[int, str] = {}
        self.slot_reused_step: dict[int, int] = {}
        self.num_slots = 0
        self.capacity = 0
        self.kv = "slots"  # paged KV: the block map replaces the slot map
        self.block_size = 0
        self.block_state = ""  # BlockManager.state of the last step: one character per block
        self.block_tables: dict[str, tuple[int, ...]] = {}  # running request -> its blocks
        self.tenants: dict[str, int] = {}  # tenant name -> colour index
        self.last_step: StepEvent | None = None
        self.finished = self.rejected = 0
        self._window: int | None = None
        self._window_tokens = [0, 0]
        self.prefill_history: deque = deque(maxlen=HISTORY_LEN)
        self.decode_history: deque = deque(maxlen=HISTORY_LEN)
        self.padding_history: deque = deque(maxlen=HISTORY_LEN)
        self.kv_history: deque = deque(maxlen=HISTORY_LEN)
        self.contamination: deque = deque(maxlen=MAX_CONTAMINATION)
        self.by_detector: Counter = Counter()
        self.by_kind: Counter = Counter()
        self.finished_order: deque = deque()  # finished ids, oldest first (for forgetting)
        self.log: deque = deque(maxlen=MAX_LOG)
        self._log_seq = 0
        self.summary: Summary | None = None
        self.latency_cache: dict = {}  # used by snapshot_build
        self.ttft_live: list[float] = []  # TTFT (seconds) at each first token, before requests finish
        self.server: ServerTrack | None = None  # for a run against a target server
        self.pace: float | None = None  # paced clock: modeled seconds per wall second (set by the live worker)
        self.kv_map = KVMapTrack()  # the block map's ages, reuses and marks (kv_map.py)
        self.lanes = Lanes()  # per-request timelines (lanes.py)

    # -- feeding -----------------------------------------------------------------------------
    def apply(self, event) -> None:
        """Apply one typed event (kvtui.events); types the dashboard does not show are ignored."""
        self.seq += 1
        t = getattr(event, "t", None)
        if isinstance(t, (int, float)):
            self.t = max(self.t, float(t))
        self.metrics.add_event(event)
        if self.server is not None:
            self.server.apply(event)
        handler = _HANDLERS.get(type(event))
        if handler is not None:
            handler(self, event)

    def note(self, kind: str, text: str, t: float | None = None) -> None:
        """Add an event-log line (also used by the app for its own messages, e.g. errors)."""
        self._log_seq += 1
        self.log.append(LogLine(self._log_seq, self.t if t is None else t, kind, text))

    def _header(self, e: Header) -> None:
        self.header = e
        slo = e.scenario.get("slo") or {}
        self.metrics = Metrics(SLO(slo.get("ttft_s"), slo.get("tpot_s")))
        self.latency_cache = {}
        self.num_slots = int(e.engine.get("num_slots") or 0)
        self.capacity = int(e.engine.get("max_len") or 0)
        self.active_faults = tuple(sorted(e.engine.get("faults") or ()))
        self.kv = e.engine.get("kv") or "slots"
        self.block_size = int(e.engine.get("block_size") or 0)
        if e.target:
            self.server = ServerTrack(e.target)

    def _arrive(self, e: Arrive) -> None:
        r = self.requests.get(e.request_id) or _Request(e.request_id, len(self.requests) % PALETTE_SIZE)
        r.prompt_tokens, r.max_new_tokens, r.passphrase = e.prompt_len, e.max_new_tokens, e.passphrase
        r.tenant, r.sampling, r.audio, r.image, r.lora = e.tenant, " ".join(e.sampling), e.audio, e.image, e.lora
        if e.tenant is not None:
            self.tenants.setdefault(e.tenant, len(self.tenants) % PALETTE_SIZE)
        self.requests[r.id] = r
        self.lanes.on_arrive(r.id)
        if r.status == "waiting":
            self.waiting[r.id] = None

    def _request(self, rid: str) -> _Request:
        if rid not in self.requests:  # a step naming a request we never saw arrive (cut recording)
            self.requests[rid] = _Request(rid, len(self.requests) % PALETTE_SIZE)
        return self.requests[rid]

    def _step(self, e: StepEvent) -> None:
        self.step = e.step
        self.last_step = e
        if e.num_slots is not None:  # slot KV (paged KV has no slots: its block map is drawn instead)
            self.num_slots = e.num_slots
        if self.capacity == 0 and self.num_slots:
            self.capacity = e.kv_capacity_tokens // self.num_slots
        if e.kv == "paged":
            self._blocks(e)
        for entry in e.running:
            self._running(entry)
        for f in e.flow:
            if f.request_id in self.requests:
                self.requests[f.request_id].attention_mass = f.foreign_mass
        self.kv_map.on_step(e, step_owners(self, e))
        self.lanes.on_step(e)
        self._add_history(e)

    def _blocks(self, e: StepEvent) -> None:
        """Paged KV: the block map of the step; a request preempted this step is waiting again."""
        self.kv = "paged"
        self.block_state = e.block_state or ""
        self.block_tables = {rid: tuple(blocks) for rid, blocks in e.block_tables}
        for rid in e.preempted:
            r = self._request(rid)
            r.status, r.cache_len, r.blocks = "waiting", 0, 0
            self.active.pop(rid, None)
            self.waiting[rid] = None
            self.note("marker", f"{rid} preempted: blocks given back, recomputed later", e.t)

    def _running(self, entry: RunningEntry) -> None:
        r = self._request(entry.request_id)
        slot = entry.slot
        r.status, r.slot, r.cache_len = entry.phase, slot, entry.cache_len
        self.waiting.pop(r.id, None)
        self.active[r.id] = None
        if slot is None:  # paged KV: no slot, a block table
            r.blocks = len(entry.blocks or ())
        elif self.slot_owner.get(slot) != r.id:
            previous = self.slot_owner.get(slot) or self.slot_prev.get(slot)
            if previous is not None and previous != r.id:
                self.slot_prev[slot] = previous
                self.slot_reused_step[slot] = self.step
            self.slot_owner[slot] = r.id
        if slot is not None:
            self.slot_cache[slot] = entry.cache_len
        if entry.token_id is not None:
            r.generated += 1
            self._add_text(r, entry.piece or "")

    def _add_text(self, r: _Request, piece: str) -> None:
        """The text so far; whether it leaks is the canary detector's verdict (its contamination events)."""
        r.text += piece

    def _add_history(self, e: StepEvent) -> None:
        window = int(e.t // HISTORY_WINDOW_S)
        if self._window is None:
            self._window = window
        while self._window < window:  # close finished windows, empty ones as 0
            self.prefill_history.append(self._window_tokens[0] / HISTORY_WINDOW_S)
            self.decode_history.append(self._window_tokens[1] / HISTORY_WINDOW_S)
            self._window_tokens = [0, 0]
            self._window += 1
            if window - self._window > HISTORY_LEN:
                self._window = window - HISTORY_LEN
        self._window_tokens[0] += e.prefill_tokens
        self._window_tokens[1] += e.decode_tokens
        if e.rows:
            self.padding_history.append(e.padding_ratio)
        self.kv_history.append(e.kv_usage)

    def _first_token(self, e: FirstToken) -> None:
        r = self._request(e.request_id)
        r.ttft_s = e.ttft_s
        if self.server is not None and r.status == "waiting":  # a target's request: no steps, it streams now
            r.status = "decode"
            self.waiting.pop(r.id, None)
            self.active[r.id] = None
        if e.ttft_s is not None:
            self.ttft_live.append(float(e.ttft_s))

    def _finish(self, e: Finish) -> None:
        self._forget_old()
        self.finished_order.append(e.request_id)
        r = self._request(e.request_id)
        r.status = e.finish_reason
        self.lanes.on_finish(r.id)
        self.waiting.pop(r.id, None)
        self.active.pop(r.id, None)
        self.recent_finished.appendleft(r.id)
        self.finished += 1
        r.finished_order = self.finished
        if e.finish_reason == "rejected":
            self.rejected += 1
            self.note("reject", f"{r.id} rejected: {e.detail or 'does not fit'}", e.t)
        if e.slot is not None and self.slot_owner.get(e.slot) == r.id:
            del self.slot_owner[e.slot]
            self.slot_prev[e.slot] = r.id
            self.slot_cache[e.slot] = 0
        r.slot = None
        if e.output_text != r.text:
            r.text = ""
            self._add_text(r, e.output_text)
        r.generated = e.completion_tokens if e.completion_tokens is not None else len(e.output_ids)
        r.echoed = e.passphrase_echoed

    def _forget_old(self) -> None:
        """Keep memory bounded over long runs: past MAX_FINISHED_KEPT finished requests, the oldest
        finished ones leave the state (counts and findings stay)."""
        while len(self.finished_order) >= MAX_FINISHED_KEPT:
            rid = self.finished_order.popleft()
            self.requests.pop(rid, None)
            self.lanes.forget(rid)
            self.flagged.pop(rid, None)

    def _fault(self, e: FaultSwitch) -> None:
        self.active_faults = tuple(sorted(e.active))
        self.note("fault", f"fault {e.name} {'on' if e.on else 'off'} ({e.source})", e.t)

    def _acted(self, e: FaultActed) -> None:
        self.kv_map.on_acted(e)
        self.lanes.on_acted(e)

    def _contamination(self, e: Contamination) -> None:
        self.kv_map.on_contamination(e)
        self.lanes.on_contamination(e)
        self.by_detector[e.detector] += 1
        self.by_kind[e.kind] += 1
        self.contamination.append(ContaminationView(e.t, e.step, e.detector, e.kind, e.victim, e.source,
                                                    evidence_text(e)))
        r = self._request(e.victim)
        self.flagged[r.id] = None
        if e.kind not in r.contamination:
            r.contamination.append(e.kind)
        if e.detector == "canary":
            r.leaked.setdefault(e.evidence.leaked, e.source)
            r.matched.append(e.evidence.matched)
        mass = getattr(e.evidence, "foreign_mass", None)
        if mass is not None:
            r.attention_mass = float(mass)

    def _marker(self, e: Marker) -> None:
        self.note("marker", e.text, e.t)

    def _timeline(self, e: TimelineApplied) -> None:
        """A timeline event's knob settings (a fault switch has its own `fault` line, a marker its own
        `marker` line, so an event of only those adds nothing here)."""
        knobs = [f"{k} {knob_value(v)}" for k, v in e.set.items() if k not in ("fault", "on")]
        if knobs:
            self.note("timeline", "timeline: " + ", ".join(knobs), e.t)

    def _recording_failed(self, e: RecordingFailed) -> None:
        self.note("error", f"recording stopped after {e.lines} lines: {e.error}; the run goes on", e.t)

    def _summary(self, e: Summary) -> None:
        self.summary = e
        checks = (f"; reference checks: {e.reference_checked} checked"
                  f"{skipped_text(e.reference_skipped, e.reference_skipped_by_reason)}" if e.reference_skipped else "")
        self.note("info", "run finished" + (" (stopped early)" if e.stopped_early else "") + checks, e.t)

    # -- reading -----------------------------------------------------------------------------
    @property
    def isolation_faults(self) -> tuple[str, ...]:
        """The faults `i` switches on, from the run's header; () before the header arrives (the model is still
        loading: the set is not known, and the default set would be a guess)."""
        header = self.header
        if header is None:
            return ()
        return isolation_fault_set(header.engine.get("faults"), header.scenario.get("timeline"),
                                   header.engine.get("kv") or "slots", bool(header.engine.get("prefix_caching")))


def knob_value(value) -> str:
    """A knob's value as a scenario writes it: true/false, null, 4, 0.5 (never a Python repr)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return f"{value:g}" if isinstance(value, float) else str(value)


_HANDLERS = {
    Header: DashboardState._header, Arrive: DashboardState._arrive, StepEvent: DashboardState._step,
    FirstToken: DashboardState._first_token, Finish: DashboardState._finish, FaultSwitch: DashboardState._fault,
    Contamination: DashboardState._contamination, Marker: DashboardState._marker,
    TimelineApplied: DashboardState._timeline, Summary: DashboardState._summary,
    RecordingFailed: DashboardState._recording_failed, FaultActed: DashboardState._acted,
}
