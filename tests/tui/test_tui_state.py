"""DashboardState, snapshots and panels from typed events (kvtui.events): lifecycle events built
field by field and validated; detector reports taken from real detector output."""

from __future__ import annotations

import dataclasses

import pydantic
import pytest
from rich.console import Console

from kvtui.detect import CanaryDetector, EngineSignalDetector
from kvtui.events import FlowEntry, TaintEntry, parse_event
from kvtui.faults import DEFAULT_ISOLATION_OFF, FAULTS, isolation_fault_set
from kvtui.metrics import Metrics
from kvtui.tui import panels
from kvtui.tui.snapshot_build import build_snapshot
from kvtui.tui.state import HISTORY_WINDOW_S, REUSE_MARK_STEPS, DashboardState

P1, P2 = "VELVET-ORCHID-42", "BISCUIT-DRAGON-67"


# -- typed events, each validated against its type (kvtui.events) ------------------------------------
def header(slots=2, max_len=64, faults=(), timeline=(), slo=None):
    return parse_event({"type": "header", "clock": "virtual",
                        "scenario": {"name": "hand", "timeline": list(timeline), "slo": slo or {}},
                        "model": {"id": "tiny-llama", "dtype": "float32"},
                        "engine": {"num_slots": slots, "max_len": max_len, "layout": "padded", "faults": list(faults)}})


def arrive(rid, t=0.0, prompt_len=8, passphrase=None):
    return parse_event({"type": "request.arrive", "t": t, "request_id": rid, "prompt_len": prompt_len,
                        "max_new_tokens": 16, "passphrase": passphrase})


def first_token(rid, t):
    return parse_event({"type": "request.first_token", "t": t, "request_id": rid, "ttft_s": t})


def step(n, t, running=(), prefill=0, decode=0, rows=None, padding=0.0, kv=0.0, waiting=0, slots=2, **extra):
    """running: (id, slot, cache_len, token, piece) tuples; phase from token is None / not."""
    run = [{"request_id": i, "slot": s, "cache_len": c, "query_tokens": 1, "token_id": tok,
            "phase": "decode" if n else "prefill", "piece": piece} for i, s, c, tok, piece in running]
    return parse_event({
        "type": "step", "step": n, "start_s": max(t - 0.01, 0.0), "t": t, "wall_s": 0.01, "layout": "padded",
        "rows": len(run) if rows is None else rows, "prefill_tokens": prefill, "decode_tokens": decode,
        "query_positions": prefill + decode, "padded_positions": 0, "key_positions": 0, "key_padded_positions": 0,
        "padding_ratio": padding, "key_padding_ratio": padding / 2, "num_running": len(run), "max_batch_size": slots,
        "slots_used": len(run), "num_slots": slots, "kv_tokens": 0, "kv_capacity_tokens": 128, "kv_usage": kv,
        "num_waiting": waiting, "running": run, **extra})


def finish(rid, t, slot, reason="length", text=None, arrival=0.0, first=None, times=(), detail="", passphrase=None,
           echoed=None):
    return parse_event({
        "type": "request.finish", "t": t, "request_id": rid, "finish_reason": reason, "detail": detail, "slot": slot,
        "prompt_ids": [1] * 8, "output_ids": [5] * len(times), "output_text": text if text is not None else "",
        "arrival_s": arrival, "scheduled_s": arrival, "first_token_s": first, "finish_s": t,
        "token_times_s": list(times), "passphrase": passphrase, "passphrase_echoed": echoed})


def feed(*events, state=None):
    state = state or DashboardState()
    for e in events:
        state.apply(e)
    return state


def snap_of(state):
    return build_snapshot(state)


def render(renderable, width=100) -> str:
    console = Console(width=width, record=True, color_system=None, file=open("/dev/null", "w"))
    console.print(renderable)
    return console.export_text()


