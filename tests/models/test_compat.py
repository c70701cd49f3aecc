"""Models the engine cannot run batch-invariantly are refused: RoPE whose frequencies follow the
batch's longest sequence (transformers' "dynamic" and "longrope"), and max_len past a learned position
table (GPT-2's n_positions). The named models' geometry used to size the KV pool at validation matches
the models themselves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import make_engine
from transformers import LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

from kvtui.cli import app
from kvtui.engine import SamplingParams
from kvtui.engine.runner import model_geometry
from kvtui.models import ModelLoadError, build_tiny_tokenizer, load_model
from kvtui.models.compat import (
    NAMED_CONFIGS,
    IncompatibleModel,
    check_batch_invariant,
    check_decoder_only,
    check_max_len,
    gguf_config,
    length_dependent_rope,
    shape_from_config,
)

SHORT, LONG = 10, 120  # tokens: a short request beside a long neighbour


def tiny_llama_with_rope(rope: dict | None, max_positions: int = 64) -> LlamaForCausalLM:
    """A tiny random Llama (as kvtui/models/tiny.py builds, spread-out weights) with the given rope_scaling."""
    config = LlamaConfig(vocab_size=259, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=max_positions,
                         initializer_range=0.5, rope_scaling=rope, pad_token_id=0, eos_token_id=2, bos_token_id=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()


@torch.inference_mode()
def short_row_tokens(model, with_neighbour: bool) -> list[int]:
    """Greedy next-token ids at each of the short row's positions, run alone or right-padded beside a
    long neighbour (transformers' own forward with a 2D attention mask: no kvtui code)."""
    g = torch.Generator().manual_seed(1)
    short, long = torch.randint(3, 259, (SHORT,), generator=g), torch.randint(3, 259, (LONG,), generator=g)
    if not with_neighbour:
        return model(input_ids=short[None]).logits[0].argmax(-1).tolist()
    ids = torch.zeros((2, LONG), dtype=torch.long)
    mask = torch.zeros((2, LONG), dtype=torch.long)
    ids[0, :SHORT], mask[0, :SHORT] = short, 1
    ids[1], mask[1] = long, 1
    return model(input_ids=ids, attention_mask=mask).logits[0, :SHORT].argmax(-1).tolist()


def test_transformers_dynamic_rope_makes_a_short_row_depend_on_its_neighbour():
    dynamic = tiny_llama_with_rope({"rope_type": "dynamic", "factor": 2.0})
    assert short_row_tokens(dynamic, False) != short_row_tokens(dynamic, True)
    static = tiny_llama_with_rope(None)  # the same weights with plain RoPE: the neighbour changes nothing
    static.load_state_dict(dynamic.state_dict())
    assert short_row_tokens(static, False) == short_row_tokens(static, True)


def test_loader_refuses_a_dynamic_rope_model(tmp_path: Path):
    folder = tmp_path / "dynamic-llama"
    tiny_llama_with_rope({"rope_type": "dynamic", "factor": 2.0}).save_pretrained(folder)
    build_tiny_tokenizer().save_pretrained(folder)
    with pytest.raises(ModelLoadError) as info:
        load_model(str(folder), progress=False)
    msg = str(info.value)
    assert "\n" not in msg
    assert "rope_type 'dynamic'" in msg and "depend on its neighbours" in msg and "rope_type 'default'" in msg
    # the same folder with plain RoPE loads
    plain = tmp_path / "plain-llama"
    tiny_llama_with_rope(None).save_pretrained(plain)
    build_tiny_tokenizer().save_pretrained(plain)
    assert load_model(str(plain), progress=False).model.config.rope_parameters["rope_type"] == "default"


def test_validate_refuses_a_dynamic_rope_model_folder(tmp_path: Path):
    folder = tmp_path / "m"
    tiny_llama_with_rope({"rope_type": "dynamic", "factor": 2.0}).save_pretrained(folder)
    (tmp_path / "s.yaml").write_text("max_requests: 2\nmodel: ./m\n")
    result = CliRunner().invoke(app, ["validate", str(tmp_path / "s.yaml")])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: {tmp_path / 's.yaml'}:2: model: model ./m: rope_type 'dynamic'"), line


def test_engine_refuses_a_dynamic_rope_model():
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        make_engine(tiny_llama_with_rope({"rope_type": "dynamic", "factor": 2.0}), max_len=128)


def test_length_dependent_rope_types():
    longrope = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=128,
                           rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8,
                                         "long_factor": [2.0] * 8, "original_max_position_embeddings": 32})
    assert length_dependent_rope(longrope) == "longrope"
    with pytest.raises(IncompatibleModel, match="longrope"):
        check_batch_invariant(longrope)
    for rope in ({"rope_type": "linear", "factor": 2.0}, {"rope_type": "default"},
                 {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}):
        config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=128, rope_scaling=rope)
        assert length_dependent_rope(config) is None, rope
        check_batch_invariant(config)
    # a raw config.json in the legacy form
    assert length_dependent_rope({"rope_scaling": {"type": "dynamic", "factor": 4.0}}) == "dynamic"


