"""Reading a peft LoRA folder safely: the files it must hold, every adapter_config.json value kvtui uses,
and weights that stay finite in the model's dtype. Each problem is one ValueError line naming the file,
the field or tensor, and what it should be; engine/lora.py `load_adapter` calls these before and after
peft's own readers, so no value of the folder can raise anything else (a ZeroDivisionError for `r: 0`,
a TypeError for a string `lora_alpha`) or put NaN or infinity into a request's logits.

The weight bound: an adapter adds (x @ A^T) @ B^T * scaling, whose weight is the delta B @ A * scaling
that peft's `merge_and_unload` adds to the base weight. It is refused when any entry of that delta is
not finite in the model's dtype (a merged model would hold inf there). Every entry is at most
max_i |B[i, :]| * max_j |A[:, j]| * |scaling| (Cauchy-Schwarz, in float64), so the product is computed
only for a module whose bound passes the dtype's largest value.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

CONFIG = "adapter_config.json"
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # what peft's load_peft_weights reads, in order
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_BIASES = ("none", "all", "lora_only")  # peft's choices (kvtui runs "none": engine/lora.py _check_config)


def check_files(folder: Path) -> Path:
    """The weights file of the peft LoRA folder `folder` (adapter_model.safetensors, else .bin).

    Raises:
        ValueError: the folder lacks adapter_config.json or both weights files (one line naming the file
            and the folder; peft would take the folder for a hub id and answer with hub text).
    """
    if not (folder / CONFIG).is_file():
        raise ValueError(f"{folder}: no {CONFIG} in this folder; a peft LoRA folder holds {CONFIG} and "
                         f"{WEIGHTS[0]} (peft's save_pretrained writes both)")
    found = next((folder / name for name in WEIGHTS if (folder / name).is_file()), None)
    if found is None:
        raise ValueError(f"{folder}: no {WEIGHTS[0]} (nor {WEIGHTS[1]}) in this folder; a peft LoRA folder holds "
                         f"{CONFIG} and {WEIGHTS[0]} (peft's save_pretrained writes both)")
    return found


def read_config(folder: Path) -> dict:
    """adapter_config.json of `folder` as a dict, every value kvtui uses checked (see check_config).

    Raises:
        ValueError: unreadable, not JSON, not an object, or a bad value (one line naming the field).
    """
    path = folder / CONFIG
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read it ({type(e).__name__}: {e})") from None
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object of peft LoraConfig fields, got {type(raw).__name__}")
    problem = check_config(raw)
    if problem:
        raise ValueError(f"{path}: {problem}")
    return raw


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _got(value) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_targets(value) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):  # peft's regex form (matched against module names)
        try:
            re.compile(value)
        except re.error as e:
            return f"target_modules must be a list of module names or a regular expression, got {_got(value)} ({e})"
        return None
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        return f"target_modules must be a non-empty list of module names, got {_got(value)}"
    other = next((v for v in value if v not in TARGETS), None)
    if other is not None:
        return f"target_modules: kvtui runs LoRA on {', '.join(TARGETS)}, not {other!r}"
    return None


def _field_problem(name: str, value) -> str | None:
    """Why one present field's value is bad, or None."""
    if name == "r":
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        return None if ok else f"r must be a positive integer (the adapter's rank), got {_got(value)}"
    if name == "lora_alpha":
        ok = _number(value) and math.isfinite(value)
        return None if ok else f"lora_alpha must be a finite number, got {_got(value)}"
    if name == "lora_dropout":
        ok = _number(value) and 0 <= value < 1
        return None if ok else f"lora_dropout must be a number from 0 to below 1, got {_got(value)}"
    if name in ("use_rslora", "use_dora", "fan_in_fan_out"):
        return None if isinstance(value, bool) else f"{name} must be true or false, got {_got(value)}"
    if name == "peft_type":
        return None if value == "LORA" else f"peft_type must be \"LORA\" (a LoRA adapter), got {_got(value)}"
    if name == "bias":
        return None if value in _BIASES else f"bias must be one of {', '.join(_BIASES)}, got {_got(value)}"
    if name in ("rank_pattern", "alpha_pattern"):
        return None if value is None or isinstance(value, dict) else f"{name} must be an object, got {_got(value)}"
    if name == "modules_to_save":
        ok = value is None or (isinstance(value, list) and all(isinstance(v, str) for v in value))
        return None if ok else f"modules_to_save must be null or a list of module names, got {_got(value)}"
    if name == "target_modules":
        return _check_targets(value)
    return None


REQUIRED = ("r", "lora_alpha")  # the scaling: peft would fill in its defaults (8, 8) and scale by a guess


def check_config(raw: dict) -> str | None:
    """Why the adapter_config.json values `raw` cannot be run (one line naming the field), or None.

    Checks the fields kvtui reads or that change what an adapter computes: r (a positive integer) and
    lora_alpha (a finite number), both required; if present, use_rslora, use_dora and fan_in_fan_out
    (booleans), peft_type ("LORA"), bias, lora_dropout, rank_pattern / alpha_pattern (objects),
    modules_to_save (a list) and target_modules (module names among TARGETS, or peft's regex form)."""
    for name in REQUIRED:
        if name not in raw:
            return (f"{name} is missing (the adapter's {'rank' if name == 'r' else 'scale'}); peft's "
                    "save_pretrained writes it")
    for name, value in raw.items():
        problem = _field_problem(name, value)
        if problem:
            return problem
    return None


def check_weights(state: dict, file: Path) -> None:
    """Every tensor of the adapter's state dict (key -> tensor, as peft's load_peft_weights reads it) a
    finite floating-point tensor. Raises ValueError naming the file and the tensor."""
    for key, tensor in state.items():
        if not torch.is_tensor(tensor) or not tensor.is_floating_point():
            raise ValueError(f"{file}: {key} is not a floating-point tensor")
        if not bool(torch.isfinite(tensor).all()):
            kind = "NaN" if bool(torch.isnan(tensor).any()) else "infinity"
            raise ValueError(f"{file}: {key} holds {kind}; an adapter's weights must be finite numbers")


def delta_overflows(a: torch.Tensor, b: torch.Tensor, scaling: float, dtype: torch.dtype) -> bool:
    """Whether some entry of B @ A * scaling (A [r, in], B [out, r]: the weight peft's merge adds) is not
    finite in `dtype`. The Cauchy-Schwarz bound decides without the product when it is below the
    dtype's largest value."""
    limit = torch.finfo(dtype).max
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    bound = float(b64.norm(dim=1).max()) * float(a64.norm(dim=0).max()) * abs(scaling) if a.numel() and b.numel() \
        else 0.0
    if bound <= limit:
        return False
    return not bool(torch.isfinite((b64 @ a64 * scaling).to(dtype)).all())
