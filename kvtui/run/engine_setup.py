"""The local run's engine, set up from a scenario and the command line's choices: its EngineConfig, the
virtual clock's step-cost model, the Engine itself with what the detectors ask of it, and the LoRA
adapters its requests may name.

Functions only, called once by kvtui/session.py when a Session starts (and `reload_adapter` by the
timeline, kvtui/run/timeline.py). This module imports the engine; only the local Session imports it.
"""

from __future__ import annotations

from dataclasses import asdict, replace

from kvtui.config import EngineConfig
from kvtui.engine import Engine, StepCostModel
from kvtui.engine.fused import auto_batch_invariant
from kvtui.engine.lora import AdapterRegistry
from kvtui.faults import check_fault_names
from kvtui.run.clock import engine_clock
from kvtui.run.intake import load_adapters


def engine_config(scenario, loaded, engine_overrides: dict | None, faults, detectors: tuple[str, ...]) -> EngineConfig:
    """The run's EngineConfig: the scenario's engine section with `engine_overrides` (CLI flags) over it,
    `faults` added to its faults, and batch_invariant decided here when neither sets it (on when
    auto_batch_invariant says this model and these detectors want it; off with LoRA adapters, which do
    not run in the mode).

    Raises:
        ValueError: a bad engine value or an unknown fault name.
    """
    overrides = dict(engine_overrides or {})
    if faults:
        base = scenario.engine_config(**overrides)
        overrides["faults"] = frozenset(base.faults) | check_fault_names(faults)
    config = scenario.engine_config(**overrides)
    if scenario.engine.batch_invariant is None and "batch_invariant" not in overrides:  # unset: auto
        auto = scenario.lora is None and auto_batch_invariant(loaded, config, detectors)
        config = replace(config, batch_invariant=auto)
    return config


def step_cost_model(which: str, loaded, device) -> tuple[StepCostModel, dict]:
    """The virtual clock's step costs and their description for the header.

    Args:
        which: "auto" (this machine's `kvtui calibrate` fit for the model, dtype and device when there is
            one, else the built-in fit) or "default" (the built-in fit).
        loaded: the LoadedModel (its model_id and dtype pick the calibration).
        device: the engine's device.

    Raises:
        ValueError: another `which`.
    """
    from kvtui.calibrate import load_cost_model

    if which not in ("auto", "default"):
        raise ValueError(f"cost model {which!r}: use 'auto' or 'default'")
    model, described = load_cost_model(loaded.model_id, str(loaded.dtype).replace("torch.", ""), str(device))
    if which == "default" and described["source"] != "default":
        model, described = StepCostModel(), {"source": "default", **asdict(StepCostModel())}
    return model, described


def make_engine(loaded, config: EngineConfig, costs: StepCostModel, clock: str, detectors: tuple[str, ...],
                progress=None) -> Engine:
    """The run's engine on `clock` (kvtui/run/clock.py engine_clock: the paced clock's engine runs on
    the virtual clock), measuring what the detectors read: slot taint for `slot_taint`, the attention
    flow for `attention_flow`, the sampling draws for `reference`. `progress` (None, or a callable taking
    one line) hears the compiled decode step's lines around each shape kind's first call (a first compile
    holds the step for a minute or more: kvtui/engine/compiled.py CompiledDecode.announce)."""
    engine = Engine.from_loaded(loaded, config, cost_model=costs, clock=engine_clock(clock))
    if progress is not None and engine.runner.compiled is not None:
        engine.runner.compiled.announce = progress
    engine.detect_taint = "slot_taint" in detectors
    engine.measure_flow = "attention_flow" in detectors
    engine.output.record_draws = "reference" in detectors
    return engine


def scenario_adapters(loaded, scenario, config: EngineConfig) -> AdapterRegistry:
    """The LoRA adapters requests may name (engine/lora.py AdapterRegistry), the scenario's `lora.loaded`
    loaded.

    Raises:
        ValueError: one line when this engine cannot run them (kvtui.run.intake.load_adapters).
    """
    names = scenario.lora.loaded if getattr(scenario, "lora", None) is not None else ()
    return load_adapters(loaded, names, enforce_eager=config.enforce_eager, batch_invariant=config.batch_invariant)


def reload_adapter(adapters: AdapterRegistry, name: str):
    """Load built-in adapter `name` again with its next version's weights (scenario/lora.py reload_seed);
    requests submitted from then on run under them. Returns the new LoraAdapter."""
    from kvtui.scenario.lora import reload_seed

    old = adapters.get(name)
    return adapters.load(name, seed=reload_seed(name, 1 if old is None else old.version + 1))
