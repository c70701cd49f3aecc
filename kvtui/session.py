"""The run loop shared by headless runs and the dashboard: drive arrivals, step, detect, emit events.

Flow: scenario -> planned requests -> Engine.submit at their arrival time -> Engine.step -> typed
events (kvtui.events) -> sinks (recording, metrics, listeners such as the dashboard). Replays feed
recorded events to the same Metrics, so a replay's summary equals the live one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, replace

from kvtui.detect import DETECTOR_NAMES
from kvtui.events import FaultSwitch, Finish, Header, ModelInfo, StepEvent, Summary
from kvtui.memory import release_free_memory
from kvtui.metrics import SLO
from kvtui.pacing import Pacer
from kvtui.run.base import RunBase
from kvtui.run.build import arrive_event, finish_event, run_header, sessions_markers
from kvtui.run.clock import MEASURED, MODELED_VIRTUAL, RunClock, check_clock
from kvtui.run.controls import Controls
from kvtui.run.engine_setup import engine_config, make_engine, scenario_adapters, step_cost_model
from kvtui.run.intake import Admitted, Intake
from kvtui.run.observers import Arrival, Finished, Observer, ObserverContext, StepSeen, build_observers
from kvtui.run.observers import check_names as check_detector_names
from kvtui.run.sink import Listener, RunSink
from kvtui.run.step_events import finish_of, step_events, token_pieces
from kvtui.run.timeline import Timeline
from kvtui.run.trails import Trails

MAX_KEPT_REPORTS = 1000  # contamination reports the session keeps in memory (all go to the recording)
TRIM_EVERY_STEPS = 256


def build_session(scenario, loaded, *, clock: str = "virtual", record=None, device: str = "cpu",
                  layout: str | None = None, faults: tuple[str, ...] = (), clear_faults: bool = False,
                  detectors: tuple[str, ...] = DETECTOR_NAMES, listeners: tuple[Listener, ...] = (),
                  cost_model: str = "auto", serving: bool = False, planned: list | None = None,
                  pacer: Pacer | None = None, enforce_eager: bool = False,
                  batch_invariant: bool | None = None, compile: bool | None = None,
                  progress: Callable[[str], None] | None = None) -> "Session":
    """The Session the headless run and the dashboard both use, from CLI-level choices.

    Args:
        layout: overrides the scenario's engine layout when given.
        faults: faults on from the start, added to the scenario's.
        clear_faults: drop the scenario's faults (engine.faults and timeline switches).
        cost_model: the virtual clock's step costs: "auto" (this machine's `kvtui calibrate` fit for the
            model when there is one, else the built-in fit) or "default" (the built-in fit).
        serving: requests come from the intake's queue (kvtui serve), not the scenario (see Session).
        planned: the scenario's planned requests when the caller planned them already (see Session).
        pacer: the paced clock's Pacer (default: one on the real wall clock).
        enforce_eager: run the model's own transformers modules, not kvtui's fused forward
            (EngineConfig.enforce_eager).
        batch_invariant: overrides the scenario's engine.batch_invariant when given
            (EngineConfig.batch_invariant).
        compile: overrides EngineConfig.compile (the compiled decode step) when given.
        progress: hears the tolerance measured at load and the compiled step's first compile (see Session).

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
    overrides.update({k: v for k, v in (("batch_invariant", batch_invariant), ("compile", compile)) if v is not None})
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
        serving: plan no scenario arrivals; requests come only from `intake.put` (any thread), and
            the session is never done until stopped (kvtui serve). Use the wall clock.
        planned: `plan_requests(scenario, tokenizer)` when the caller has it already (the CLI checks
            the plan before the run); None plans here.
        pacer: for clock="paced": the Pacer holding modeled time to the wall (default: a real one; tests
            pass one with a fake wall clock and sleep).
        progress: hears one line when the reference detector measures this machine's numeric tolerance
            (bf16 / fp16 with no stored calibration), and the compiled step's first compile (run/engine_setup.py).

    Attributes (what the loop drives; each lives in kvtui/run/):
        clock: the RunClock (clock.py: its name, pause/resume, the paced clock's hold_for_wall).
        intake: the Intake (intake.py), the one way in to the engine; kvtui serve calls its thread-safe
            put, abort and call.
        controls: the Controls (controls.py: set_fault, scale_arrival_rate, burst), the dashboard's keys.
        timeline: the Timeline (timeline.py), applied at the start of each step.
        pending: the planned requests not yet submitted, in arrival order.

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
        self.scenario, self.loaded, self.tokenizer = scenario, loaded, loaded.tokenizer
        clock = check_clock(clock)
        self.detectors = check_detector_names(detectors)
        self.config = engine_config(scenario, loaded, engine_overrides, faults, self.detectors)  # run/engine_setup.py
        self.cost_model = step_cost_model(cost_model, loaded, self.config.device)
        self.engine = make_engine(loaded, self.config, self.cost_model[0], clock, self.detectors, progress)
        self.adapters = scenario_adapters(loaded, scenario, self.config)  # engine/lora.py
        self.clock = RunClock(clock, self.engine, pacer, spend=self._check_while_waiting)  # run/clock.py
        # the one way in to the engine (kvtui/run/intake.py); kvtui serve calls its put, abort and call
        self.intake = Intake(self.engine, self.adapters, getattr(loaded, "feature_extractor", None))
        self.serving = serving
        self.pending = self._planned(planned)  # changed in place only (the controls hold it too)
        self.submitted: dict = {}  # engine request id (each sequence's) -> its PlannedRequest, until it finishes
        self.observers: list[Observer] = build_observers(  # the detectors, in the order their reports go out
            self.detectors, ObserverContext(self.detectors, loaded, self.tokenizer, self.config, progress))
        self.controls = Controls(self.engine, self.pending, self.emit)  # faults, arrival rate, bursts: run/controls.py
        self.fault_history = self.controls.fault_history
        self.timeline = Timeline(scenario.timeline, self.controls, self.adapters, self.emit,  # run/timeline.py
                                 base_rate_per_s=getattr(scenario.arrivals, "rate_per_s", None),
                                 fault_switches=fault_switches)
        self.sink = RunSink(SLO(scenario.slo.ttft_s, scenario.slo.tpot_s), clock=self.engine.now,
                            record_path=record_path, listeners=listeners, keep=MAX_KEPT_REPORTS,
                            on_finding=lambda report: self._trails.count(report, self.engine.faults))
        self.stop_requested = False
        self.summary: Summary | None = None
        self.unapplied_timeline: list = []  # set at the close: the timeline events the run ended before
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

    def _started(self) -> None:
        self._start_recording(self.header())  # the header unwritable (e.g. /dev/full): refused here (OSError)
        for name in sorted(self.engine.faults):
            self.emit(FaultSwitch(t=0.0, name=name, on=True, source="config", active=tuple(sorted(self.engine.faults))))
        self._emit_all([sessions_markers(self.scenario)] if not self.serving else [])

    # -- what the run tells (kvtui.run.outcome.RunOutcome; the sink's properties: kvtui.run.base.RunBase) --
    faults_known = True  # kvtui's own engine: fault_history is every fault that was on

    # -- events -------------------------------------------------------------------------------
    def header(self) -> Header:
        """The recording's first line: versions, scenario, model, engine config, clock."""
        loaded, modeled = self.loaded, self.clock.modeled
        config = asdict(self.config)
        config["faults"] = sorted(config["faults"])
        if self.config.batch_invariant:
            config["invariant_tile"] = self.engine.runner.tiles.size
        return run_header(
            self.scenario, model=ModelInfo(id=loaded.model_id, path=loaded.source_path, sha256=loaded.source_sha256,
                                           dtype=str(loaded.dtype).replace("torch.", ""), kind=loaded.kind),
            engine=config, clock=self.clock.name, detectors=self.detectors, measured=MEASURED,
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

    def step_once(self) -> bool:
        """Apply the timeline, submit what the intake's queue holds (kvtui serve) and the due arrivals,
        then one engine step (or idle: wait for the next arrival on the wall clock, jump to it on the
        virtual clock). Returns False once every request is done."""
        if self.done:
            return False
        self.timeline.apply_due()
        for outcome in self.intake.drain():
            self._on_submitted(outcome)
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
        if self.clock.name == "virtual" and any(o.pending >= o.batch for o in self.observers):
            self._drain_observers(lambda: self.stop_requested, one_batch=True)  # spread over the run, not at the end
        if report.step % TRIM_EVERY_STEPS == TRIM_EVERY_STEPS - 1:
            release_free_memory()
        return not self.done

    def _submit_due(self) -> None:
        """Submit each planned request whose arrival time has come, through the intake (see _on_submitted)."""
        now = self.engine.now()
        while self.pending and self.pending[0].arrival_s <= now and not self._round_held(now):
            self._on_submitted(self.intake.submit(self.pending.pop(0)))

    def _round_held(self, now: float) -> bool:
        """`process: rounds`: the next request waits while a request of an earlier round is unfinished;
        when none is, its whole round arrives now (their arrival_s set to `now`)."""
        head = self.pending[0]
        if head.round is None or head.round == self._round:
            return False
        if self.engine.has_unfinished():
            return True
        self._round = head.round
        self.pending[:] = [replace(p, arrival_s=now) if p.round == head.round else p for p in self.pending]
        return False

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

    def _idle(self) -> None:
        """Nothing to run: check a finished request against its solo run (wall clock), else wait for
        (wall) or jump to (virtual) the next arrival."""
        if self._pending_work() and self.clock.name == "wall":  # a request that arrives meanwhile is served first
            self._drain_observers(lambda: self.stop_requested or self._work_waiting(), one_batch=True)
        elif self.serving:  # wait for a submission (never spin a core)
            self.intake.ready.wait(0.05)
        elif self.clock.modeled or self.engine.clock_paused:
            self.engine.advance_to(self.pending[0].arrival_s)
        else:
            time.sleep(min(max(self.pending[0].arrival_s - self.engine.now(), 0.0), 0.05))

    def _work_waiting(self) -> bool:
        """A submission from outside (serve) or a planned arrival that is due: the engine has work."""
        return self.intake.ready.is_set() or bool(self.pending and self.pending[0].arrival_s <= self.engine.now())

    def _emit_step(self, report: StepEvent) -> list[tuple[str, str]]:
        """Emit the step's events (kvtui/run/step_events.py: the step with each new token's text, so
        replays need no tokenizer, stale markers, first tokens); returns (request id, new text) per
        sampled token."""
        pieces = token_pieces(report, self.tokenizer)
        for event in step_events(report, dict(pieces)):
            self.emit(event)
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
        """The request.finish event of the engine's finished report `f`, from the PlannedRequest it was
        submitted as (forgotten here)."""
        return finish_of(self.submitted.pop(f.request_id, f), f, self.tokenizer)

    def _check_while_waiting(self, until: Callable[[], bool]) -> None:
        """The paced clock's wait (RunClock.hold_for_wall): run waiting reference checks, one batch at
        most, until `until()` or a stop."""
        if self._pending_work() and not self.stop_requested:
            self._drain_observers(lambda: self.stop_requested or until(), one_batch=True)

    def run(self, on_progress: Callable[["Session"], None] | None = None,
            on_reference: Callable[[int, int], None] | None = None) -> Summary:
        """Step until done or stop_requested; then close. Returns the summary.

        Args:
            on_progress: called after every step_once.
            on_reference: called with (checked, total) while the last reference checks run.
        """
        try:
            while not self.stop_requested:
                if self.clock.hold_for_wall(max_wait_s=0.1) > 0:  # paced clock: ahead of the wall (stop read between)
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
        self.unapplied_timeline = self.timeline.unapplied(self.stop_requested)
        return self._close_run(work_left=work_left, requests_not_submitted=len(self.pending),
                               faults_active_at_end=tuple(sorted(self.engine.faults)),
                               contamination_by_fault=dict(self._trails.fault_counts), 
                               fault_acts=self._trails.fault_acts(self.fault_history))