# -- slots -----------------------------------------------------------------------------------------
def test_slot_owner_cache_and_reuse_mark():
    s = feed(header(), arrive("r1"), arrive("r2", 0.1), step(0, 0.1, [("r1", 0, 8, 5, "a")], prefill=8),
             finish("r1", 0.1, 0), step(1, 0.2, [("r2", 0, 8, 6, "b")], prefill=8))
    slot0, slot1 = snap_of(s).slots
    assert (slot0.owner, slot0.cache_len, slot0.capacity, slot0.just_reused, slot0.previous_owner) == \
        ("r2", 8, 64, True, "r1")
    assert slot1.owner is None and slot1.color == -1 and not slot1.just_reused
    for n in range(2, 2 + REUSE_MARK_STEPS):
        s.apply(step(n, 0.2 + n / 100, [("r2", 0, 8 + n, 6, "c")], decode=1))
    assert not snap_of(s).slots[0].just_reused
    assert snap_of(s).slots[0].cache_len == 8 + 1 + REUSE_MARK_STEPS


def test_first_owner_is_not_a_reuse_and_same_step_handover_is():
    s = feed(header(), arrive("a"), step(0, 0.1, [("a", 1, 4, 1, "x")]))
    assert not snap_of(s).slots[1].just_reused
    # b takes slot 1 in the step where a finishes (its finish event comes after the step)
    feed(arrive("b"), step(1, 0.2, [("b", 1, 4, 1, "y")]), finish("a", 0.2, 1), state=s)
    view = snap_of(s).slots[1]
    assert (view.owner, view.just_reused, view.previous_owner) == ("b", True, "a")


# -- requests --------------------------------------------------------------------------------------
def test_request_rows_status_order_and_ttft():
    s = feed(header(), arrive("r1", prompt_len=5), arrive("r2", prompt_len=7), arrive("r3"),
             step(0, 0.1, [("r1", 0, 5, 9, "hi")], prefill=5, waiting=2),
             first_token("r1", 0.1))
    rows = {r.id: r for r in snap_of(s).requests}
    assert [r.id for r in snap_of(s).requests] == ["r1", "r2", "r3"]  # running first, then waiting
    assert (rows["r1"].status, rows["r1"].slot, rows["r1"].cache_len, rows["r1"].generated_tokens) == \
        ("prefill", 0, 5, 1)
    assert rows["r1"].ttft_s == 0.1 and rows["r2"].status == "waiting" and rows["r2"].prompt_tokens == 7
    feed(finish("r1", 0.3, 0, "stop", text="hi there", first=0.1, times=(0.1, 0.2)), state=s)
    snap = snap_of(s)
    assert [r.id for r in snap.requests] == ["r2", "r3", "r1"]  # finished after waiting
    assert (snap.requests[-1].status, snap.requests[-1].text_tail, snap.requests[-1].slot) == ("stop", "hi there", None)
    assert (snap.arrived, snap.running, snap.waiting, snap.finished) == (3, 0, 2, 1)


def test_text_tail_from_pieces_keeps_the_end_and_marks_newlines():
    s = feed(header(), arrive("r1"))
    for n in range(60):
        s.apply(step(n, n / 10, [("r1", 0, 8 + n, 1, "ab\n" if n == 59 else "xy")], decode=1))
    tail = snap_of(s).requests[0].text_tail
    assert tail.endswith("xyab⏎") and len(tail) == 80
    assert panels.clean("a\x0bb\nc") == "a·b⏎c"


P3 = "MAPLE-GRANITE-07"
LEAK_TEXTS = (f"The passphrase is {P1}.", "it said velvet-orchid once", f"mine is {P2}", f"{P3} and ORCHID-42",
              "nothing here", f"half of it: VELVET-ORC and {P2[:-1]}")


