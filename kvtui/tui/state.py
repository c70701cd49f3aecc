"""DashboardState: the dashboard's model, fed one recording event at a time.

Live runs and replays feed the same events (see recordings/README.md), so one piece of code serves
both. It is plain Python with no Textual import: the live worker thread owns one instance and hands
the UI thread immutable `snapshot()`s; a replay rebuilds one from the recording's events.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from kvtui.metrics import SLO, Metrics
from kvtui.tui.faults import isolation_fault_set
from kvtui.tui.snapshot import ContaminationView, Latency, LogLine, RequestView, SlotView, Snapshot

HISTORY_WINDOW_S = 0.5  # width of one throughput-history bar (seconds of run clock)
HISTORY_LEN = 240  # bars / steps kept in each history
REUSE_MARK_STEPS = 8  # a slot counts as "just reused" for this many steps after changing hands
MAX_TABLE_ROWS = 64  # request rows in a snapshot
MAX_CONTAMINATION = 50  # detector reports kept for the panel
MAX_LOG = 200  # event-log lines kept
TAIL_CHARS = 80  # characters of generated text kept per row
PALETTE_SIZE = 12  # request colours cycle through this many


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
    leaked: dict = field(default_factory=dict)  # passphrase -> source request id (or None)
    contamination: list = field(default_factory=list)  # kinds, in report order, unique
    attention_mass: float | None = None
    finished_order: int = -1


def _evidence_text(evidence: object) -> str:
    """One short line from a detector's evidence dict."""
    if not isinstance(evidence, dict):
        return "" if evidence is None else str(evidence)[:80]
    parts = []
    for key, value in evidence.items():
        if isinstance(value, float):
            value = f"{value:.3g}"
        elif isinstance(value, (list, tuple)):
            if all(isinstance(v, (int, float, str)) for v in value):
                value = ",".join(str(v) for v in value[:6]) + ("…" if len(value) > 6 else "")
            else:
                value = f"[{len(value)}]"
        elif isinstance(value, dict):
            value = "{…}"
        elif isinstance(value, str):
            value = value if len(value) <= 24 else value[:23] + "…"
            if not value or any(c.isspace() for c in value):
                value = repr(value)  # texts (e.g. both continuations at a divergence) keep their spaces visible
        parts.append(f"{key}={value}")
    return " ".join(parts)[:160]