def test_gpt2_positions_past_its_table_fail_inside_transformers(tiny):
    model = tiny["tiny-gpt2"].model
    n_positions = model.config.n_positions
    with torch.inference_mode():
        model(input_ids=torch.tensor([[5, 6]]), position_ids=torch.tensor([[n_positions - 2, n_positions - 1]]))
        with pytest.raises(IndexError):
            model(input_ids=torch.tensor([[5]]), position_ids=torch.tensor([[n_positions]]))


def test_engine_refuses_max_len_past_learned_positions(tiny):
    model = tiny["tiny-gpt2"].model
    assert model.config.n_positions == 2048
    with pytest.raises(ValueError) as info:
        make_engine(model, max_len=2200)
    assert str(info.value) == ("max_len 2200 exceeds the model's 2048 learned positions (n_positions); "
                               "lower engine.max_len")


def test_max_len_equal_to_the_table_runs_a_long_prompt_beside_a_short_one(tiny):
    loaded = tiny["tiny-gpt2"]
    engine = make_engine(loaded.model, num_slots=2, max_len=2048, max_tokens_per_step=4096)
    params = SamplingParams(max_new_tokens=8)
    long = engine.submit("long", [7 + i % 200 for i in range(2040)], params)
    short = engine.submit("short", [9, 10, 11, 12, 13, 14, 15, 16], params)
    engine.run_until_done()
    assert [len(r.generated_ids) for r in (long, short)] == [8, 8]
    assert long.cache_len == 2047  # positions 0..2046 were fed


def test_rope_models_have_no_position_limit(tiny):
    model = tiny["tiny-llama"].model
    assert model.config.max_position_embeddings == 2048
    check_max_len(model.config, 4096)
    make_engine(model, num_slots=1, max_len=4096)


def test_validate_and_run_refuse_max_len_past_learned_positions(tmp_path: Path):
    scenario = tmp_path / "gpt2.yaml"
    scenario.write_text("max_requests: 2\nmodel: tiny-gpt2\nengine:\n  max_len: 2200\n")
    for args in (["validate", str(scenario)], ["run", str(scenario), "--headless"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, result.output
        assert result.stderr.splitlines() == [
            (f"error: {scenario}:4: engine.max_len: max_len 2200 exceeds the model's 2048 learned positions "
            "(n_positions); lower engine.max_len")]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_named_geometry_matches_the_tiny_models(tiny, name):
    model = tiny[name].model
    named, real = shape_from_config(NAMED_CONFIGS[name]), shape_from_config(model.config)
    assert named == real
    layers, _, kv_heads, head_dim = model_geometry(model)
    assert (named.num_layers, named.num_kv_heads, named.head_dim) == (layers, kv_heads, head_dim)
    cache_layer = model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=True).past_key_values.layers[0]
    assert tuple(cache_layer.keys.shape[1::2]) == (named.num_kv_heads, named.head_dim)


@pytest.mark.smollm
def test_named_geometry_matches_the_default_model(smollm2):
    assert shape_from_config(NAMED_CONFIGS["default"]) == shape_from_config(smollm2.model.config)
    assert shape_from_config(gguf_config(Path(smollm2.source_path))) == shape_from_config(NAMED_CONFIGS["default"])
    assert smollm2.model.config.max_position_embeddings == NAMED_CONFIGS["default"]["max_position_embeddings"]


def test_whisper_is_the_encoder_decoder_the_engine_runs():
    """Whisper runs (engine/encoder.py); another encoder-decoder is refused in one line naming the fix."""
    check_decoder_only({"model_type": "whisper", "is_encoder_decoder": True})
    with pytest.raises(IncompatibleModel, match=r"an encoder-decoder model \(t5\): the engine runs decoder-only "
                                                r"models and Whisper; use the default model"):
        check_decoder_only({"model_type": "t5", "is_encoder_decoder": True})
