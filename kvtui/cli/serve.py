"""`kvtui serve`: the engine behind an OpenAI-compatible API (kvtui/serve/)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvtui.cli.console import EXIT_RUNTIME, fail, out, say
from kvtui.cli.options import (
    DETECTORS_HELP,
    SERVE,
    FaultChoice,
    batch_invariant_option,
    compile_option,
    enforce_eager_option,
    fault_names,
    parse_detectors,
)
from kvtui.config import KNOB_BOUNDS, DType, KVMode, Layout
from kvtui.serve import API_KEY_ENV
from kvtui.serve.options import SERVE_MAX_TOKENS_PER_STEP

# The engine knobs' bounds are the engine's (kvtui.config.KNOB_BOUNDS). max_len, max_tokens_per_step and
# max_waiting take only the lower bound here: the scenario built from the flags refuses a value past the top.
_B = KNOB_BOUNDS
_SLOTS, _BATCH, _BLOCK = _B["num_slots"], _B["max_batch_size"], _B["block_size"]


def speech_max_len(model: str) -> int | None:
    """The decoder's learned positions (max_target_positions in its registry entry's config) of a speech model
    (`--model` any spelling), which has fewer than serve's default max_len; None for any other model."""
    from kvtui.models.registry import find_model

    entry = find_model(model)
    return (entry.config or {}).get("max_target_positions") if entry is not None else None