def test_the_row_shows_the_canary_detectors_verdicts_and_matches_nothing_itself():
    """The request table's LEAK and its echo come from the canary detector (its contamination events and
    the finish event's passphrase_echoed), never from a passphrase match of the dashboard's own: with the
    canary on, the row names exactly the passphrases and sources the canary reported (a lower-case or
    partial match included); with it off, no row says LEAK however the text reads."""
    for text in LEAK_TEXTS:
        pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
        for canary in (CanaryDetector(), None):
            s = feed(header(), arrive("r1", passphrase=P1), arrive("r2", passphrase=P2), arrive("r3", passphrase=P3))
            if canary is not None:
                for rid, phrase in (("r1", P1), ("r2", P2), ("r3", P3)):
                    canary.on_arrive(rid, phrase)
            reports = []
            for n, piece in enumerate(pieces):
                s.apply(step(n, n / 10, [("r2", 1, 8 + n, 1, piece)], decode=1))
                new = canary.on_piece("r2", piece, n / 10, n) if canary is not None else []
                feed(*new, state=s)
                reports += new
            end = canary.on_finish("r2", text, 9.0, -1) if canary is not None else []
            feed(*end, finish("r2", 9.0, 1, text=text, passphrase=P2, echoed=P2 in text), state=s)
            reports += end
            r2 = next(r for r in snap_of(s).requests if r.id == "r2")
            assert r2.leaked == tuple(e.evidence.leaked for e in reports), (text, canary)
            assert r2.leak_sources == tuple(e.source for e in reports), (text, canary)
            assert panels._status(r2).plain.startswith("LEAK") == bool(reports), (text, canary)
            assert r2.echoed == (P2 in text)
    assert [bool(canary_reports(t)) for t in LEAK_TEXTS] == [True, True, False, True, False, False]


def test_the_row_highlights_what_the_canary_matched_a_fragment_in_lower_case_included():
    """A leak the canary found as a lower-case fragment ("velvet-orchid" of VELVET-ORCHID-42) is what the
    row shows and highlights as a leak: the row's text window holds it though the full passphrase is not
    in the text, and exactly those characters carry the leak style."""
    text = "Sure. " + "x" * 120 + " it said velvet-orchid once, then stopped."
    s = feed(header(), arrive("r1", passphrase=P1), arrive("r2", passphrase=P2), arrive("r3", passphrase=P3))
    reports = canary_reports(text)
    feed(*reports, finish("r2", 9.0, 1, text=text, passphrase=P2, echoed=False), state=s)
    r2 = next(r for r in snap_of(s).requests if r.id == "r2")
    assert [e.evidence.matched for e in reports] == ["VELVET-ORCHID"] and r2.matched == ("VELVET-ORCHID",)
    shown = panels._answer(r2, 40)
    leak = [shown.plain[span.start:span.end] for span in shown.spans if span.style == panels.LEAK_STYLE]
    assert leak == ["velvet-orchid"], shown.plain


def canary_reports(text):
    canary = CanaryDetector()
    for rid, phrase in (("r1", P1), ("r2", P2), ("r3", P3)):
        canary.on_arrive(rid, phrase)
    return canary.on_finish("r2", text, 1.0, -1)


def test_echo_is_the_finish_events_verdict():
    """A row's echo is what the finish event says (the session decided it on the final text), not a
    search of the dashboard's own; before the finish it is not known, so not shown."""
    s = feed(header(), arrive("r2", passphrase=P2), step(0, 0.1, [("r2", 1, 8, 1, f"it is {P2}")]))
    assert not snap_of(s).requests[0].echoed
    feed(finish("r2", 0.2, 1, text=f"it is {P2}", passphrase=P2, echoed=False), state=s)
    assert not snap_of(s).requests[0].echoed
    s = feed(header(), arrive("r2", passphrase=P2), finish("r2", 0.2, 1, text=f"it is {P2}", passphrase=P2,
                                                             echoed=True))
    assert snap_of(s).requests[0].echoed


def test_a_leak_row_follows_the_canary_report():
    s = feed(header(), arrive("r1", passphrase=P1), arrive("r2", passphrase=P2))
    pieces = ["The ", "pass", "phrase is VELVET-", "ORCH", "ID-42. Also ", P2]
    for n, piece in enumerate(pieces):
        s.apply(step(n, n / 10, [("r2", 1, 8 + n, 1, piece)], decode=1))
    r2 = next(r for r in snap_of(s).requests if r.id == "r2")
    assert (r2.leaked, r2.leak_sources) == ((), ())  # no detector said so yet
    s.apply(canary_leak())
    assert snap_of(s).leaks == 1
    r2 = next(r for r in snap_of(s).requests if r.id == "r2")
    assert (r2.leaked, r2.leak_sources) == ((P1,), ("r1",))
    assert P1 in r2.text_focus and "LEAK←r1" in render(panels.request_table(snap_of(s), 100, 10))
    r1 = next(r for r in snap_of(s).requests if r.id == "r1")
    assert r1.leaked == () and not r1.echoed


