"""Engine.from_loaded, the one way kvtui/ builds an engine: it takes the loaded model's EOS ids, tokenizer,
pad token id and image encoder (each overridable), and nothing in kvtui/ outside kvtui/engine/ calls the
constructor by hand."""

from __future__ import annotations

import ast
import copy
import dataclasses
from pathlib import Path

import pytest
from helpers import make_engine, make_requests

from kvtui.config import EngineConfig
from kvtui.engine import Engine, SamplingParams
from kvtui.model_kinds import ModelKind

KVTUI = Path(__file__).parents[2] / "kvtui"


def test_the_builder_takes_the_loaded_models_eos_ids_tokenizer_and_pad_id(tiny):
    loaded = tiny["tiny-llama"]
    tok = copy.deepcopy(loaded.tokenizer)
    tok.pad_token = tok.eos_token  # a pad id that is not the constructor's default 0
    loaded = dataclasses.replace(loaded, tokenizer=tok)
    assert (loaded.eos_token_ids, tok.pad_token_id) == ((2,), 2)
    engine = Engine.from_loaded(loaded, EngineConfig(num_slots=2, max_len=64))
    assert engine.eos_token_ids == frozenset({2}) and engine.pad_token_id == 2
    assert engine.tokenizer is tok and engine.output.tokenizer is tok and engine.output.grammar.tokenizer is tok
    assert engine.model is loaded.model and engine.model_kind is ModelKind.DECODER_ONLY
    assert (engine.config.num_slots, engine.clock) == (2, "wall")


def test_keywords_override_what_the_loaded_model_brings(tiny):
    loaded = tiny["tiny-llama"]
    engine = Engine.from_loaded(loaded, EngineConfig(num_slots=1, max_len=64), eos_token_ids=(7, 9), tokenizer=None,
                                pad_token_id=5, clock="virtual", grammar_tokenizer=loaded.tokenizer)
    assert (engine.eos_token_ids, engine.tokenizer, engine.pad_token_id) == (frozenset({7, 9}), None, 5)
    assert engine.output.grammar.tokenizer is loaded.tokenizer and engine.clock == "virtual"
    with pytest.raises(TypeError, match="no_such_option"):
        Engine.from_loaded(loaded, EngineConfig(num_slots=1, max_len=64), no_such_option=1)


def test_a_bare_model_brings_the_constructors_defaults(tiny):
    engine = Engine.from_loaded(tiny["tiny-llama"].model, EngineConfig(num_slots=1, max_len=64))
    assert (engine.eos_token_ids, engine.tokenizer, engine.pad_token_id) == (frozenset(), None, 0)
    assert engine.model_kind is ModelKind.DECODER_ONLY


def test_the_builder_takes_the_image_encoder():
    from kvtui.engine.image_side import ImageInputs
    from kvtui.models import load_model

    vision = load_model("tiny-vision", progress=False)
    engine = Engine.from_loaded(vision, EngineConfig(num_slots=1, max_len=64))
    assert engine.model_kind is ModelKind.IMAGE_TEXT
    assert isinstance(engine.encoder, ImageInputs) and engine.encoder.image_encoder is vision.image_encoder
    text_only = Engine.from_loaded(vision, EngineConfig(num_slots=1, max_len=64), image_encoder=None)
    assert text_only.model_kind is ModelKind.DECODER_ONLY


def test_the_loaded_tokenizer_checks_stop_strings_and_none_does_not(tiny):
    """tiny-llama greedy from [5, 6, 7, 8] decodes to '\ufffd<&...' (ids 172, 63, 41, ...): the stop string
    "<&" ends it at its third token with the loaded tokenizer; without one it runs to max_new_tokens."""
    loaded = tiny["tiny-llama"]
    params = SamplingParams(max_new_tokens=10, stop=("<&",))
    states = []
    for tokenizer in ({}, {"tokenizer": None}):
        engine = make_engine(loaded, num_slots=1, max_len=64, eos_token_ids=(), **tokenizer)
        states += make_requests(engine, [[5, 6, 7, 8]], params)
        engine.run_until_done()
    with_tok, without = states
    assert without.generated_ids[:3] == [172, 63, 41] and len(without.generated_ids) == 10
    assert without.finish_reason.value == "length"
    assert with_tok.generated_ids == [172, 63, 41] and with_tok.finish_reason.value == "stop"


def test_make_engine_splits_config_fields_from_builder_keywords(tiny):
    base = EngineConfig(num_slots=2, max_len=32, layout="packed")
    engine = make_engine(tiny["tiny-llama"].model, base, num_slots=3, clock="virtual", eos_token_ids=(4,))
    assert (engine.config.num_slots, engine.config.max_len, engine.config.layout) == (3, 32, "packed")
    assert (engine.clock, engine.eos_token_ids) == ("virtual", frozenset({4}))


# -- architecture: one builder --------------------------------------------------------------------------------
def engine_constructions(source: str) -> list[int]:
    """Lines of `source` that call Engine(...) directly (a bare name or an attribute such as engine.Engine)."""
    return [n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
            and (getattr(n.func, "id", None) == "Engine" or getattr(n.func, "attr", None) == "Engine")]


def test_the_scan_sees_a_direct_construction():
    assert engine_constructions("from kvtui.engine import Engine\ne = Engine(m, c)\nf = kvtui.engine.Engine(m, c)") \
        == [2, 3]
    assert engine_constructions("e = Engine.from_loaded(loaded, c)") == []


def test_no_module_outside_the_engine_constructs_engine_by_hand():
    direct, builders = [], []
    for path in sorted(KVTUI.rglob("*.py")):
        rel = path.relative_to(KVTUI.parent).as_posix()
        source = path.read_text()
        if "Engine.from_loaded(" in source:
            builders.append(rel)
        if not rel.startswith("kvtui/engine/"):
            direct += [f"{rel}:{line}" for line in engine_constructions(source)]
    assert direct == []
    # the sites that build engines do it through the builder (the scan reads them)
    assert {"kvtui/run/engine_setup.py", "kvtui/detect/reference.py", "kvtui/audit_timing.py", "kvtui/calibrate.py",
            "kvtui/bench/common.py"} <= set(builders)
