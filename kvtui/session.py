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
    """

    def __init__(self, scenario, loaded, *, clock: str = "virtual", record_path=None,
                 engine_overrides: dict | None = None, listeners: tuple[Callable[[dict], None], ...] = ()) -> None:
        from kvtui.scenario import plan_requests

        self.scenario = scenario
        self.loaded = loaded
        self.clock = clock
        self.config = scenario.engine_config(**(engine_overrides or {}))
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
        self.emit(self.header())

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
            "engine": config, "clock": self.clock,
            "measured": MEASURED, "modeled": MODELED_VIRTUAL if self.clock == "virtual" else [],
        }

    def emit(self, event: dict) -> None:
        """Send one event to the recording, the metrics and every listener."""
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
            self.emit({"type": "request.arrive", "t": p.arrival_s, "request_id": p.request_id,
                       "prompt_len": len(p.prompt_ids), "max_new_tokens": state.sampling.max_new_tokens,
                       **({"passphrase": p.metadata["passphrase"]} if "passphrase" in p.metadata else {})})

    def step_once(self) -> bool:
        """Submit due arrivals, wait (wall) or jump (virtual) when idle, run one engine step.
        Returns False once every request is done."""
        if self.done:
            return False
        self._submit_due()
        engine = self.engine
        if not engine.has_unfinished():
            if self.clock == "virtual":
                engine.advance_to(self.pending[0].arrival_s)
            else:
                time.sleep(min(max(self.pending[0].arrival_s - engine.now(), 0.0), 0.05))
            return True
        report = engine.step()
        self.emit(step_event(report))
        for r in report.running:
            if r.new_token_id is not None and r.request_id not in self._seeded_first:
                self._seeded_first.add(r.request_id)
                state = engine.requests[r.request_id]
                self.emit({"type": "request.first_token", "t": state.first_token_s, "request_id": r.request_id,
                           "ttft_s": state.ttft_s})
        for f in report.finished:
            self.emit(self._finish_event(f))
        return not self.done

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
        summary = self.metrics.summary()
        summary["stopped_early"] = self.stop_requested
        summary["requests_not_submitted"] = len(self.pending)
        self.summary = summary
        self.emit({"type": "summary", "t": self.engine.now(), **summary})
        if self.recorder is not None:
            self.recorder.close()
        return summary