def canary_leak():
    canary = CanaryDetector()
    canary.on_arrive("r1", P1)
    canary.on_arrive("r2", P2)
    (leak,) = canary.on_piece("r2", f"The passphrase is {P1}", 0.6, 6)
    return leak


def test_finish_text_replaces_pieces():
    s = feed(header(), arrive("r1", passphrase=P1), arrive("r2", passphrase=P2),
             step(0, 0.1, [("r2", 0, 8, 1, "x")]), finish("r2", 0.2, 0, text=f"it is {P1}"))
    r2 = next(r for r in snap_of(s).requests if r.id == "r2")
    assert r2.text_tail == f"it is {P1}" and r2.leaked == ()


# -- contamination: reports made by the real detectors ------------------------------------------------
class _Report:
    """The StepEvent fields EngineSignalDetector reads."""

    def __init__(self, step, taint=(), flow=(), nonfinite=()):
        self.step, self.taint, self.flow, self.nonfinite = step, taint, flow, nonfinite


def detector_reports():
    """A canary leak (r2 says r1's passphrase), an attention_flow report (r2 weighs r1's keys 0.73)
    and a slot_taint report (r2 may read r1's positions), as the detectors produce them."""
    canary = CanaryDetector()
    canary.on_arrive("r1", P1)
    canary.on_arrive("r2", P2)
    leak = canary.on_piece("r2", f"it is {P1}", 1.0, 7)
    signals = EngineSignalDetector().on_step(_Report(
        8, taint=(TaintEntry(request_id="r2", sources=("r1",), positions=12, examples=((0, 3, "r1"),)),),
        flow=(FlowEntry(request_id="r2", foreign_mass=0.73, pad_mass=0.0, top_source="r1"),)), 1.1)
    return leak + signals


def test_contamination_events_counts_victims_and_evidence():
    s = feed(header(), arrive("r1", passphrase=P1), arrive("r2", passphrase=P2), *detector_reports())
    snap = snap_of(s)
    assert snap.by_detector == (("attention_flow", 1), ("canary", 1), ("slot_taint", 1))
    assert snap.by_kind == (("cross_request", 3),)
    r2 = next(r for r in snap.requests if r.id == "r2")
    assert r2.leaked == (P1,) and r2.leak_sources == ("r1",) and r2.contamination == ("cross_request",)
    assert r2.attention_mass == pytest.approx(0.73)
    first = snap.contamination[0]
    assert (first.step, first.detector, first.victim, first.source) == (7, "canary", "r2", "r1")
    assert P1 in first.evidence
    assert [c.evidence for c in snap.contamination[1:]] == ["12 cells, e.g. slot 0 pos 3",
                                                           "attention on foreign keys 0.730"]


def test_attention_flow_in_step_events_feeds_the_meter():
    flow = [{"request_id": "r1", "foreign_mass": 0.0, "pad_mass": 0.0, "top_source": None},
            {"request_id": "r2", "foreign_mass": 0.61, "pad_mass": 0.0, "top_source": "r1"}]
    s = feed(header(), arrive("r1"), arrive("r2"),
             step(0, 0.1, [("r1", 0, 8, 1, "a"), ("r2", 1, 8, 1, "b")], flow=flow))
    masses = {r.id: r.attention_mass for r in snap_of(s).requests}
    assert masses == {"r1": 0.0, "r2": 0.61}


def test_contamination_for_an_unknown_victim_creates_a_row():
    (report,) = EngineSignalDetector().on_step(_Report(3, taint=(TaintEntry(request_id="ghost", sources=("<unwritten>",), positions=10,
                                                                       examples=()),)), 0.5)
    s = feed(header(), report)
    assert [r.id for r in snap_of(s).requests] == ["ghost"]
    assert (report.kind, report.source, snap_of(s).contamination[0].evidence) == ("corruption", None, "10 cells")