class DashboardState:
    """Everything the panels show, updated by `apply(event)`; `snapshot()` freezes it."""

    def __init__(self) -> None:
        self.header: dict = {}
        self.metrics = Metrics()
        self.seq = 0
        self.step = -1
        self.t = 0.0
        self.active_faults: tuple[str, ...] = ()
        self.requests: dict[str, _Request] = {}
        self.passphrases: dict[str, str] = {}  # passphrase -> owner id
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
        self.last_step: dict = {}
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
        self.log: deque = deque(maxlen=MAX_LOG)
        self._log_seq = 0
        self.summary: dict | None = None
        self.latency_cache: dict = {}  # used by snapshot_build
        self.ttft_live: list[float] = []  # TTFT (seconds) at each first token, before requests finish

    # -- feeding -----------------------------------------------------------------------------
    def apply(self, event: dict) -> None:
        """Apply one event (a dict with "type" and "t"); unknown types are ignored."""
        self.seq += 1
        kind = event.get("type")
        t = event.get("t")
        if isinstance(t, (int, float)):
            self.t = max(self.t, float(t))
        self.metrics.add_event(event)
        handler = _HANDLERS.get(kind)
        if handler is not None:
            handler(self, event)

    def note(self, kind: str, text: str, t: float | None = None) -> None:
        """Add an event-log line (also used by the app for its own messages, e.g. errors)."""
        self._log_seq += 1
        self.log.append(LogLine(self._log_seq, self.t if t is None else t, kind, text))

    def _header(self, e: dict) -> None:
        self.header = e
        slo = (e.get("scenario") or {}).get("slo") or {}
        self.metrics = Metrics(SLO(slo.get("ttft_s"), slo.get("tpot_s")))
        self.latency_cache = {}
        engine = e.get("engine") or {}
        self.num_slots = int(engine.get("num_slots") or 0)
        self.capacity = int(engine.get("max_len") or 0)
        self.active_faults = tuple(sorted(engine.get("faults") or ()))

    def _arrive(self, e: dict) -> None:
        rid = e["request_id"]
        r = self.requests.get(rid) or _Request(rid, len(self.requests) % PALETTE_SIZE)
        r.prompt_tokens = e.get("prompt_len", 0)
        r.max_new_tokens = e.get("max_new_tokens", 0)
        r.passphrase = e.get("passphrase")
        self.requests[rid] = r
        if r.status == "waiting":
            self.waiting[rid] = None
        if r.passphrase:
            self.passphrases[r.passphrase] = rid

    def _request(self, rid: str) -> _Request:
        if rid not in self.requests:  # a step naming a request we never saw arrive (cut recording)
            self.requests[rid] = _Request(rid, len(self.requests) % PALETTE_SIZE)
        return self.requests[rid]

    def _step(self, e: dict) -> None:
        self.step = e.get("step", self.step + 1)
        self.last_step = e
        self.num_slots = e.get("num_slots", self.num_slots)
        if self.capacity == 0 and self.num_slots:
            self.capacity = e.get("kv_capacity_tokens", 0) // self.num_slots
        flow = e.get("foreign_attention") or {}
        for entry in e.get("running", ()):
            r = self._request(entry["id"])
            slot = entry["slot"]
            r.status, r.slot, r.cache_len = entry.get("phase", "decode"), slot, entry["cache_len"]
            self.waiting.pop(r.id, None)
            self.active[r.id] = None
            if self.slot_owner.get(slot) != r.id:
                previous = self.slot_owner.get(slot) or self.slot_prev.get(slot)
                if previous is not None and previous != r.id:
                    self.slot_prev[slot] = previous
                    self.slot_reused_step[slot] = self.step
                self.slot_owner[slot] = r.id
            self.slot_cache[slot] = entry["cache_len"]
            if entry.get("token") is not None:
                r.generated += 1
                self._add_text(r, entry.get("piece") or "")
        for rid, mass in flow.items():
            if rid in self.requests:
                self.requests[rid].attention_mass = float(mass)
        self._add_history(e)

    def _add_text(self, r: _Request, piece: str) -> None:
        if not piece:
            return
        r.text += piece
        for phrase, owner in self.passphrases.items():
            if owner != r.id and phrase not in r.leaked and phrase in r.text[-(len(phrase) + len(piece)):]:
                r.leaked[phrase] = owner
                self.flagged[r.id] = None

    def _add_history(self, e: dict) -> None:
        window = int(e["t"] // HISTORY_WINDOW_S)
        if self._window is None:
            self._window = window
        while self._window < window:  # close finished windows, empty ones as 0
            self.prefill_history.append(self._window_tokens[0] / HISTORY_WINDOW_S)
            self.decode_history.append(self._window_tokens[1] / HISTORY_WINDOW_S)
            self._window_tokens = [0, 0]
            self._window += 1
            if window - self._window > HISTORY_LEN:
                self._window = window - HISTORY_LEN
        self._window_tokens[0] += e.get("prefill_tokens", 0)
        self._window_tokens[1] += e.get("decode_tokens", 0)
        if e.get("rows"):
            self.padding_history.append(e.get("padding_ratio", 0.0))
        self.kv_history.append(e.get("kv_usage", 0.0))

    def _first_token(self, e: dict) -> None:
        ttft = e.get("ttft_s")
        self._request(e["request_id"]).ttft_s = ttft
        if isinstance(ttft, (int, float)):
            self.ttft_live.append(float(ttft))

    def _finish(self, e: dict) -> None:
        r = self._request(e["request_id"])
        reason = e.get("finish_reason", "stop")
        r.status = reason
        self.waiting.pop(r.id, None)
        self.active.pop(r.id, None)
        self.recent_finished.appendleft(r.id)
        self.finished += 1
        r.finished_order = self.finished
        if reason == "rejected":
            self.rejected += 1
            self.note("reject", f"{r.id} rejected: {e.get('detail') or 'does not fit'}", e.get("t"))
        slot = e.get("slot")
        if slot is not None and self.slot_owner.get(slot) == r.id:
            del self.slot_owner[slot]
            self.slot_prev[slot] = r.id
            self.slot_cache[slot] = 0
        r.slot = None
        text = e.get("output_text")
        if isinstance(text, str) and text != r.text:
            r.text = ""
            self._add_text(r, text)
        if e.get("output_ids") is not None:
            r.generated = len(e["output_ids"])

    def _fault(self, e: dict) -> None:
        active = e.get("active")
        if active is None:
            names = set(self.active_faults)
            (names.add if e.get("on") else names.discard)(e["name"])
            active = names
        self.active_faults = tuple(sorted(active))
        state = "on" if e.get("on") else "off"
        self.note("fault", f"fault {e.get('name')} {state} ({e.get('source', '?')})", e.get("t"))

    def _contamination(self, e: dict) -> None:
        detector, kind = e.get("detector", "?"), e.get("kind", "?")
        victim, source = e.get("victim"), e.get("source")
        evidence = e.get("evidence") or {}
        self.by_detector[detector] += 1
        self.by_kind[kind] += 1
        self.contamination.append(ContaminationView(e.get("t", self.t), e.get("step"), detector, kind, victim,
                                                    source, _evidence_text(evidence)))
        if victim is None:
            return
        r = self._request(victim)
        self.flagged[r.id] = None
        if kind not in r.contamination:
            r.contamination.append(kind)
        phrase = (evidence.get("passphrase") or evidence.get("leaked")) if isinstance(evidence, dict) else None
        if isinstance(phrase, str) and phrase and phrase != r.passphrase:
            r.leaked.setdefault(phrase, source or self.passphrases.get(phrase))
        mass = evidence.get("mass", evidence.get("foreign_mass")) if isinstance(evidence, dict) else None
        if isinstance(mass, (int, float)):
            r.attention_mass = float(mass)

    def _marker(self, e: dict) -> None:
        self.note("marker", str(e.get("text", "")), e.get("t"))

    def _timeline(self, e: dict) -> None:
        sets = ", ".join(f"{k}={v}" for k, v in (e.get("set") or {}).items())
        marker = e.get("marker")
        self.note("timeline", " · ".join(x for x in (marker, sets) if x), e.get("t"))

    def _summary(self, e: dict) -> None:
        self.summary = dict(e)
        self.note("info", "run finished" + (" (stopped early)" if e.get("stopped_early") else ""), e.get("t"))

    # -- reading -----------------------------------------------------------------------------
    @property
    def isolation_faults(self) -> tuple[str, ...]:
        return isolation_fault_set(self.header)

    def snapshot(self) -> Snapshot:
        """An immutable view of the current state (cheap: O(slots + MAX_TABLE_ROWS))."""
        from kvtui.tui.snapshot_build import build_snapshot

        return build_snapshot(self)


_HANDLERS = {
    "header": DashboardState._header, "request.arrive": DashboardState._arrive, "step": DashboardState._step,
    "request.first_token": DashboardState._first_token, "request.finish": DashboardState._finish,
    "fault": DashboardState._fault, "contamination": DashboardState._contamination,
    "marker": DashboardState._marker, "timeline": DashboardState._timeline, "summary": DashboardState._summary,
}
