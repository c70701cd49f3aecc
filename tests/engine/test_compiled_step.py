"""The compiled decode step (kvtui/engine/compiled.py): its greedy tokens against the eager engine's and
transformers' own forward on a separate instance, the fault truth table with the decode steps compiled,
compiled code from the on-disk cache, and the choice between compiled and eager (the suite runs eager:
tests/conftest.py sets KVTUI_COMPILE=0). The graphs are kept on the session's tiny-llama instance, so each
shape kind compiles once per test session, and inductor's cache under kvtui's cache dir keeps them for the
next session; a cold cache pays about 30-40 s per kind (two kinds here: one row, several packed rows)."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import assert_matches_oracle, make_engine, oracle_model, oracle_tokens, run_batched
from test_faults import TEXT_DETECTORS, scenario

from kvtui.config import EngineConfig
from kvtui.engine import SamplingParams, compiled, cpu_kernels
from kvtui.faults import FAULTS
from kvtui.session import Session

NO_CXX = pytest.mark.skipif(cpu_kernels.compiler_path() is None, reason="no C++ compiler: the compiled step cannot run here")

PROMPTS = [[5, 9, 11, 40, 77, 3, 120], [17, 18, 19, 20, 21], [100, 101, 7, 8, 9, 10, 11, 12, 13]]


@NO_CXX
def test_compiled_decode_steps_give_the_eager_engines_and_transformers_greedy_tokens(tiny):
    loaded = tiny["tiny-llama"]
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True)] * len(PROMPTS)
    config = EngineConfig(num_slots=4, max_batch_size=4, max_len=64, layout="packed", compile=True)
    engine = make_engine(loaded.model, config)
    assert engine.runner.compiled is not None and engine.runner.compile_note == "compiled decode step (inductor)"
    calls = []
    graph = engine.runner.compiled
    engine.runner.compiled = lambda *args: calls.append(args[0].shape) or graph(*args)
    states = {i: engine.submit(f"r{i}", p, params[i]) for i, p in enumerate(PROMPTS)}
    engine.run_until_done()
    ours = [list(states[i].generated_ids) for i in range(len(PROMPTS))]
    # one prefill step (eager), then 11 decode steps of three rows, every one compiled (packed: [1, 3, hidden])
    assert [tuple(s) for s in calls] == [(1, 3, loaded.model.config.hidden_size)] * 11
    _, eager, _ = run_batched(loaded, PROMPTS, params, [0, 0, 0], replace(config, compile=False))
    assert ours == eager
    oracle = oracle_model("tiny-llama", "sdpa")
    for i, prompt in enumerate(PROMPTS):
        theirs, gaps = oracle_tokens(oracle, prompt, params[i])
        assert_matches_oracle(ours[i], theirs, gaps, f"compiled r{i}")


def test_without_a_cxx_compiler_the_engine_runs_eager_and_says_why(tiny, monkeypatch):
    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda name: None)
    engine = make_engine(tiny["tiny-llama"].model, EngineConfig(num_slots=2, max_len=64, compile=True))
    assert engine.runner.compiled is None
    assert engine.runner.compile_note.startswith("eager: no C++ compiler found (torch looks for ")
    state = engine.submit("r", PROMPTS[0], SamplingParams(max_new_tokens=3, ignore_eos=True))
    engine.run_until_done()
    assert len(state.generated_ids) == 3


def test_the_choice_follows_the_flag_the_environment_and_the_model(tiny, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "compiler_path", lambda: "/usr/bin/g++")
    llama, gpt2 = tiny["tiny-llama"].model, tiny["tiny-gpt2"].model
    config = EngineConfig(num_slots=2, max_len=64, compile=None)
    monkeypatch.setenv("KVTUI_COMPILE", "0")
    assert make_engine(llama, replace(config, compile=True)).runner.compiled is not None  # --compile wins
    assert make_engine(llama, replace(config, compile=False)).runner.compile_note == \
        "eager: compile off (--compile turns it on)"
    assert make_engine(llama, config).runner.compile_note == "eager: $KVTUI_COMPILE=0"  # automatic: off
    monkeypatch.delenv("KVTUI_COMPILE")
    assert make_engine(llama, config).runner.compiled is not None  # automatic: on where it can run
    assert make_engine(llama, EngineConfig(num_slots=2, max_len=64)).runner.compiled is None  # the default: off
    assert make_engine(llama, replace(config, enforce_eager=True)).runner.compile_note == \
        "eager: --enforce-eager runs transformers' own modules"
    assert make_engine(gpt2, config).runner.compile_note == \
        "eager: the compiled step runs Llama-family models, not 'gpt2'"
    # every engine over one model instance (the run's, the detectors' reference and replay engines) shares its graphs
    assert make_engine(llama, config).runner.compiled is make_engine(llama, config).runner.compiled


# The faults that act in the attention a compiled decode step runs (kvtui::pooled_attention) or in the
# positions and cache state it is given, on the packed layout (its decode steps are [1, rows, hidden]: the
# kind the greedy test above compiles, and the one-row kind): the eager truth table's cases for them
# (tests/detect/test_faults.py) hold with every decode step compiled, with the same reports as the eager
# fused forward. Block-manager, sampling and LoRA faults act outside the step: the compiled step leaves them
# as they are.
# (Measured once beyond CI: the padded layout's cases of these faults and of unmasked_cache_padding and
# fp16_cache, 17 cases in all, give the same reports compiled; the padded layout is a third shape kind.)
COMPILED_FAULTS = ("shared_cache", "no_request_mask", "shared_position_offset", "stale_slot", "causal_offset")
COMPILED_CASES = [(name, kv) for name in COMPILED_FAULTS for kv in FAULTS[name].kv]


@NO_CXX
@pytest.mark.parametrize("name,kv", COMPILED_CASES)
def test_the_truth_table_holds_with_the_decode_steps_compiled(tiny, name, kv, monkeypatch):
    calls = []
    call = compiled.CompiledDecode.__call__
    monkeypatch.setattr(compiled.CompiledDecode, "__call__", lambda self, *a: calls.append(a[0].shape) or call(self, *a))
    fault = FAULTS[name]
    spec = scenario("packed", faults=[name], kv=kv)
    reports = {}
    for compile in (True, False):
        session = Session(spec, tiny["tiny-llama"], clock="virtual", engine_overrides={"compile": compile})
        assert (session.engine.runner.compiled is not None) is compile
        ran = len(calls)
        session.run()
        assert (len(calls) > ran) is compile  # the compiled run's decode steps went through the graph
        reports[compile] = sorted((e.detector, e.kind, e.victim, e.source, e.step) for e in session.contamination)
        if compile:
            caught = {e.detector for e in session.contamination if e.counts}
            assert set(fault.caught_by) - TEXT_DETECTORS <= caught, session.contamination
            assert session.summary.findings_by_kind.get(fault.kind, 0) >= 1
            assert session.summary.fault_acts[name] > 0
    assert reports[True] == reports[False]


@NO_CXX
def test_a_second_process_loads_the_compiled_step_from_the_cache(tiny, tmp_path):
    """The greedy test's graph (three packed rows) compiled in this process is in inductor's cache under
    kvtui's cache dir: a new process finds it there, says so, and its first compiled step takes seconds."""
    script = """
import json, sys, torch
from kvtui.config import EngineConfig
from kvtui.engine import Engine, SamplingParams
from kvtui.models import load_model
torch.set_num_threads(int(sys.argv[1]))
engine = Engine.from_loaded(load_model("tiny-llama", progress=False),
                            EngineConfig(num_slots=4, max_batch_size=4, max_len=64, layout="packed", compile=True))
engine.runner.compiled.announce = print
for i, p in enumerate(([5, 9, 11, 40, 77, 3, 120], [17, 18, 19, 20, 21], [100, 101, 7, 8, 9, 10, 11, 12, 13])):
    engine.submit(f"r{i}", p, SamplingParams(max_new_tokens=3, ignore_eos=True))
engine.run_until_done()
print(json.dumps(list(engine.runner.compiled.first_calls.values())))
"""
    import torch

    # this process's compile of the same kind (the greedy test's, or here when it ran alone) is what warms the cache
    config = EngineConfig(num_slots=4, max_batch_size=4, max_len=64, layout="packed", compile=True)
    engine = make_engine(tiny["tiny-llama"].model, config)
    for i, p in enumerate(PROMPTS):
        engine.submit(f"r{i}", p, SamplingParams(max_new_tokens=3, ignore_eos=True))
    engine.run_until_done()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "OMP_NUM_THREADS": str(torch.get_num_threads())}
    out = subprocess.run([sys.executable, "-c", script, str(torch.get_num_threads())], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout.splitlines()
    folder = compiled.cache_folder()
    assert out[0] == f"compiled code from cache ({folder})"
    assert out[1].startswith("decode step ready in ") and out[1].endswith(" s (compiled code from cache)")
    first = json.loads(out[2])
    assert [f["from_cache"] for f in first] == [True]
    assert first[0]["seconds"] < 30  # a cold compile of this graph takes 30 s or more


@NO_CXX
def test_engines_of_other_pool_sizes_run_the_same_graph(tiny):
    """Pool sizes are dynamic and never tied to the model's sizes (no duck shaping: a max_len of 64 would
    otherwise share the hidden size's symbol), so an engine with another max_len and slot count neither compiles
    nor looks up a graph for a kind another engine compiled."""
    from torch._dynamo.utils import counters

    def run(max_len, slots):
        config = EngineConfig(num_slots=slots, max_batch_size=slots, max_len=max_len, layout="packed", compile=True)
        engine = make_engine(tiny["tiny-llama"].model, config)
        states = [engine.submit(f"r{i}", p, SamplingParams(max_new_tokens=3, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
        engine.run_until_done()
        return [list(s.generated_ids) for s in states]

    def lookups():
        return counters["inductor"]["fxgraph_cache_hit"] + counters["inductor"]["fxgraph_cache_miss"]

    first = run(64, 4)  # the greedy test's engine (tiny-llama's hidden size is 64)
    before = lookups()
    assert run(128, 3) == first
    assert lookups() == before


def test_what_says_compiled_code_from_cache_ignores_comments_and_docstrings():
    """The first-call line's guess (a marker per model, shape kind and traced code) follows the code dynamo
    traces, not its docstrings: an edit to those alone changes no graph and keeps inductor's entries."""
    code = compiled._traced_code()
    assert "rsqrt" in code and "pooled_attention" in code and "packed_linear" in code  # the forward and its helpers
    assert "LlamaRMSNorm.forward" not in code  # _rms_norm's docstring
    assert "graph inputs to" not in code  # _DecodeModule's docstring


def test_an_unwritable_cache_dir_leaves_inductor_its_own_folder(tiny, tmp_path, monkeypatch):
    """kvtui's cache dir read-only (a file where the folder would be): the step still runs, inductor keeps
    the folder it had, and the line says why."""
    (tmp_path / "kvtui").write_text("not a folder")
    monkeypatch.setenv("KVTUI_CACHE_DIR", str(tmp_path / "kvtui"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    from kvtui.engine.fused import fused_for

    decode = compiled.CompiledDecode(fused_for(tiny["tiny-llama"].model))
    lines = []
    decode.announce = lines.append
    decode.graph = lambda *args: "ran"  # nothing is compiled here
    decode._first_call(("kind",), ())
    assert str(decode.folder).startswith(str(tmp_path / "kvtui" / "compiled"))
    assert lines[0] == f"compiling the decode step ({decode.folder} cannot be written: inductor keeps its own cache folder)"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