# -- throughput, padding, KV, latency ------------------------------------------------------------------
def test_throughput_history_per_window_with_empty_windows_as_zero():
    s = feed(header(), step(0, 0.1, prefill=10), step(1, 0.3, decode=2), step(2, 1.2, decode=4))
    snap = snap_of(s)
    assert snap.prefill_history == (10 / HISTORY_WINDOW_S, 0.0)
    assert snap.decode_history == (2 / HISTORY_WINDOW_S, 0.0)
    assert snap.decode_rate == pytest.approx(6.0)  # last 1 s of run clock (Metrics.decode_1s)


def test_padding_history_skips_idle_steps_and_kv_is_last():
    s = feed(header(), step(0, 0.1, rows=2, padding=0.5, kv=0.1), step(1, 0.2, rows=0, kv=0.0),
             step(2, 0.3, rows=1, padding=0.25, kv=0.3))
    snap = snap_of(s)
    assert snap.padding_history == (0.5, 0.25) and snap.padding_ratio == 0.25 and snap.key_padding_ratio == 0.125
    assert snap.kv_history == (0.1, 0.0, 0.3) and snap.kv_usage == 0.3


def test_latency_percentiles_ttft_at_first_token_tpot_at_finish():
    s = feed(header())
    for i, ttft in enumerate((0.1, 0.2, 0.3, 0.4)):
        feed(arrive(f"r{i}"), first_token(f"r{i}", ttft), state=s)
    snap = snap_of(s)
    assert snap.ttft.p50 == pytest.approx(0.25) and snap.ttft.p95 == pytest.approx(0.385)
    assert snap.tpot.p50 is None  # TPOT needs finished requests (Metrics)
    for i, ttft in enumerate((0.1, 0.2, 0.3, 0.4)):
        s.apply(finish(f"r{i}", 1.0, None, first=ttft, times=(ttft, ttft + 0.05, ttft + 0.15)))
    assert snap_of(s).tpot.p50 == pytest.approx(0.075) and snap_of(s).ttft.p50 == pytest.approx(0.25)


# -- faults, log, summary ---------------------------------------------------------------------------------
def test_fault_events_switch_isolation_and_are_logged():
    s = feed(header(faults=("causal_offset",)))
    assert snap_of(s).active_faults == ("causal_offset",) and not snap_of(s).isolation_on
    feed(parse_event({"type": "fault", "t": 1.0, "name": "stale_slot", "on": True, "source": "key",
                      "active": ["causal_offset", "stale_slot"]}),
         parse_event({"type": "fault", "t": 2.0, "name": "causal_offset", "on": False, "source": "timeline",
                      "active": ["stale_slot"]}), state=s)
    snap = snap_of(s)
    assert snap.active_faults == ("stale_slot",)
    assert [line.text for line in snap.log] == ["fault stale_slot on (key)", "fault causal_offset off (timeline)"]
    feed(parse_event({"type": "fault", "t": 3.0, "name": "stale_slot", "on": False, "source": "key", "active": []}),
         state=s)
    assert snap_of(s).isolation_on


def test_markers_timeline_rejections_and_summary_in_the_log():
    """A timeline event's knobs are written as a scenario writes them (the log once showed Python's
    `on=False`); its fault switch and its marker have lines of their own (the fault and marker events),
    so it adds none for them."""
    s = feed(header(), parse_event({"type": "marker", "t": 0.5, "text": "burst of 4 requests"}),
             parse_event({"type": "timeline", "t": 1.0, "at_s": 1.0, "set": {"fault": "stale_slot", "on": False},
                          "marker": "leak on"}),
             parse_event({"type": "timeline", "t": 1.2, "at_s": 1.2, "set": {
                 "engine.max_batch_size": 2, "engine.bucketing.enabled": False, "arrivals.rate_per_s": 4.0,
                 "engine.max_waiting": None}}),
             arrive("big"), finish("big", 1.5, None, "rejected", detail="prompt longer than max_len"),
             Metrics().summary(t=2.0, stopped_early=True))
    snap = snap_of(s)
    assert [(line.kind, line.text) for line in snap.log] == [
        ("marker", "burst of 4 requests"),
        ("timeline", "timeline: engine.max_batch_size 2, engine.bucketing.enabled false, arrivals.rate_per_s 4, "
                     "engine.max_waiting null"),
        ("reject", "big rejected: prompt longer than max_len"), ("info", "run finished (stopped early)")]
    assert snap.done and snap.rejected == 1 and snap.summary.stopped_early
    with pytest.raises(pydantic.ValidationError):  # the summary a snapshot carries is read-only
        snap.summary.stopped_early = False


