"""Scenarios: the YAML language describing a load (arrivals, prompts, lengths, engine, timeline),
its validation, and planning a run's requests from it.

    scenario = load_scenario("scenarios/passphrase.yaml")     # or ScenarioError (.errors: lines)
    config = scenario.engine_config(device="cpu")
    requests = plan_requests(scenario, tokenizer)              # list[PlannedRequest], by seed
"""

from kvtui.scenario.base import FAULT_NAMES, MAX_PLANNED
from kvtui.scenario.errors import ScenarioError
from kvtui.scenario.loader import load_scenario, parse_scenario
from kvtui.scenario.plan import PlannedRequest, derive_seed, plan_requests
from kvtui.scenario.schema import Scenario
from kvtui.scenario.timeline import RUNTIME_KNOBS, TimelineEvent

__all__ = [
    "FAULT_NAMES", "MAX_PLANNED", "RUNTIME_KNOBS", "PlannedRequest", "Scenario",
    "ScenarioError", "TimelineEvent", "derive_seed", "load_scenario", "parse_scenario", "plan_requests",
]