def serve(
    model: Annotated[str, typer.Option("--model", help="default, tiny-llama, tiny-gpt2, a HF model directory or a "
                                       ".gguf file.")] = SERVE.model,
    dtype: Annotated[DType, typer.Option(metavar="DTYPE", help="Weights, KV cache and activations: float32, bfloat16 or float16.")] = SERVE.dtype,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = SERVE.host,
    port: Annotated[int, typer.Option(help="TCP port (0: a free one).", min=0, max=65535)] = SERVE.port,
    fault: Annotated[Optional[list[FaultChoice]], typer.Option("--fault", metavar="FAULT", help="Turn an isolation fault on "
                                                               "(repeatable): it acts across clients.")] = None,
    dashboard: Annotated[bool, typer.Option("--dashboard", help="Show the served engine live in the dashboard.")]
    = False,
    record: Annotated[Optional[Path], typer.Option("--record", help="Write a JSONL recording here.")] = None,
    served_model_name: Annotated[Optional[str], typer.Option("--served-model-name", help="The model name clients "
                                                             "send and see (default: the model's id).")] = None,
    slots: Annotated[int, typer.Option(help="KV slots: requests running at once (with --kv paged: the block pool holds this many "
                                 "--max-len sequences; --max-batch-size caps the running requests).", min=_SLOTS.low, max=_SLOTS.high)] = SERVE.slots,
    max_len: Annotated[Optional[int], typer.Option(help=f"Tokens per request: prompt + completion (default "
                                                   f"{SERVE.max_len}; a Whisper model: its decoder's positions, "
                                                   "448 for whisper-tiny.en).", min=_B["max_len"].low)] = None,
    max_batch_size: Annotated[int, typer.Option(help="Most requests in one step.", min=_BATCH.low, max=_BATCH.high)] = SERVE.max_batch_size,
    max_tokens_per_step: Annotated[Optional[int], typer.Option(help="Token budget of one step (chunked prefill "
                                                               f"past it; default {SERVE_MAX_TOKENS_PER_STEP}, or "
                                                               "--max-batch-size when larger).",
                                                               min=_B["max_tokens_per_step"].low)] = None,
    max_waiting: Annotated[Optional[int], typer.Option(help="Most requests queued for a slot; more get 429 "
                                                       "(default: no limit).", min=_B["max_waiting"].low)] = SERVE.max_waiting,
    layout: Annotated[Layout, typer.Option(help="Batch layout.")] = SERVE.layout,
    kv: Annotated[KVMode, typer.Option("--kv", help="KV memory: slots (one region of --max-len per request) or "
                                       "paged (blocks through per-request block tables, as vLLM).")] = SERVE.kv,
    block_size: Annotated[Optional[int], typer.Option("--block-size", min=_BLOCK.low, max=_BLOCK.high, help="With --kv paged: tokens "
                                                      f"per KV block (default {SERVE.block_size}).")] = None,
    prefix_caching: Annotated[bool, typer.Option("--prefix-caching/--no-prefix-caching", help="With --kv paged: "
                                                 "reuse cached blocks of earlier prompts' prefixes; a request's "
                                                 "`cache_salt` keys its blocks, so only requests with the same "
                                                 "salt share them.")] = SERVE.prefix_caching,
    kv_offload_blocks: Annotated[int, typer.Option("--kv-offload-blocks", min=0, help="With --prefix-caching: blocks "
                                                   "of a host-memory KV offload tier (LRU); evicted cached blocks are "
                                                   "stored there and restored on a later prefix hit, as vLLM's "
                                                   "offloading connector and LMCache do (0: none).")] = 0,
    detectors: Annotated[str, typer.Option(help=DETECTORS_HELP)] = ",".join(SERVE.detectors),
    threads: Annotated[Optional[int], typer.Option(help="torch threads for the engine (default: all cores but "
                                                   "one).", min=1)] = None,
    device: Annotated[str, typer.Option(help="torch device, e.g. cpu or cuda.")] = SERVE.device,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar=API_KEY_ENV, show_default=False,
                                                   help="Require `Authorization: Bearer KEY` on /v1/* (401 "
                                                   "otherwise; /health and /metrics stay open), as vLLM's "
                                                   "--api-key.")] = None,
    max_request_bytes: Annotated[int, typer.Option(help="Largest request body taken, in bytes; bigger ones get "
                                                   "413 before they are parsed.", min=1)] = SERVE.max_request_bytes,
    enforce_eager: enforce_eager_option() = SERVE.enforce_eager,
    batch_invariant: batch_invariant_option() = SERVE.batch_invariant,
    compile: compile_option() = SERVE.compile,
    enable_prompt_embeds: Annotated[bool, typer.Option("--enable-prompt-embeds", help="Take prompt embeddings "
                                                       "(base64 torch.save tensors) in `prompt_embeds` of completions "
                                                       "and prompt_embeds parts of chat messages, as vLLM's flag; "
                                                       "off: such requests get 400.")] = SERVE.enable_prompt_embeds,
    lora_modules: Annotated[Optional[list[str]], typer.Option("--lora-modules", help="A LoRA adapter to serve "
                                                              "(repeatable), as vLLM's: name=path (a peft LoRA "
                                                              "folder), or a built-in local adapter by name (lora-a, "
                                                              "lora-b, lora-c); a request's `model` selects it. "
                                                              "Turns --enable-lora on.")] = None,
    enable_lora: Annotated[bool, typer.Option("--enable-lora", help="Serve LoRA adapters (Llama-family models), as "
                                              "vLLM's flag.")] = SERVE.enable_lora,
    allow_runtime_lora_updating: Annotated[bool, typer.Option("--allow-runtime-lora-updating",
                                                              envvar="VLLM_ALLOW_RUNTIME_LORA_UPDATING",
                                                              show_default=False, help="Serve /v1/load_lora_adapter "
                                                              "and /v1/unload_lora_adapter, as vLLM with "
                                                              "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (read here too).")]
    = SERVE.allow_runtime_lora_updating,
) -> None:
    """Serve the engine behind an OpenAI-compatible API (completions, chat, /metrics; audio transcriptions for a
    Whisper model) until Ctrl-C.

    Any OpenAI client, curl, `vllm bench serve` or GuideLLM can drive it; --dashboard shows inside.
    """
    from kvtui.serve.lora import parse_lora_modules
    from kvtui.serve.main import BadInput, run_serve
    from kvtui.serve.server import ServeOptions
    from kvtui.tui.launch import default_torch_threads

    if kv != "paged" and (prefix_caching or block_size is not None):
        fail(f"{'--prefix-caching' if prefix_caching else '--block-size'} needs paged KV: add --kv paged")
    if kv_offload_blocks and not prefix_caching:
        fail("--kv-offload-blocks needs the prefix cache: add --kv paged --prefix-caching")
    max_len = max_len or speech_max_len(model) or SERVE.max_len
    try:
        modules = parse_lora_modules(lora_modules)
    except ValueError as e:
        fail(str(e))
    options = ServeOptions(model=model, dtype=dtype, device=device, host=host, port=port,
                           faults=fault_names(fault), record=record, served_model_name=served_model_name, slots=slots,
                           max_len=max_len, max_batch_size=max_batch_size, max_tokens_per_step=max_tokens_per_step,
                           layout=layout, kv=kv, block_size=block_size or SERVE.block_size, prefix_caching=prefix_caching,
                           kv_offload_blocks=kv_offload_blocks, max_waiting=max_waiting, detectors=parse_detectors(detectors),
                           threads=threads or default_torch_threads(), progress=True, api_key=api_key or None,
                           max_request_bytes=max_request_bytes, enforce_eager=enforce_eager,
                           batch_invariant=batch_invariant, compile=compile, enable_prompt_embeds=enable_prompt_embeds,
                           lora_modules=modules, enable_lora=enable_lora,
                           allow_runtime_lora_updating=allow_runtime_lora_updating)
    from kvtui.faults import FAULTS, server_faults

    for name in server_faults(options.faults):
        say("note", f"--fault {name} acts in the HTTP layer ({FAULTS[name].acts_in.split(':')[0]}), after the engine: "
                    "the engine's answers stay right and its detectors see nothing; a client-side audit sees it "
                    "(`kvtui run scenarios/request_ids.yaml --target URL --headless`)")
    if dashboard and not (sys.stdout.isatty() and sys.stderr.isatty()):
        say("note", "not a terminal: serving without the dashboard.")
        dashboard = False
    try:
        result = run_serve(options, dashboard=dashboard, note=lambda text: say("note", text))
    except BadInput as e:
        fail(str(e))
    from kvtui.summary import print_contamination, print_summary

    if result.summary is not None:
        print_summary(result.summary, result.header, out)
        print_contamination(result.contamination, out, recording=record)
    if record and not result.recording_error:
        out.print(f"recording: {record}", markup=False, highlight=False)
    _quick_exit()
    if result.error is not None:
        fail(f"runtime error: {type(result.error).__name__}: {result.error}", EXIT_RUNTIME)
    if result.recording_error:
        fail(f"{result.recording_error}; serving went on without it (free space, or choose another --record path)",
             EXIT_RUNTIME)


def _quick_exit() -> None:
    """Everything is written: spare the interpreter's final garbage collection over the model's and
    torch's objects, which took 2-4 s of a `kvtui serve` exit on a loaded 2-core machine (0.4 s
    without it). gc.freeze moves every object out of the collector's reach; memory goes back to the
    system with the process."""
    import gc

    gc.freeze()