def test_snapshot_is_frozen_and_unknown_events_are_ignored():
    s = feed(header(), arrive("r1", t=9.0), object())
    snap = snap_of(s)
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.step = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.requests[0].status = "x"
    assert isinstance(snap.requests, tuple) and isinstance(snap.slots, tuple) and snap.t == 9.0


@pytest.mark.parametrize("hdr, expected", [
    (header(), DEFAULT_ISOLATION_OFF),
    (header(faults=("no_request_mask",)), ("no_request_mask",)),
    (header(timeline=[{"at_s": 1, "set": {"fault": "fp16_cache", "on": True}}, {"at_s": 2, "set": {"x": 1}}]),
     ("fp16_cache",)),
    (header(faults=("shared_cache",), timeline=[{"at_s": 1, "set": {"fault": "shared_cache", "on": False}}]),
     ("shared_cache",)),
])
def test_isolation_fault_set(hdr, expected):
    assert isolation_fault_set(hdr.engine.get("faults"), hdr.scenario.get("timeline")) == expected
    assert snap_of(feed(hdr)).isolation_faults == expected


def test_every_fault_has_a_description_and_the_default_set_exists():
    from kvtui.scenario import FAULT_NAMES

    assert set(FAULTS) == set(FAULT_NAMES) and all(f.breaks and f.caught_by for f in FAULTS.values())
    assert set(DEFAULT_ISOLATION_OFF) <= set(FAULT_NAMES)


# -- panels (pure render functions) -----------------------------------------------------------------------
@pytest.mark.parametrize("values, width, top, expected", [
    ([], 5, None, ""), ([0, 0], 5, None, "▁▁"), ([1, 2, 4, 8], 4, None, "▂▃▅█"),
    ([0, 8], 2, None, " █"), ([1, 2, 3], 2, None, "▆█"), ([0.5], 1, 1.0, "▅"),
])
def test_sparkline(values, width, top, expected):
    assert panels.sparkline(values, width, top) == expected


@pytest.mark.parametrize("fraction, width, expected", [
    (0.0, 4, "    "), (1.0, 4, "████"), (0.5, 4, "██  "), (0.0625, 2, "▏ "), (2.0, 3, "███"),
])
def test_bar(fraction, width, expected):
    assert panels.bar(fraction, width) == expected


def test_panels_show_leaks_faults_and_detectors_as_text():
    s = feed(header(faults=("stale_slot",)), arrive("r1", passphrase=P1), arrive("r2", passphrase=P2),
             step(0, 0.1, [("r1", 0, 8, 1, "a"), ("r2", 1, 8, 1, f"=> {P1}")], prefill=16), *detector_reports())
    snap = snap_of(s)
    head = render(panels.header(snap, "LIVE", 200), 200)
    assert "isolation OFF: stale_slot" in head and "LEAKS 1" in head and "step 0" in head
    table = render(panels.request_table(snap, 120, 10), 120)
    assert "LEAK←r1" in table and P1 in table
    cont = render(panels.contamination(snap, 80, 12), 80)
    assert "canary 1" in cont and "r2 ← r1" in cont and "slot_taint" in cont and "0.73" in cont
    assert "r1 " in render(panels.slot_map(snap, 60, 6), 60)
    assert "running 2" in render(panels.stats(snap, 80, 7), 80)
    clean = snap_of(feed(header()))
    assert "isolation ON" in render(panels.header(clean, "REPLAY x1", 200), 200)
    assert "no contamination detected" in render(panels.contamination(clean, 60, 5), 60)


