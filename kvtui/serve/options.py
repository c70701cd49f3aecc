"""`kvtui serve`'s options (ServeOptions), light to import: the command line reads its flags'
defaults from here. The engine knobs' defaults are the engine's own (kvtui.config.EngineConfig), but for
the token budget per step (SERVE_MAX_TOKENS_PER_STEP)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvtui.config import EngineConfig
from kvtui.serve import DEFAULT_MAX_REQUEST_BYTES

_ENGINE = EngineConfig()  # the engine knobs' defaults
# The detectors a server runs by default, the default of `kvtui serve --detectors`. prefix_provenance is
# not among them: name it in --detectors to check prefix-cache hits (--kv paged --prefix-caching).
# state_provenance acts on hybrid models only (a recurrent state started from another request's) and costs
# nothing on the others.
SERVE_DETECTORS = ("reference", "canary", "attention_flow", "slot_taint", "constraint", "sampling_provenance",
                   "state_provenance")
# A server's token budget per step, smaller than a scenario's (EngineConfig: 1024), as vLLM keeps a
# smaller max_num_batched_tokens for its API server than for its offline LLM class. A step of 256 prompt
# tokens is already as efficient per token as a larger one (the linear layers run near the CPU's peak
# from about 128 rows), while a smaller budget ends the first arrivals' prefills sooner and lets running
# decodes take a token in every prefill step. On the peers workload (docs/performance.md), one thread of
# a 2-core AMD EPYC (avx2, no avx512): TTFT p50 2.2-2.3 s at 256 against 3.7-3.9 s at 1024, output
# tokens/s 39.2-40.3 against 38.8-39.3. Measured again against 2048 on that workload and at saturation (the
# same requests all at once), 3 A/B rounds on a shared AVX-512 AMD EPYC: TTFT p50 lower at 256 in every
# serve round; serve at saturation 1.01-1.73x faster at 2048 but the engine alone faster at 256 in four of
# six pairs (docs/performance.md, fourth pass), so 256 stays. Never below max_batch_size (serve_budget):
# decodes take one token each first, so a smaller budget would leave the later rows and every prefill waiting.
SERVE_MAX_TOKENS_PER_STEP = 256


@dataclass(frozen=True)
class ServeOptions:
    """`kvtui serve`'s choices. Engine knobs as kvtui.config.EngineConfig (tokens, requests), with its
    defaults but the token budget per step (None: serve_budget). `api_key`: the Bearer token /v1/*
    needs (None: open); `max_request_bytes`: the largest request body taken (bytes; 413 past it);
    `enable_prompt_embeds`: take vLLM's `prompt_embeds` (completions) and prompt_embeds content parts
    (chat), else 400."""

    model: str = "default"
    dtype: str = "float32"
    device: str = _ENGINE.device
    host: str = "127.0.0.1"
    port: int = 8000
    faults: tuple[str, ...] = ()
    record: str | Path | None = None
    served_model_name: str | None = None
    slots: int = _ENGINE.num_slots
    max_len: int = _ENGINE.max_len
    max_batch_size: int = _ENGINE.max_batch_size
    max_tokens_per_step: int | None = None  # None: serve_budget(max_batch_size)
    layout: str = _ENGINE.layout
    kv: str = _ENGINE.kv
    block_size: int = _ENGINE.block_size
    prefix_caching: bool = _ENGINE.prefix_caching
    kv_offload_blocks: int = 0  # blocks of the KV offload tier (paged, prefix caching; kvtui/engine/offload.py)
    max_waiting: int | None = _ENGINE.max_waiting
    detectors: tuple[str, ...] = SERVE_DETECTORS
    threads: int | None = None
    progress: bool = False
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    enforce_eager: bool = _ENGINE.enforce_eager
    batch_invariant: bool | None = None  # None: the engine's default (on for bfloat16/float16 with reference)
    compile: bool | None = _ENGINE.compile  # the compiled decode step (EngineConfig.compile)
    enable_prompt_embeds: bool = False  # take prompt_embeds in requests (kvtui/serve/embeds.py)
    # LoRA (kvtui/serve/lora.py): adapters loaded at startup (LoraModule), LoRA on without them, and vLLM's
    # runtime LoRA updating (/v1/load_lora_adapter, /v1/unload_lora_adapter)
    lora_modules: tuple = ()
    enable_lora: bool = False
    allow_runtime_lora_updating: bool = False
    extra: dict = field(default_factory=dict)  # more engine-section fields (tests)


def serve_budget(max_batch_size: int) -> int:
    """The token budget per step a server takes when none is given: SERVE_MAX_TOKENS_PER_STEP, or
    `max_batch_size` when larger (every running request's decode token fits in one step)."""
    return max(SERVE_MAX_TOKENS_PER_STEP, max_batch_size)
