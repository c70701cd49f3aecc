"""Each engine knob's bounds, the knobs a running engine may change, and the CLI's serve and audit
defaults are written once, by their owner (kvtui.config, ServeOptions, kvtui.audit_timing); every
other place reads them. The first test moves every owner's value in a fresh interpreter and checks
that the scenario schema, the timeline, EngineConfig, the serve flags and the audit flags follow: a
value written a second time would stay behind."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import make_engine

from kvtui.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]

# Runs with every bound moved inward (ints: low + 1, high - 1; floats: low + 0.001, high / 2) and the audit defaults moved;
# prints what each reader then holds, as JSON.
MOVED = r"""
import asyncio, dataclasses, inspect, json
import httpx, typer

import kvtui.audit_timing as audit_timing
import kvtui.config as config
from kvtui.config import KNOB_BOUNDS

OLD_LOW = {name: b.low for name, b in KNOB_BOUNDS.items()}
for name, b in list(KNOB_BOUNDS.items()):
    KNOB_BOUNDS[name] = dataclasses.replace(b, low=b.low + (1 if b.type is int else 0.001),
                                            high=b.high - 1 if b.type is int else b.high / 2)
audit_timing.DEFAULT_PROBES, audit_timing.DEFAULT_TARGET_BLOCK_SIZE = 17, 65

from kvtui.cli.app import app
from kvtui.scenario.schema import Bucketing, EngineSection
from kvtui.scenario.timeline import RUNTIME_KNOBS
from kvtui.remote.timing import run_target_timing, server_cache

async def published_none():
    transport = httpx.MockTransport(lambda request: httpx.Response(404))
    async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
        return await server_cache(client, None)

def limits(schema):
    schema = next((s for s in schema.get("anyOf", [schema]) if s.get("type") != "null"), schema)
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    return [low, schema["maximum"], "exclusiveMinimum" in schema]

engine = EngineSection.model_json_schema()["properties"]
schema = {("num_slots" if k == "slots" else k): limits(v) for k, v in engine.items() if "maximum" in str(v)}
schema["bucket_tolerance"] = limits(Bucketing.model_json_schema()["properties"]["tolerance"])
timeline = {field: limits(adapter.json_schema()) for _, (field, adapter) in RUNTIME_KNOBS.items()
            if field and "maximum" in str(adapter.json_schema())}
refused = {}
for name, low in OLD_LOW.items():
    try:
        config.EngineConfig(**{name: low, **({"kv": "paged"} if name == "num_blocks" else {})})
        refused[name] = "taken"
    except ValueError as e:
        refused[name] = str(e)

command = typer.main.get_command(app)
def flags(name):
    return {p.name: p for p in command.commands[name].params}
serve, audit = flags("serve"), flags("audit")
serve_bounds = {p: [serve[p].min, serve[p].max] for p in
                ("slots", "max_len", "max_batch_size", "max_tokens_per_step", "max_waiting", "block_size")}
print(json.dumps(dict(
    schema=schema, timeline=timeline, refused=refused, serve=serve_bounds,
    probes=[audit["probes"].default, inspect.signature(run_target_timing).parameters["probes"].default],
    block_help=audit["block_size"].help,
    block_default=asyncio.run(published_none()).block_size,
)))
"""


@pytest.fixture(scope="module")
def moved() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", MOVED], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_scenario_schema_reads_every_bound_from_the_owner(moved):
    from kvtui.config import KNOB_BOUNDS

    expected = {name: [b.low + 1, b.high - 1, b.low_open] if b.type is int else [b.low + 0.001, b.high / 2, b.low_open]
                for name, b in KNOB_BOUNDS.items()}
    assert moved["schema"] == expected


def test_the_timeline_reads_its_engine_knobs_bounds_from_the_owner(moved):
    assert moved["timeline"] == {
        "max_batch_size": [2, 4095, False], "max_tokens_per_step": [2, 999_999, False],
        "bucket_tolerance": [0.001, 5.0, False], "max_waiting": [1, 10**9 - 1, False]}


def test_engine_config_refuses_below_the_owners_low_bound(moved):
    """With every low bound moved up, the old lowest value is refused, in EngineConfig's own words."""
    assert moved["refused"] == {
        "num_slots": "self.num_slots = 1 must be >= 2",
        "max_len": "self.max_len = 2 must be >= 3",
        "kv_budget_bytes": "self.kv_budget_bytes = 0 must be > 1",
        "max_batch_size": "self.max_batch_size = 1 must be >= 2",
        "max_tokens_per_step": "self.max_tokens_per_step = 1 must be >= 2",
        "bucket_tolerance": "self.bucket_tolerance = 0 must be in [0.001, 5.0]",
        "max_waiting": "self.max_waiting = 0 must be >= 1",
        "block_size": "self.block_size = 1 must be in 2..63",
        "num_blocks": "self.num_blocks = 2 must be >= 3",
        "watermark": "self.watermark = 0 must be in [0.001, 0.25]",
        "kv_offload_blocks": "self.kv_offload_blocks = 0 must be >= 1",
    }


