"""The run loop shared by headless runs and the dashboard: drive arrivals, step, detect, emit events.

Flow: scenario -> planned requests -> Engine.submit at their arrival time -> Engine.step -> typed
events (kvtui.events) -> sinks (recording, metrics, listeners such as the dashboard). Replays feed
recorded events to the same Metrics, so a replay's summary equals the live one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, replace

from kvtui.detect import DETECTOR_NAMES
from kvtui.engine import Engine
from kvtui.engine.fused import auto_batch_invariant
from kvtui.events import (
    FaultSwitch,
    Finish,
    FirstToken,
    Header,
    Marker,
    ModelInfo,
    StepEvent,
    Summary,
    TimelineApplied,
)
from kvtui.faults import check_fault_names
from kvtui.memory import release_free_memory
from kvtui.metrics import SLO
from kvtui.pacing import Pacer
from kvtui.run.base import RunBase
from kvtui.run.build import arrive_event, finish_event, run_header
from kvtui.run.intake import Admitted, Intake, load_adapters
from kvtui.run.observers import Arrival, Finished, Observer, ObserverContext, StepSeen, build_observers
from kvtui.run.observers import check_names as check_detector_names
from kvtui.run.sink import Listener, RunSink
from kvtui.run.trails import Trails

MEASURED = ("step.wall_s", "summary.measured_step_wall_s")
MODELED_VIRTUAL = ("t", "start_s", "arrival_s", "scheduled_s", "first_token_s", "finish_s", "token_times_s",
                   "all latencies and tokens/s in the summary")

MODELED_CLOCKS = ("virtual", "paced")  # clocks whose times are modeled (paced: virtual, held to the wall)
MAX_KEPT_REPORTS = 1000  # contamination reports the session keeps in memory (all go to the recording)
TRIM_EVERY_STEPS = 256


def build_session(scenario, loaded, *, clock: str = "virtual", record=None, device: str = "cpu",
                  layout: str | None = None, faults: tuple[str, ...] = (), clear_faults: bool = False,
                  detectors: tuple[str, ...] = DETECTOR_NAMES, listeners: tuple[Listener, ...] = (),
                  cost_model: str = "auto", serving: bool = False, planned: list | None = None,
                  pacer: Pacer | None = None, enforce_eager: bool = False,
                  batch_invariant: bool | None = None,
                  progress: Callable[[str], None] | None = None) -> "Session":
    """The Session the headless run and the dashboard both use, from CLI-level choices.

    Args:
        layout: overrides the scenario's engine layout when given.
        faults: faults on from the start, added to the scenario's.
        clear_faults: drop the scenario's faults (engine.faults and timeline switches).
        cost_model: the virtual clock's step costs: "auto" (this machine's `kvtui calibrate` fit for the
            model when there is one, else the built-in fit) or "default" (the built-in fit).
        serving: requests come from submit_external (kvtui serve), not the scenario (see Session).
        planned: the scenario's planned requests when the caller planned them already (see Session).
        pacer: the paced clock's Pacer (default: one on the real wall clock).
        enforce_eager: run the model's own transformers modules, not kvtui's fused forward
            (EngineConfig.enforce_eager).
        batch_invariant: overrides the scenario's engine.batch_invariant when given
            (EngineConfig.batch_invariant).
        progress: hears one line when the numeric tolerance is measured at load (see Session).

    Raises:
        ValueError: a bad engine value or fault/detector name; OSError: the recording path.
    """
    overrides: dict = {"device": device}
    if layout:
        overrides["layout"] = layout
    if clear_faults:
        overrides["faults"] = frozenset()
    if enforce_eager:
        overrides["enforce_eager"] = True
    if batch_invariant is not None:
        overrides["batch_invariant"] = batch_invariant
    return Session(scenario, loaded, clock=clock, record_path=record, engine_overrides=overrides,
                   listeners=listeners, detectors=detectors, faults=faults, fault_switches=not clear_faults,
                   cost_model=cost_model, serving=serving, planned=planned, pacer=pacer, progress=progress)


class Session(RunBase):
    """One run of a scenario on a loaded model.

    Args:
        scenario: a kvtui.scenario.Scenario.
        loaded: a kvtui.models.LoadedModel.
        clock: "virtual" (deterministic, headless default), "paced" (the virtual clock's steps and tokens,
            each step started no earlier than its modeled time on the wall clock: kvtui/pacing.py) or
            "wall" (real time).
        record_path: JSONL recording to write, or None.
        engine_overrides: EngineConfig fields that replace the scenario's (from CLI flags).
        listeners: callables receiving every typed event (e.g. the dashboard's publisher).
        detectors: which of DETECTOR_NAMES run (all by default).
        faults: isolation faults on from the start (added to the scenario's engine.faults).
        fault_switches: False ignores the timeline's fault switches (a run "with the fault removed").
        cost_model: "default" (the built-in step-cost fit) or "auto" (the calibrated fit when there is
            one; see kvtui/calibrate.py). Virtual clock only.
        serving: plan no scenario arrivals; requests come only from `submit_external` (any thread), and
            the session is never done until stopped (kvtui serve). Use the wall clock.
        planned: `plan_requests(scenario, tokenizer)` when the caller has it already (the CLI checks
            the plan before the run); None plans here.
        pacer: for clock="paced": the Pacer holding modeled time to the wall (default: a real one; tests
            pass one with a fake wall clock and sleep).
        progress: hears one line when the reference detector measures this machine's numeric tolerance
            (a bfloat16 / float16 model with no stored calibration; kvtui/detect/tolerance.py).

    Raises:
        ValueError: an unknown detector or fault, or a bad engine value.
        OSError: the recording cannot be created, its header cannot be written, or another
            writer holds it (errno EAGAIN). A write that fails later only stops the recording
            (`recording_error` says why; listeners get a RecordingFailed event).
    """

    def __init__(self, scenario, loaded, *, clock: str = "virtual", record_path=None,
                 engine_overrides: dict | None = None, listeners: tuple[Listener, ...] = (),
                 detectors: tuple[str, ...] = DETECTOR_NAMES, faults: tuple[str, ...] = (),
                 fault_switches: bool = True, cost_model: str = "default", serving: bool = False,
                 planned: list | None = None, pacer: Pacer | None = None,
                 progress: Callable[[str], None] | None = None) -> None:
        self.scenario, self.loaded, self.clock = scenario, loaded, self._check_clock(clock)
        self.pacer = (pacer or Pacer()) if clock == "paced" else None
        self.tokenizer = loaded.tokenizer
        self.detectors = check_detector_names(detectors)
        self.config = self._engine_config(engine_overrides, faults)
        self.cost_model = self._cost_model(cost_model)
        self.engine, self.adapters = self._make_engine(), self._adapters(scenario)  # adapters: engine/lora.py
        # the one way in to the engine: planned requests become engine requests there (kvtui/run/intake.py)
        self.intake = Intake(self.engine, self.adapters, getattr(loaded, "feature_extractor", None))
        self.serving = serving
        self.pending = self._planned(planned)
        self.submitted: dict = {}  # engine request id (each sequence's) -> its PlannedRequest, until it finishes
        self.observers: list[Observer] = build_observers(  # the detectors, in the order their reports go out
            self.detectors, ObserverContext(self.detectors, loaded, self.tokenizer, self.config, progress))
        self.timeline = list(scenario.timeline)
        self.fault_switches = fault_switches
        self.sink = RunSink(SLO(scenario.slo.ttft_s, scenario.slo.tpot_s), clock=self.engine.now,
                            record_path=record_path, listeners=listeners, keep=MAX_KEPT_REPORTS,
                            on_finding=lambda report: self._trails.count(report, self.engine.faults))
        self.stop_requested = False
        self.summary: Summary | None = None
        self.fault_history: list[tuple[float, str, bool]] = [(0.0, n, True) for n in sorted(self.engine.faults)]
        self.unapplied_timeline: list = []
        self._trails = Trails()  # the running requests' trails, the faults on at each step and the reports per fault
        self._round: int | None = None  # `process: rounds`: the round arriving or running now
        self._started()

    def _planned(self, planned: list | None) -> list:
        """The requests to submit, in arrival order (none when serving)."""
        from kvtui.scenario import plan_requests

        if self.serving:
            return []
        if planned is None:
            planned = plan_requests(self.scenario, self.tokenizer)
        return sorted(planned, key=lambda p: (p.arrival_s, p.request_id))

    def _make_engine(self) -> Engine:
        """The run's engine: on the virtual clock for the paced clock too (the pacer only waits)."""
        engine = Engine.from_loaded(self.loaded, self.config, cost_model=self.cost_model[0],
                                    clock="virtual" if self.clock in MODELED_CLOCKS else self.clock)
        engine.detect_taint = "slot_taint" in self.detectors
        engine.measure_flow = "attention_flow" in self.detectors
        engine.output.record_draws = "reference" in self.detectors
        return engine

    def _adapters(self, scenario):
        """The LoRA adapters requests may name (engine/lora.py AdapterRegistry), the scenario's loaded.
        Raises ValueError (one line) when this engine cannot run them (kvtui.run.intake.load_adapters)."""
        names = scenario.lora.loaded if getattr(scenario, "lora", None) is not None else ()
        return load_adapters(self.loaded, names, enforce_eager=self.config.enforce_eager,
                             batch_invariant=self.config.batch_invariant)

    def reload_adapter(self, name: str):
        """Load built-in adapter `name` again with its next version's weights (scenario/lora.py
        reload_seed); requests submitted from now on run under them. Returns the new LoraAdapter."""
        from kvtui.scenario.lora import reload_seed

        old = self.adapters.get(name)
        return self.adapters.load(name, seed=reload_seed(name, 1 if old is None else old.version + 1))

    def _engine_config(self, engine_overrides: dict | None, faults) -> object:
        overrides = dict(engine_overrides or {})
        if faults:
            base = self.scenario.engine_config(**overrides)
            overrides["faults"] = frozenset(base.faults) | check_fault_names(faults)
        config = self.scenario.engine_config(**overrides)
        if self.scenario.engine.batch_invariant is None and "batch_invariant" not in overrides:  # unset: auto
            auto = self.scenario.lora is None and auto_batch_invariant(self.loaded, config, self.detectors)
            config = replace(config, batch_invariant=auto)  # adapters do not run in the mode: off with LoRA
        return config

    def _cost_model(self, which: str):
        from kvtui.calibrate import load_cost_model

        if which not in ("auto", "default"):
            raise ValueError(f"cost model {which!r}: use 'auto' or 'default'")
        model, described = load_cost_model(self.loaded.model_id, str(self.loaded.dtype).replace("torch.", ""),
                                           str(self.config.device))
        if which == "default" and described["source"] != "default":
            from kvtui.engine import StepCostModel

            model, described = StepCostModel(), {"source": "default", **asdict(StepCostModel())}
        return model, described

    @staticmethod
    def _check_clock(clock: str) -> str:
        if clock not in ("wall", *MODELED_CLOCKS):
            raise ValueError(f"clock {clock!r}: use 'virtual', 'paced' or 'wall'")
        return clock

    def _started(self) -> None:
        self._start_recording(self.header())  # the header unwritable (e.g. /dev/full): refused here (OSError)
        for name in sorted(self.engine.faults):
            self.emit(FaultSwitch(t=0.0, name=name, on=True, source="config", active=tuple(sorted(self.engine.faults))))

    # -- what the run tells (kvtui.run.outcome.RunOutcome; the sink's properties: kvtui.run.base.RunBase) --
    faults_known = True  # kvtui's own engine: fault_history is every fault that was on

    # -- events -------------------------------------------------------------------------------
    def header(self) -> Header:
        """The recording's first line: versions, scenario, model, engine config, clock."""
        loaded, modeled = self.loaded, self.clock in MODELED_CLOCKS
        config = asdict(self.config)
        config["faults"] = sorted(config["faults"])
        if self.config.batch_invariant:
            config["invariant_tile"] = self.engine.runner.tiles.size
        return run_header(
            self.scenario, model=ModelInfo(id=loaded.model_id, path=loaded.source_path, sha256=loaded.source_sha256,
                                           dtype=str(loaded.dtype).replace("torch.", ""), kind=loaded.kind),
            engine=config, clock=self.clock, detectors=self.detectors, measured=MEASURED,
            modeled=MODELED_VIRTUAL if modeled else (), cost_model=self.cost_model[1] if modeled else None,
            reference_tolerance=next((o.detector.numeric.described for o in self.observers if o.name == "reference"),
                                     None))

    def now(self) -> float:
        """Seconds on the engine's clock."""
        return self.engine.now()

    # -- loop -----------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return not self.serving and not self.pending and not self.engine.has_unfinished()

    def submit_external(self, planned) -> None:
        """Thread-safe: submit a request made outside the scenario (a PlannedRequest; its arrival_s is
        the time it arrived on the engine clock) at the start of the next step_once (Intake.put)."""
        self.intake.put(planned)

    def abort_external(self, request_id: str) -> None:
        """Thread-safe: abort `request_id` at the next step boundary (nothing if it already left)."""
        self.intake.abort(request_id)

    def call_external(self, fn):
        """Thread-safe: call `fn()` in the engine thread at the start of the next step_once, in order with
        the submissions queued before and after it (kvtui serve loads LoRA adapters so). Returns a
        concurrent.futures.Future with its result or exception."""
        return self.intake.call(fn)

    def _drain_external(self) -> None:
        for outcome in self.intake.drain():
            self._on_submitted(outcome)

    def step_once(self) -> bool:
        """Apply the timeline, submit due arrivals, then one engine step (or idle: wait for the next
        arrival on the wall clock, jump to it on the virtual clock). Returns False once every request
        is done."""
        if self.done:
            return False
        self._apply_timeline()
        self._drain_external()
        self._submit_due()
        if not self.engine.has_unfinished():
            self._idle()
            return True
        report = self.engine.step()
        self._trails.on_step(report)
        pieces = self._emit_step(report)
        self.intake.cancel_due()
        self._emit_all(o.on_step(StepSeen(report.t, report.step, pieces, report)) for o in self.observers)
        self._emit_finished(report)
        if self.clock == "virtual" and any(o.pending >= o.batch for o in self.observers):
            self._drain_observers(lambda: self.stop_requested, one_batch=True)  # spread over the run, not all at the end
        if report.step % TRIM_EVERY_STEPS == TRIM_EVERY_STEPS - 1:
            release_free_memory()
        return not self.done

    def _submit_due(self) -> None:
        now = self.engine.now()
        while self.pending and self.pending[0].arrival_s <= now and not self._round_held(now):
            self._submit(self.pending.pop(0))

    def _round_held(self, now: float) -> bool:
        """`process: rounds`: the next request waits while a request of an earlier round is unfinished;
        when none is, its whole round arrives now (their arrival_s set to `now`)."""
        head = self.pending[0]
        if head.round is None or head.round == self._round:
            return False
        if self.engine.has_unfinished():
            return True
        self._round = head.round
        self.pending = [replace(p, arrival_s=now) if p.round == head.round else p for p in self.pending]
        return False

    def _submit(self, p) -> None:
        """Submit planned request `p` through the intake and emit its arrival (see _on_submitted)."""
        self._on_submitted(self.intake.submit(p))

    def _on_submitted(self, outcome) -> None:
        """Emit what the intake did with a request: one arrive event per sequence it runs as (kept by
        sequence id in `submitted` until it finishes), or, for one refused (a duplicate id, an adapter
        unloaded meanwhile, a value no check caught), its finish with `error` alone, so its client gets
        an answer and every other request goes on."""
        p = outcome.planned
        if not isinstance(outcome, Admitted):
            self.emit(finish_event(p, passphrase=False, t=self.engine.now(), finish_reason="error",
                                   detail=outcome.detail, code=outcome.code, arrival_s=p.arrival_s,
                                   finish_s=self.engine.now()))
            return
        state = outcome.state
        for request_id in outcome.sequence_ids:  # n > 1: one arrival per sequence
            sequence = replace(p, request_id=request_id) if request_id != p.request_id else p
            self.submitted[request_id] = sequence
            arrive = arrive_event(sequence, max_new_tokens=state.sampling.max_new_tokens,  # the engine may cap it
                                  parent=p.request_id if sequence is not p else None,
                                  lora_version=state.input.lora.version if state.input.lora is not None else None)
            arrival = Arrival(request_id, arrive.passphrase, spoken=p.spoken,
                              input_key=state.input.content_key, sampling=state.sampling)
            self.emit(arrive)
            self._emit_all(o.on_arrive(arrival) for o in self.observers)

    def _apply_timeline(self) -> None:
        """Apply every timeline event whose time has come (engine knobs, faults, arrival rate, markers)."""
        now = self.engine.now()
        while self.timeline and self.timeline[0].at_s <= now:
            item = self.timeline.pop(0)
            self.emit(TimelineApplied(t=now, at_s=item.at_s, set=dict(item.set), marker=item.marker))
            if item.engine_overrides():
                self.engine.reconfigure(**item.engine_overrides())
            if item.fault_switch and self.fault_switches:
                self.set_fault(*item.fault_switch, source="timeline")
            if item.lora_reload:
                self.reload_adapter(item.lora_reload)
            rate = item.arrival_changes().get("rate_per_s")
            current = getattr(self.scenario.arrivals, "rate_per_s", None)
            if rate and current:
                self.scale_arrival_rate(rate / current)
            if item.marker:
                self.emit(Marker(t=now, text=item.marker))

    def _idle(self) -> None:
        """Nothing to run: check a finished request against its solo run (wall clock), else wait for
        (wall) or jump to (virtual) the next arrival."""
        if self._pending_work() and self.clock == "wall":  # a request that arrives meanwhile is served first
            self._drain_observers(lambda: self.stop_requested or self._work_waiting(), one_batch=True)
        elif self.serving:  # wait for a submission (never spin a core)
            self.intake.ready.wait(0.05)
        elif self.clock in MODELED_CLOCKS or self.engine.clock_paused:
            self.engine.advance_to(self.pending[0].arrival_s)
        else:
            time.sleep(min(max(self.pending[0].arrival_s - self.engine.now(), 0.0), 0.05))

    def _work_waiting(self) -> bool:
        """A submission from outside (serve) or a planned arrival that is due: the engine has work."""
        return self.intake.ready.is_set() or bool(self.pending and self.pending[0].arrival_s <= self.engine.now())

    def _emit_step(self, report: StepEvent) -> list[tuple[str, str]]:
        """Emit the step event (each new token's text included, so replays need no tokenizer), stale
        starts and first tokens; returns (request id, new text) per sampled token."""
        pieces = [(r.request_id, self.tokenizer.decode([r.token_id], skip_special_tokens=True))
                  for r in report.running if r.token_id is not None]
        self.emit(_with_pieces(report, dict(pieces)))
        for request_id, slot, previous, kept in report.stale_starts:
            self.emit(Marker(t=report.t, text=f"{request_id} took slot {slot} stale: {kept} tokens of "
                                                  f"{previous} kept (stale_slot)"))
        for request_id, previous, row in report.stale_masks:
            self.emit(Marker(t=report.t, text=f"{request_id} sampled through bitmask row {row} as {previous}'s "
                                                  "grammar left it (stale_bitmask)"))
        for r in report.running:
            if r.ttft_s is not None:
                self.emit(FirstToken(t=report.t, request_id=r.request_id, ttft_s=r.ttft_s))
        return pieces

    def _emit_finished(self, report) -> None:
        """Each finished request's observer reports (the canary's final check), then its finish event; the
        reference observer queues its check."""
        for f in report.finished:
            finish = self._finish_event(f)
            done = Finished(f.request_id, finish.output_text, report.t, report.step, f.finish_reason,
                            completed=finish.completed, request=f, trail=self._trails.pop(f.request_id))
            self._emit_all(o.on_finish(done) for o in self.observers)
            self.emit(finish)


    def _finish_event(self, f) -> Finish:
        """The request.finish event of the engine's finished report `f`: its canary and tenant from the
        PlannedRequest it was submitted as (forgotten here)."""
        text = self.tokenizer.decode(list(f.output_ids), skip_special_tokens=True)[: f.text_end]
        return finish_event(self.submitted.pop(f.request_id, f), text=text, t=f.finish_s, finish_reason=f.finish_reason, detail=f.detail,
                            code=f.code or None, slot=f.slot, prompt_ids=f.prompt_ids, output_ids=f.output_ids,
                            arrival_s=f.arrival_s, scheduled_s=f.scheduled_s, first_token_s=f.first_token_s,
                            finish_s=f.finish_s, token_times_s=f.token_times_s)

    # -- live controls (dashboard keys) ------------------------------------------------------
    def pause_clock(self) -> None:
        """Wall clock: stop the run's clock (a paused dashboard); steps taken while paused advance it
        by their own duration only (see Engine.pause_clock). Paced clock: stop pacing."""
        self.engine.pause_clock()
        if self.pacer is not None:
            self.pacer.pause()

    def resume_clock(self) -> None:
        """Wall clock: let the run's clock go on from where it stopped. Paced clock: pace again from the
        engine's time now."""
        self.engine.resume_clock()
        if self.pacer is not None:
            self.pacer.resume()

    def hold_for_wall(self, max_wait_s: float = math.inf, wait: Callable[[float], object] | None = None) -> float:
        """Paced clock: wait until the wall clock reaches the engine's modeled time, `max_wait_s` at most,
        spending the wait on waiting reference checks first. Returns the seconds still to wait (0: the
        next step may start); other clocks return 0 at once.

        Args:
            max_wait_s: the longest wait in one call (a caller that must stay responsive waits in slices).
            wait: how to wait the rest (default: the pacer's sleep); the dashboard passes an event's
                wait, so a key press ends the wait early.
        """
        if self.pacer is None:
            return 0.0
        delay = self.pacer.delay(self.engine.now())
        if delay <= 0:
            return 0.0
        deadline = self.pacer.wall() + min(delay, max_wait_s)
        if self._pending_work() and not self.stop_requested:
            self._drain_observers(lambda: self.stop_requested or self.pacer.wall() >= deadline, one_batch=True)
        left = deadline - self.pacer.wall()
        if left > 0:
            (wait or self.pacer.sleep)(left)
        return self.pacer.delay(self.engine.now())

    def set_fault(self, name: str, on: bool, source: str = "key") -> None:
        """Switch one isolation fault on or off from the next step; emits a `fault` event.

        Raises:
            ValueError: unknown fault name.
        """
        check_fault_names([name])
        if (name in self.engine.faults) == on:
            return
        self.engine.set_faults(self.engine.faults | {name} if on else self.engine.faults - {name})
        self.fault_history.append((self.engine.now(), name, on))
        self.emit(FaultSwitch(t=self.engine.now(), name=name, on=on, source=source,
                              active=tuple(sorted(self.engine.faults))))

    def scale_arrival_rate(self, factor: float) -> None:
        """Multiply the arrival rate of requests not yet arrived by `factor` (> 0): their remaining
        wait from now is divided by it."""
        if factor <= 0:
            raise ValueError(f"{factor = } must be > 0")
        now = self.engine.now()
        self.pending = [replace(p, arrival_s=now + (p.arrival_s - now) / factor) if p.arrival_s > now else p
                        for p in self.pending]
        self.emit(Marker(t=now, text=f"arrival rate x{factor:g}"))

    def burst(self, count: int) -> int:
        """Make the next `count` pending requests arrive now; returns how many moved."""
        now = self.engine.now()
        moved = min(count, len(self.pending))
        self.pending[:moved] = [replace(p, arrival_s=min(p.arrival_s, now)) for p in self.pending[:moved]]
        if moved:
            self.emit(Marker(t=now, text=f"burst of {moved} requests"))
        return moved

    def run(self, on_progress: Callable[["Session"], None] | None = None,
            on_reference: Callable[[int, int], None] | None = None) -> Summary:
        """Step until done or stop_requested; then close. Returns the summary.

        Args:
            on_progress: called after every step_once.
            on_reference: called with (checked, total) while the last reference checks run.
        """
        try:
            while not self.stop_requested:
                if self.hold_for_wall(max_wait_s=0.1) > 0:  # paced clock: ahead of the wall (stop read between)
                    continue
                if not self.step_once():
                    break
                if on_progress is not None:
                    on_progress(self)
        finally:
            self.close(on_reference)
        return self.summary

    def close(self, on_reference: Callable[[int, int], None] | None = None) -> Summary:
        """Abort what is still in flight (after a stop), run the waiting reference checks (a stop skips
        them, counted in the summary), write the summary line, close the recording."""
        if self.summary is not None:
            return self.summary
        work_left = bool(self.pending or self.engine.has_unfinished())
        for request_id, state in list(self.engine.requests.items()):
            if not state.is_done:
                self.engine.abort(request_id)
        if self.engine.has_unfinished():
            report = self.engine.step()  # reports the aborted requests
            for f in report.finished:
                self.emit(self._finish_event(f))
        self._drain_observers(lambda: self.stop_requested, progress=on_reference or (lambda checked, total: None))
        if sum(o.skip_pending() for o in self.observers):  # a stop: counted as skipped
            self._reference_status()
        self._note_unapplied_timeline()
        return self._close_run(work_left=work_left, requests_not_submitted=len(self.pending),
                               faults_active_at_end=tuple(sorted(self.engine.faults)),
                               contamination_by_fault=dict(self._trails.fault_counts))

    def _note_unapplied_timeline(self) -> None:
        """Timeline events the run ended before: a marker (and `unapplied_timeline` for the CLI)."""
        self.unapplied_timeline = list(self.timeline)
        if self.timeline and not self.stop_requested:
            at = ", ".join(f"{e.at_s:g} s" for e in self.timeline[:5])
            self.emit(Marker(t=self.engine.now(), text=f"timeline events after the run's end were not applied "
                                                       f"(at {at})"))


def _with_pieces(report: StepEvent, pieces: dict[str, str]) -> StepEvent:
    """The engine's step with each sampled token's text (`piece`, by request id) filled in: the event the
    session records (its finished requests get their own request.finish events)."""
    if not pieces:
        return report
    running = tuple(r.model_copy(update={"piece": pieces[r.request_id]}) if r.request_id in pieces else r
                    for r in report.running)
    return report.model_copy(update={"running": running})
