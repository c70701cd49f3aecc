"""The compiled decode step (kvtui/engine/compiled.py): its greedy tokens against the eager engine's and
transformers' own forward on a separate instance, and the choice between compiled and eager (the suite
runs eager: tests/conftest.py sets KVTUI_COMPILE=0; one test here pays for a compile, about 30 s)."""

from dataclasses import replace

import pytest
from helpers import assert_matches_oracle, make_engine, oracle_model, oracle_tokens, run_batched

from kvtui.config import EngineConfig
from kvtui.engine import SamplingParams, compiled

PROMPTS = [[5, 9, 11, 40, 77, 3, 120], [17, 18, 19, 20, 21], [100, 101, 7, 8, 9, 10, 11, 12, 13]]


@pytest.mark.skipif(compiled.compiler_path() is None, reason="no C++ compiler: the compiled step cannot run here")
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
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    engine = make_engine(tiny["tiny-llama"].model, EngineConfig(num_slots=2, max_len=64, compile=True))
    assert engine.runner.compiled is None
    assert engine.runner.compile_note.startswith("eager: no C++ compiler found (torch looks for ")
    state = engine.submit("r", PROMPTS[0], SamplingParams(max_new_tokens=3, ignore_eos=True))
    engine.run_until_done()
    assert len(state.generated_ids) == 3


def test_the_choice_follows_the_flag_the_environment_and_the_model(tiny, monkeypatch):
    monkeypatch.setattr(compiled, "compiler_path", lambda: "/usr/bin/g++")
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