def test_the_serve_flags_read_their_bounds_from_the_owner(moved):
    """max_len, max_tokens_per_step and max_waiting carry only the low bound on the command line
    (their help shows no top); the scenario the server builds refuses a value past the top."""
    assert moved["serve"] == {"slots": [2, 4095], "max_len": [3, None], "max_batch_size": [2, 4095],
                              "max_tokens_per_step": [2, None], "max_waiting": [1, None], "block_size": [2, 63]}


def test_the_audit_flags_and_functions_read_the_timing_defaults(moved):
    assert moved["probes"] == [17, 17]
    assert "default 65." in moved["block_help"]
    assert moved["block_default"] == 65  # a server that publishes no block size


def test_the_timing_audit_defaults_are_its_owners_names():
    """In the owner's own module the defaults are bound when it is imported: they must name the owner."""
    tree = ast.parse((ROOT / "kvtui/audit_timing.py").read_text())
    functions = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    probes = functions["run_timing_audit"].args.kw_defaults[1]
    block_size = functions["measure"].args.kw_defaults[2]
    assert ast.unparse(probes) == "DEFAULT_PROBES"
    assert ast.unparse(block_size) == "EngineConfig.block_size"


def test_engine_reconfigure_takes_exactly_the_timeline_engine_knobs(tiny):
    """A running engine changes a field iff the scenario timeline offers it as a knob (faults switch
    through set_faults, not reconfigure)."""
    from kvtui.scenario.timeline import RUNTIME_KNOBS

    timeline_fields = {field for field, _ in RUNTIME_KNOBS.values() if field}
    engine = make_engine(tiny["tiny-llama"].model, num_slots=2, max_len=32)
    taken, refused = set(), {}
    for f in dataclasses.fields(EngineConfig):
        try:
            engine.reconfigure(**{f.name: getattr(engine.config, f.name)})
            taken.add(f.name)
        except ValueError as e:
            refused[f.name] = str(e)
    assert taken == timeline_fields
    assert refused["max_len"] == "max_len cannot change during a run"
    assert refused["faults"] == "faults cannot change during a run; use set_faults"
    assert set(refused) == {f.name for f in dataclasses.fields(EngineConfig)} - timeline_fields
    engine.reconfigure(max_batch_size=1, layout="packed")
    assert (engine.config.max_batch_size, engine.config.layout, engine.scheduler.max_batch_size) == (1, "packed", 1)


def test_serve_detectors_default_is_serve_options():
    """`kvtui serve --detectors` defaults to ServeOptions' detectors, which leave out prefix_provenance."""
    import typer

    from kvtui.cli.app import app
    from kvtui.serve.options import ServeOptions

    flag = next(p for p in typer.main.get_command(app).commands["serve"].params if p.name == "detectors")
    assert flag.default == ",".join(ServeOptions().detectors) == (
        "reference,canary,attention_flow,slot_taint,constraint,sampling_provenance,state_provenance")


def test_serve_takes_a_smaller_step_budget_than_a_scenario():
    """A server's token budget per step is 256 when none is given (its first arrivals' prefills end
    sooner: see kvtui/serve/options.py), or its batch size when that is larger (each running request's
    decode token fits in a step), through to the served engine's config; a given budget wins; a
    scenario without one keeps the engine's 1024."""
    import typer

    from kvtui.cli.app import app
    from kvtui.scenario.schema import EngineSection
    from kvtui.serve.options import ServeOptions
    from kvtui.serve.server import serve_scenario

    flag = next(p for p in typer.main.get_command(app).commands["serve"].params if p.name == "max_tokens_per_step")
    assert flag.default is None and "default 256, or --max-batch-size when larger" in flag.help

    def budget(**options) -> int:
        return serve_scenario(ServeOptions(model="tiny-llama", **options)).engine_config().max_tokens_per_step

    assert budget() == 256
    assert budget(max_batch_size=300, slots=300) == 300
    assert budget(max_batch_size=300, slots=300, max_tokens_per_step=512) == 512
    assert EngineSection().config().max_tokens_per_step == EngineConfig().max_tokens_per_step == 1024