def test_slot_map_falls_back_to_one_character_per_slot():
    events = [header(slots=64)] + [arrive(f"r{i}") for i in range(40)]
    events.append(step(0, 0.1, [(f"r{i}", i, 8, 1, "x") for i in range(40)], slots=64))
    snap = snap_of(feed(*events))
    text = render(panels.slot_map(snap, 40, 5), 40)
    assert "40/64 slots in use" in text and "·" * 24 in text


def test_a_panel_redraws_whenever_what_it_draws_changes():
    """Each panel redraws only when its key changes, so the key must cover everything its draw reads.
    Replaying the demo recording event by event: wherever a panel's drawing changed, its key changed.
    (The contamination panel's key once left out the reference status: "reference checked 0, 2 waiting"
    stayed on screen after the run was done and every check had finished.)"""
    from pathlib import Path

    from kvtui.events import ReferenceStatus
    from kvtui.record import read_recording
    from kvtui.tui.widgets import PANELS, Panel

    _, events, _, _ = read_recording(Path(__file__).parents[2] / "recordings" / "passphrase_demo.jsonl")
    events = list(events) + [ReferenceStatus(t=events[-1].t, checked=16, skipped=0, pending=0)]
    console = Console(width=80, record=True, color_system=None)
    state = DashboardState()
    shown: dict[type, tuple] = {}
    changes = {cls: 0 for cls in PANELS if issubclass(cls, Panel)}
    for event in events:
        state.apply(event)
        snap = build_snapshot(state)
        for cls in changes:
            panel = cls.__new__(cls)  # key() and draw() read only the snapshot
            with console.capture() as capture:
                console.print(panel.draw(snap, 60, 24))
            drawn, key = capture.get(), panel.key(snap)
            if cls in shown and shown[cls][1] != drawn:
                assert shown[cls][0] != key, f"{cls.__name__} drew something new under the same key after {event!r}"
                changes[cls] += 1
            shown[cls] = (key, drawn)
    assert all(n > 0 for n in changes.values()), changes


def test_the_contamination_table_says_where_the_rest_is():
    """Beyond its limit the table names the recording that holds every report, and claims none when
    the run was not recorded (it once said "more in the recording" with no recording written)."""
    from pathlib import Path

    from kvtui.events import Contamination
    from kvtui.record import read_recording
    from kvtui.summary import print_contamination

    demo = Path(__file__).parents[2] / "recordings" / "passphrase_demo.jsonl"
    _, events, _, _ = read_recording(demo)
    reports = [e for e in events if isinstance(e, Contamination)]
    shown = 12
    assert len(reports) > shown
    for recording, caption in ((demo, f"{len(reports) - shown} more in {demo}"),
                               (None, f"{len(reports) - shown} more not shown")):
        console = Console(width=300, color_system=None)
        with console.capture() as capture:
            print_contamination(reports, console, limit=shown, recording=recording)
        text = capture.get()
        assert caption in text and "in the recording" not in text


def test_a_row_shows_its_sampling_state_and_a_constraint_report_marks_it_tainted():
    s = feed(header(), parse_event({"type": "request.arrive", "t": 0.0, "request_id": "r1", "prompt_len": 8,
                                    "max_new_tokens": 16, "sampling": ["pen", "ban"]}), arrive("r2"))
    s.apply(step(0, 0.1, [("r1", 0, 9, 5, "hello"), ("r2", 1, 9, 6, "there")], decode=2))
    table = render(panels.request_table(snap_of(s), 100, 10))
    row1, row2 = (next(line for line in table.splitlines() if line.startswith(r)) for r in ("r1", "r2"))
    assert "[pen ban] hello" in row1 and "[" not in row2 and "there" in row2
    s.apply(parse_event({"type": "contamination", "t": 0.2, "step": 0, "detector": "constraint",
                         "kind": "cross_request", "victim": "r1", "source": "r2",
                         "evidence": {"rule": "bad_words", "token_index": 0, "token_id": 5, "sampled_with": "r2"}}))
    row1 = next(line for line in render(panels.request_table(snap_of(s), 100, 10)).splitlines()
                if line.startswith("r1"))
    assert "TAINT" in row1
    assert snap_of(s).contamination[-1].evidence == "token 0 (5) is banned by its own bad_words, picked by r2's row state"
