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
from kvtui.models.chat import CHATML_TEMPLATE, prepare_tokenizer
from kvtui.models.loader import DEFAULT_ALIASES, HYBRID_NAME, WHISPER_NAMES, unknown_model
from kvtui.models.tiny import TINY_NAMES, build_tiny_tokenizer
from kvtui.models.types import ModelLoadError, one_line


def load_tokenizer(name: str = "default") -> PreTrainedTokenizerBase:
    """The tokenizer of model `name` (the names `load_model` takes), with a chat template and a pad token.

    Raises:
        ModelLoadError: unknown name or path, default model not installed, or an unreadable file; one line.
    """
    key = name.strip().lower()
    if key in TINY_NAMES or key == "tiny-vision":  # tiny-vision: tiny-llama with an image encoder
        return build_tiny_tokenizer()
    if key in ("dinov2-smollm2", HYBRID_NAME):  # SmolLM2 with an image encoder; the hybrid has SmolLM2's tokenizer
        key = "default"
    if key in WHISPER_NAMES:
        from kvtui.models import whisper as _whisper

        if key == _whisper.TINY_WHISPER:
            return _whisper.build_tiny_whisper_tokenizer()
        return _whisper.build_whisper_tokenizer(_whisper.whisper_model_dir() / "tokenizer.json")
    if key in DEFAULT_ALIASES:
        path = _default.default_model_path()
        return _gguf_tokenizer(path, _default.DEFAULT_MODEL_ID, _default.SMOLLM2_CHAT_TEMPLATE)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        sha = _default.file_sha256(path)
        if sha == _default.DEFAULT_GGUF_SHA256:
            return _gguf_tokenizer(path, _default.DEFAULT_MODEL_ID, _default.SMOLLM2_CHAT_TEMPLATE)
        return _gguf_tokenizer(path, path.stem, CHATML_TEMPLATE)
    if path.is_dir() and (path / "config.json").is_file():
        return _read(path, {}, CHATML_TEMPLATE, f"cannot read the tokenizer of {path}")
    raise unknown_model(name)


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
