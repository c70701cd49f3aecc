"""GGUF -> float32 safetensors conversion, done once per GGUF file and cached on disk.

transformers dequantizes a GGUF in about 12 s (plus 3-4 s for its tokenizer) for SmolLM2-135M;
the safetensors copy it is saved to loads in well under a second. A copy lives in
`cache_dir()/<name>-<first 12 hex of the GGUF's sha256>/` with a `kvtui-cache.json` marker. It is
written into a `.partial-*` folder and renamed into place, so an interrupted conversion never
leaves a half-written copy behind.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from kvtui.models.chat import CHATML_TEMPLATE, prepare_tokenizer
from kvtui.models.types import ModelLoadError, one_line

CACHE_FORMAT = 1
MARKER = "kvtui-cache.json"
PARTIAL_PREFIX = ".partial-"

log = logging.getLogger(__name__)


def cache_name(stem: str, sha256: str) -> str:
    """Folder name of a converted copy: a file-system-safe stem plus 12 hex of the sha256."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("._") or "model"
    return f"{safe}-{sha256[:12]}"


def is_valid_copy(dest: Path, sha256: str) -> bool:
    """True when `dest` holds a finished conversion of the GGUF whose hash is `sha256`."""
    try:
        marker = json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(marker, dict)
        and marker.get("format") == CACHE_FORMAT
        and marker.get("source_sha256") == sha256
        and (dest / "model.safetensors").is_file()
    )


def read_gguf(
    path: Path, chat_template: str = CHATML_TEMPLATE
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Dequantize a GGUF into a float32 transformers model and read its tokenizer (slow: ~15 s
    for SmolLM2-135M). transformers' own tqdm bar is silenced by pointing sys.stderr at
    os.devnull meanwhile (process-wide: other threads' stderr writes are dropped too).

    The tokenizer gets `chat_template` if the GGUF carries none, and a pad token.

    Raises:
        ModelLoadError: transformers cannot read the file (not a GGUF, unsupported architecture).
    """
    folder, name = str(path.parent), path.name
    try:
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
            model = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=name, dtype=torch.float32, local_files_only=True
            )
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except Exception as exc:  # transformers raises many kinds for a bad file
        raise ModelLoadError(f"cannot read GGUF file {path}: {one_line(exc)}") from exc
    # A GGUF-loaded model refuses save_pretrained ("quantized with gguf") until the quantizer is
    # dropped; the weights are already dequantized to float32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    prepare_tokenizer(tokenizer, chat_template)
    return model.eval(), tokenizer


def write_copy(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, dest: Path, sha256: str, source: Path
) -> None:
    """Save model (safetensors) + tokenizer + marker into `dest`, atomically.

    If another process finished the same copy first, its copy is kept.

    Raises:
        OSError: the cache folder is not writable or the disk is full.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphans(dest)
    tmp = _partial_dir(dest)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        marker = {
            "format": CACHE_FORMAT,
            "source_sha256": sha256,
            "source_name": source.name,
            "dtype": "float32",
            "transformers": transformers.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if dest.exists():  # a stale or foreign copy: move it aside first
            if is_valid_copy(dest, sha256):
                return
            old = _partial_dir(dest)
            os.replace(dest, old / "stale")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not is_valid_copy(dest, sha256):  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _partial_dir(dest: Path) -> Path:
    """A new empty `.partial-<dest name>-<pid>-<random>` folder next to `dest`."""
    return Path(tempfile.mkdtemp(prefix=f"{PARTIAL_PREFIX}{dest.name}-{os.getpid()}-", dir=dest.parent))


def _remove_orphans(dest: Path) -> None:
    """Delete `.partial-<dest name>-<pid>-*` folders left by conversions whose process is gone."""
    for partial in dest.parent.glob(f"{PARTIAL_PREFIX}{dest.name}-*"):
        pid_text = partial.name[len(f"{PARTIAL_PREFIX}{dest.name}-"):].split("-", 1)[0]
        if pid_text.isdigit() and not _alive(int(pid_text)):
            shutil.rmtree(partial, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists but not ours
        return True
    return True


def convert_gguf(
    path: Path,
    dest: Path,
    sha256: str,
    *,
    label: str,
    chat_template: str = CHATML_TEMPLATE,
    progress: bool = True,
    expected_s: float | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Read a GGUF (float32) and save a safetensors copy of it into `dest`; return the model read.

    With progress, a rich status line on stderr says what is happening, e.g. "converting SmolLM2
    GGUF to safetensors (one time, ~20 s)" (`expected_s` gives the estimate). If the copy cannot
    be written (read-only or full disk), a warning is shown (or logged, without progress) and the
    in-memory model is still returned.

    Raises:
        ModelLoadError: the GGUF cannot be read.
    """
    console = _console() if progress else None
    estimate = f", ~{expected_s:.0f} s" if expected_s else ""
    title = f"converting {label} GGUF to safetensors (one time{estimate})"
    started = time.perf_counter()
    if console and not console.is_terminal:  # no live status line in a pipe: say it once
        console.print(f"{title} ...", soft_wrap=True, markup=False)
    status_line = console.status(f"{title}: dequantizing weights") if console else contextlib.nullcontext()
    with status_line as status:
        model, tokenizer = read_gguf(path, chat_template)
        if status is not None:
            status.update(f"{title}: writing the safetensors copy")
        try:
            write_copy(model, tokenizer, dest, sha256, path)
        except OSError as exc:
            warning = f"could not write {dest} ({exc}): using the model uncached, it converts again next time"
            if console:
                console.print(warning, style="yellow", soft_wrap=True, markup=False)
            else:
                log.warning(warning)
            return model, tokenizer
    if console:
        seconds = time.perf_counter() - started
        console.print(f"converted {label} GGUF in {seconds:.1f} s -> {dest}", soft_wrap=True, markup=False)
    return model, tokenizer


def _console():
    """A rich console bound to the real stderr (read now, so that silencing transformers' tqdm
    by redirecting sys.stderr does not silence it too)."""
    from rich.console import Console

    return Console(file=sys.stderr, stderr=True)

