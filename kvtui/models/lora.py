"""Local LoRA adapters for kvtui's models, made here with fixed seeds: no network, no hub.

`local_adapter(model_id, config, name, seed)` builds a peft LoraConfig (rank 8 on q/k/v/o/gate/up/down,
`init_lora_weights=False`, so both A and B are drawn from the seeded generator and the adapter really
changes the answers), wraps a randomly initialized skeleton of the model (only the shapes matter: the
adapter's weights do not depend on the base weights), and saves it with peft's `save_pretrained` in
kvtui's cache (`cache_dir()/lora/<model>--<name>--seed<seed>`), once per model, name and seed.

The built-in names (`BUILTIN_ADAPTERS`) are what a scenario's `adapter:` and `kvtui serve --lora-modules`
accept without a path: each is a seed, so `lora-a` on SmolLM2 is the same adapter on every machine.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

BUILTIN_ADAPTERS: dict[str, int] = {"lora-a": 1, "lora-b": 2, "lora-c": 3}
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK, ALPHA = 8, 4  # scaling 0.5: the answers change, the model still speaks


def adapter_dir(model_id: str, name: str, seed: int) -> Path:
    """Where the local adapter `name` with `seed` for `model_id` is kept (kvtui's cache)."""
    from kvtui.models.default import cache_dir

    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{model_id}--{name}--seed{seed}")
    return cache_dir() / "lora" / safe


def local_adapter(model_id: str, config, name: str, seed: int) -> Path:
    """The folder of local adapter `name` made with `seed` for a model of `config` (a transformers
    Llama-family config; `model_id` names the model in the folder name), made now if missing.

    Raises:
        ValueError: `config` is not a Llama-family causal LM config.
    """
    path = adapter_dir(model_id, name, seed)
    if (path / "adapter_model.safetensors").is_file() and (path / "adapter_config.json").is_file():
        return path
    if getattr(config, "model_type", None) != "llama":
        raise ValueError(f"local LoRA adapters are made for Llama-family models, not {config.model_type!r}")
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    lora = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGET_MODULES), lora_dropout=0.0,
                      bias="none", init_lora_weights=False, task_type="CAUSAL_LM")
    torch.manual_seed(seed)
    with warnings.catch_warnings():  # peft asks transformers a deprecated question; not the user's concern
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = get_peft_model(skeleton, lora)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    peft_model.save_pretrained(str(tmp))
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.replace(path)
    except OSError:  # another process made it meanwhile
        pass
    return path


def resolve_adapter(model_id: str, config, name: str, path: str | None = None, seed: int | None = None) -> Path:
    """The folder of adapter `name`: `path` when given (a peft LoRA folder), else a local adapter made
    with `seed`, or the built-in name's seed.

    Raises:
        ValueError: a path that is no folder; no path, no seed and not a built-in name (the message lists
            the built-in names).
    """
    if path is not None:  # a folder on this machine: peft would take anything else for a hub id and download
        if not Path(path).is_dir():
            raise ValueError(f"LoRA adapter {name!r}: {path} is no folder (nothing is downloaded: give the path of a "
                             "peft LoRA folder holding adapter_config.json)")
        return Path(path)
    if seed is None:
        if name not in BUILTIN_ADAPTERS:
            raise ValueError(f"unknown LoRA adapter {name!r}: give its folder (name=path) or use a built-in one: "
                             f"{', '.join(BUILTIN_ADAPTERS)}")
        seed = BUILTIN_ADAPTERS[name]
    return local_adapter(model_id, config, name, seed)


def adapter_gguf(folder: Path, base: Path) -> Path:
    """The peft adapter in `folder` as a float32 GGUF LoRA for llama.cpp (`llama-server --lora FILE`),
    converted once by llama.cpp's own `convert_lora_to_gguf.py --base BASE` (from the sources
    scripts/build-llama-server.sh built llama-server from) and kept in `folder` as `adapter-f32.gguf`, beside a
    stamp naming the converter's version; about 5 s the first time, then a file check.

    Args:
        folder: a peft LoRA folder (e.g. local_adapter's). base: the base model's Hugging Face folder (its
            config.json is what the converter reads).

    Raises:
        ModelLoadError: the converter is missing (the fix: scripts/build-llama-server.sh) or failed (its last
            output lines in the message).
    """
    from kvtui.models.hybrid import CONVERTER_HINT, converter_dir, converter_version, run_converter
    from kvtui.models.types import ModelLoadError

    script = converter_dir() / "convert_lora_to_gguf.py"
    version = converter_version()
    if not script.is_file():
        raise ModelLoadError(f"llama.cpp's convert_lora_to_gguf.py not found in {converter_dir()}: {CONVERTER_HINT}")
    path, stamp = folder / "adapter-f32.gguf", folder / "adapter-f32.gguf.stamp"
    if path.is_file() and stamp.is_file() and stamp.read_text().strip() == version:
        return path
    tmp = folder / f".partial-adapter-f32.gguf-{os.getpid()}"
    run_converter(script.name, ["--base", str(base), "--outfile", str(tmp), "--outtype", "f32", str(folder)], tmp,
                  folder)
    tmp.replace(path)
    stamp.write_text(version + "\n")
    return path


def default_adapter_gguf(name: str) -> Path:
    """Built-in adapter `name` (BUILTIN_ADAPTERS) for kvtui's default model, SmolLM2-135M-Instruct, as a GGUF
    LoRA for llama-server (adapter_gguf over the model's converted Hugging Face folder, converting the model
    first when that folder is missing): the adapter `kvtui serve --lora-modules NAME` serves, for llama.cpp.

    Raises:
        ModelLoadError: the default model or llama.cpp's converter is missing, or a conversion failed.
    """
    from kvtui.models.default import DEFAULT_GGUF_SHA256, cache_dir
    from kvtui.models.gguf import cache_name, is_valid_copy
    from kvtui.models.labels import DEFAULT_MODEL_ID

    base = cache_dir() / cache_name(DEFAULT_MODEL_ID, DEFAULT_GGUF_SHA256)
    if not is_valid_copy(base, DEFAULT_GGUF_SHA256):
        from kvtui.models import load_model

        load_model("default")  # converts the GGUF into `base`
    from transformers import AutoConfig

    folder = local_adapter(DEFAULT_MODEL_ID, AutoConfig.from_pretrained(base), name, BUILTIN_ADAPTERS[name])
    return adapter_gguf(folder, base)
