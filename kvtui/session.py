"""The run loop shared by headless runs and the dashboard: drive arrivals, step, emit events.

Flow: scenario -> planned requests -> Engine.submit at their arrival time -> Engine.step ->
events (request.arrive, step, request.first_token, request.finish, marker) -> sinks (recording,
metrics, listeners such as the dashboard). Replays feed recorded events to the same Metrics, so a
replay's summary equals the live one.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from dataclasses import asdict

import torch
import transformers

import kvtui
from kvtui.detect import (DETECTOR_NAMES, CanaryDetector, EngineSignalDetector, ReferenceDetector,
                          contamination_event)
from kvtui.engine import Engine
from kvtui.metrics import SLO, Metrics
from kvtui.record import FORMAT, VERSION, RecordingWriter, step_event

MEASURED = ["step.wall_s", "summary.measured_step_wall_s"]
MODELED_VIRTUAL = ["t", "start_s", "arrival_s", "scheduled_s", "first_token_s", "finish_s", "token_times_s",
                   "all latencies and tokens/s in the summary"]


class Session:
    """One run of a scenario on a loaded model.

    Args:
        scenario: a kvtui.scenario.Scenario.
        loaded: a kvtui.models.LoadedModel.
        clock: "virtual" (deterministic, headless default) or "wall" (real time).
        record_path: JSONL recording to write, or None.
        engine_overrides: EngineConfig fields that replace the scenario's (from CLI flags).
        listeners: callables receiving every event dict (e.g. the dashboard's publisher).
        detectors: which of DETECTOR_NAMES run (all by default).
        faults: isolation faults on from the start (added to the scenario's engine.faults).
        fault_switches: False ignores the timeline's fault switches (a run "with the fault removed").
    """

    def __init__(self, scenario, loaded, *, clock: str = "virtual", record_path=None,
                 engine_overrides: dict | None = None, listeners: tuple[Callable[[dict], None], ...] = (),
                 detectors: tuple[str, ...] = DETECTOR_NAMES, faults: tuple[str, ...] = (),
                 fault_switches: bool = True) -> None:
        from kvtui.scenario import plan_requests

        self.scenario = scenario
        self.loaded = loaded
        self.clock = clock
        overrides = dict(engine_overrides or {})
        base = scenario.engine_config(**overrides)
        if faults:
            overrides["faults"] = frozenset(base.faults) | frozenset(faults)
        self.config = scenario.engine_config(**overrides)
        tokenizer = loaded.tokenizer
        self.tokenizer = tokenizer
        self.engine = Engine(loaded.model, self.config, eos_token_ids=loaded.eos_token_ids, tokenizer=tokenizer,
                             clock=clock, pad_token_id=tokenizer.pad_token_id or 0)
        self.pending = sorted(plan_requests(scenario, tokenizer), key=lambda p: (p.arrival_s, p.request_id))
        slo = getattr(scenario, "slo", None)
        self.metrics = Metrics(SLO(getattr(slo, "ttft_s", None), getattr(slo, "tpot_s", None)))
        self.recorder = RecordingWriter(record_path) if record_path else None
        self.listeners = list(listeners)
        self.stop_requested = False
        self.summary: dict | None = None
        self._seeded_first: set[str] = set()
        unknown = sorted(set(detectors) - set(DETECTOR_NAMES))
        if unknown:
            raise ValueError(f"unknown detector {unknown[0]!r}; known: {', '.join(DETECTOR_NAMES)}")
        self.detectors = tuple(detectors)
        self.engine.detect_taint = "slot_taint" in detectors
        self.engine.measure_flow = "attention_flow" in detectors
        self.signals = EngineSignalDetector(taint="slot_taint" in detectors, flow="attention_flow" in detectors)
        self.canary = CanaryDetector() if "canary" in detectors else None
        self.reference = ReferenceDetector(loaded, tokenizer) if "reference" in detectors else None
        self.timeline = sorted(getattr(scenario, "timeline", []) or [], key=lambda e: e.at_s)
        self.fault_switches = fault_switches
        self.contamination: list[dict] = []
        self.fault_history: list[tuple[float, str, bool]] = [(0.0, n, True) for n in sorted(self.engine.faults)]
        self.fault_counts: dict[str, int] = {}
        self._token_steps: dict[str, list[int]] = {}
        self.emit(self.header())
        for name in sorted(self.engine.faults):
            self.emit({"type": "fault", "t": 0.0, "name": name, "on": True, "source": "config",
                       "active": sorted(self.engine.faults)})

    # -- events -------------------------------------------------------------------------------
    def header(self) -> dict:
        loaded, scenario = self.loaded, self.scenario
        config = asdict(self.config)
        config["faults"] = sorted(config["faults"])
        return {
            "type": "header", "format": FORMAT, "version": VERSION, "kvtui_version": kvtui.__version__,
            "created_unix_s": time.time(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "scenario": scenario.normalized(),
            "scenario_hash": scenario.content_hash(), "seed": scenario.seed,
            "model": {"id": loaded.model_id, "path": loaded.source_path, "sha256": loaded.source_sha256,
                      "dtype": str(loaded.dtype).replace("torch.", "")},
            "engine": config, "clock": self.clock, "detectors": list(self.detectors),
            "measured": MEASURED, "modeled": MODELED_VIRTUAL if self.clock == "virtual" else [],
        }

    def emit(self, event: dict) -> None:
        """Send one event to the recording, the metrics and every listener."""
        if event.get("type") == "contamination":
            self.contamination.append(event)
            if event["kind"] != "numeric":
                for name in self.engine.faults:
                    self.fault_counts[name] = self.fault_counts.get(name, 0) + 1
        if self.recorder is not None:
            self.recorder.write(event)
        self.metrics.add_event(event)
        for listener in self.listeners:
            listener(event)

    # -- loop -----------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return not self.pending and not self.engine.has_unfinished()

    def _submit_due(self) -> None:
        now = self.engine.now()
        while self.pending and self.pending[0].arrival_s <= now:
            p = self.pending.pop(0)
            state = self.engine.submit(p.request_id, p.prompt_ids, p.sampling, arrival_s=p.arrival_s,
                                       metadata=p.metadata)
            if self.canary is not None:
                self.canary.on_arrive(p.request_id, p.metadata.get("passphrase"))
            self.emit({"type": "request.arrive", "t": p.arrival_s, "request_id": p.request_id,
                       "prompt_len": len(p.prompt_ids), "max_new_tokens": state.sampling.max_new_tokens,
                       **({"passphrase": p.metadata["passphrase"]} if "passphrase" in p.metadata else {})})

    def _apply_timeline(self) -> None:
        """Apply every timeline event whose time has come (engine knobs, faults, arrival rate, markers)."""
        now = self.engine.now()
        while self.timeline and self.timeline[0].at_s <= now:
            item = self.timeline.pop(0)
            self.emit({"type": "timeline", "t": now, "at_s": item.at_s, "set": dict(item.set), "marker": item.marker})
            overrides = item.engine_overrides()
            if overrides:
                self.engine.reconfigure(**overrides)
            switch = item.fault_switch
            if switch and self.fault_switches:
                self.set_fault(switch[0], switch[1], source="timeline")
            rate = item.arrival_changes().get("rate_per_s")
            current = getattr(getattr(self.scenario, "arrivals", None), "rate_per_s", None)
            if rate and current:
                self.scale_arrival_rate(rate / current)
            if item.marker:
                self.emit({"type": "marker", "t": now, "text": item.marker})

    def step_once(self) -> bool:
        """Submit due arrivals, wait (wall) or jump (virtual) when idle, run one engine step.
        Returns False once every request is done."""
        if self.done:
            return False
        self._apply_timeline()
        self._submit_due()
        engine = self.engine
        if not engine.has_unfinished():
            if self.reference is not None and self.reference.queue and self.clock == "wall":
                self._drain_references(limit=1)  # idle time: check one finished request against its solo run
                return True
            if self.clock == "virtual":
                engine.advance_to(self.pending[0].arrival_s)
            else:
                time.sleep(min(max(self.pending[0].arrival_s - engine.now(), 0.0), 0.05))
            return True
        report = engine.step()
        t = report.end_s
        event = step_event(report)
        if report.flow:
            event["foreign_attention"] = {f.request_id: round(f.foreign_mass, 6) for f in report.flow}
        pieces = []
        for entry in event["running"]:  # the decoded text of each new token, so replays need no tokenizer
            if entry["token"] is not None:
                entry["piece"] = self.tokenizer.decode([entry["token"]], skip_special_tokens=True)
                pieces.append((entry["id"], entry["piece"]))
                self._token_steps.setdefault(entry["id"], []).append(report.step)
        self.emit(event)
        for request_id, slot, previous, kept in report.stale_starts:
            self.emit({"type": "marker", "t": t, "text": f"{request_id} took slot {slot} stale: {kept} tokens of "
                                                          f"{previous} kept (stale_slot)"})
        for request_id, text in report.errors:
            self.emit(contamination_event(t=t, step=report.step, detector="engine", kind="corruption",
                                          victim=request_id, source=None, evidence={"error": text}))
        for e in self.signals.on_step(report, t, contamination_event):
            self.emit(e)
        if self.canary is not None:
            for request_id, piece in pieces:
                for e in self.canary.on_piece(request_id, piece, t, report.step, contamination_event):
                    self.emit(e)
        for r in report.running:
            if r.new_token_id is not None and r.request_id not in self._seeded_first:
                self._seeded_first.add(r.request_id)
                state = engine.requests[r.request_id]
                self.emit({"type": "request.first_token", "t": state.first_token_s, "request_id": r.request_id,
                           "ttft_s": state.ttft_s})
        for f in report.finished:
            finish = self._finish_event(f)
            if self.canary is not None and f.finish_reason != "rejected":
                for e in self.canary.on_finish(f.request_id, finish["output_text"], t, report.step,
                                               contamination_event):
                    self.emit(e)
            self.emit(finish)
            if self.reference is not None and f.finish_reason in ("stop", "length"):
                state = engine.requests[f.request_id]
                self.reference.on_finish(f.request_id, f.prompt_ids, f.output_ids, state.top2_gaps, state.sampling,
                                         self._token_steps.get(f.request_id, []))
        return not self.done

    def _drain_references(self, limit: int | None = None) -> None:
        for e in self.reference.drain(self.engine.now(), contamination_event, limit=limit):
            self.emit(e)

    def _finish_event(self, f) -> dict:
        text = self.tokenizer.decode(list(f.output_ids), skip_special_tokens=True)
        event = {"type": "request.finish", "t": f.finish_s, "request_id": f.request_id,
                 "finish_reason": f.finish_reason, "detail": f.detail, "slot": f.slot,
                 "prompt_ids": list(f.prompt_ids), "output_ids": list(f.output_ids), "output_text": text,
                 "arrival_s": f.arrival_s, "scheduled_s": f.scheduled_s, "first_token_s": f.first_token_s,
                 "finish_s": f.finish_s, "token_times_s": list(f.token_times_s)}
        if "passphrase" in f.metadata:
            event["passphrase"] = f.metadata["passphrase"]
            event["passphrase_echoed"] = f.metadata["passphrase"] in text
        return event

    # -- live controls (dashboard keys) ------------------------------------------------------
    def shift_clock(self, seconds: float) -> None:
        """Wall clock: exclude `seconds` (a pause) from every later timestamp; pending arrivals keep their
        place relative to the run."""
        self.engine.shift_clock(seconds)

    def set_fault(self, name: str, on: bool, source: str = "key") -> None:
        """Switch one isolation fault on or off from the next step; emits a `fault` event.

        Raises:
            ValueError: unknown fault name.
        """
        from kvtui.scenario import FAULT_NAMES

        if name not in FAULT_NAMES:
            raise ValueError(f"unknown fault {name!r}; known: {', '.join(FAULT_NAMES)}")
        if (name in self.engine.faults) == on:
            return
        (self.engine.faults.add if on else self.engine.faults.discard)(name)
        self.fault_history.append((self.engine.now(), name, on))
        self.emit({"type": "fault", "t": self.engine.now(), "name": name, "on": on, "source": source,
                   "active": sorted(self.engine.faults)})

    def scale_arrival_rate(self, factor: float) -> None:
        """Multiply the arrival rate of requests not yet arrived by `factor` (> 0): their remaining
        wait from now is divided by it."""
        if factor <= 0:
            raise ValueError(f"{factor = } must be > 0")
        now = self.engine.now()
        for p in self.pending:
            if p.arrival_s > now:
                object.__setattr__(p, "arrival_s", now + (p.arrival_s - now) / factor)
        self.emit({"type": "marker", "t": now, "text": f"arrival rate x{factor:g}"})

    def burst(self, count: int) -> int:
        """Make the next `count` pending requests arrive now; returns how many moved."""
        now = self.engine.now()
        moved = 0
        for p in self.pending[:count]:
            if p.arrival_s > now:
                object.__setattr__(p, "arrival_s", now)
            moved += 1
        if moved:
            self.emit({"type": "marker", "t": now, "text": f"burst of {moved} requests"})
        return moved

    def run(self, on_progress: Callable[["Session"], None] | None = None) -> dict:
        """Step until done or stop_requested; then close. Returns the summary."""
        try:
            while not self.stop_requested and self.step_once():
                if on_progress is not None:
                    on_progress(self)
        finally:
            self.close()
        return self.summary

    def close(self) -> dict:
        """Abort what is still in flight (after a stop), write the summary line, close the recording."""
        if self.summary is not None:
            return self.summary
        for request_id, state in list(self.engine.requests.items()):
            if not state.is_done:
                self.engine.abort(request_id)
        if self.engine.has_unfinished():
            report = self.engine.step()  # reports the aborted requests
            for f in report.finished:
                self.emit(self._finish_event(f))
        if self.reference is not None:
            self._drain_references()
        summary = self.metrics.summary()
        summary["faults_active_at_end"] = sorted(self.engine.faults)
        summary["contamination_by_fault"] = dict(self.fault_counts)
        summary["stopped_early"] = self.stop_requested
        summary["requests_not_submitted"] = len(self.pending)
        self.summary = summary
        self.emit({"type": "summary", "t": self.engine.now(), **summary})
        if self.recorder is not None:
            self.recorder.close()
        return summary
