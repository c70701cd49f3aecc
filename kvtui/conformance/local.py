"""`kvtui conformance` without --target: a `kvtui serve` in this process, configured so that every
check has something to act on: paged KV with 16-token blocks and the prefix cache on (tenant salts,
the prompt cache, embedding rows through the cache, copy-on-write of forked sequences), prompt
embeddings taken. With `faults` it is a mutant: a server with those isolation faults on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from kvtui.detect.tolerance import FLOAT32

BLOCK_SIZE = 16
MAX_LEN = 512
# the checks' numeric tolerance for this server (nats: a top-2 logprob gap equals the logit gap): it runs
# float32, whose batched-vs-solo spread is under 1e-4, so kvtui's own float32 tolerance
TOLERANCE = FLOAT32


# A hybrid (recurrent state: checkpoints kept with cached blocks) also gets a KV offload tier under a pool of
# HYBRID_NUM_BLOCKS (with the null block), so cached blocks are evicted into the tier and restored with their
# state checkpoints (the tier's faults act). 96 blocks of 16 tokens (1,536 tokens) hold what any other check
# reuses (a prompt-cache conversation's second sending comes after under 100 blocks of other traffic), so only
# the recurrent-state check's tier part, whose 6 first turns of ~24 blocks each come between a conversation's
# two turns, pushes its own blocks out into the tier.
HYBRID_NUM_BLOCKS = 97
HYBRID_OFFLOAD_BLOCKS = 512
# Models on kvtui's fused forward (registry entries with lora=True) serve two built-in seeded adapters, with
# runtime reloads allowed, so the adapters check applies; the others serve none (the check is n/a there).
LORA_MODULES = ("lora-a", "lora-b")


def serve_options(model: str = "default", faults: tuple[str, ...] = (), threads: int | None = None):
    """The ServeOptions of the conformance server: a free port, paged KV with prefix caching, prompt
    embeddings on, no engine detectors (the checks judge from outside). A hybrid model (tiny-qwen35moe)
    also gets a pool of HYBRID_NUM_BLOCKS blocks over an offload tier of HYBRID_OFFLOAD_BLOCKS, so its
    cached blocks and their recurrent-state checkpoints move between the two. A model that runs LoRA (its registry entry's `lora`) serves
    the adapters LORA_MODULES and allows reloading them at runtime."""
    from kvtui.model_kinds import ModelKind
    from kvtui.models.registry import kind_of
    from kvtui.serve.server import ServeOptions

    tier = {}
    if kind_of(model) is ModelKind.HYBRID:
        tier = {"kv_offload_blocks": HYBRID_OFFLOAD_BLOCKS, "extra": {"num_blocks": HYBRID_NUM_BLOCKS}}
    from kvtui.serve.lora import parse_lora_modules

    lora = {"lora_modules": parse_lora_modules(LORA_MODULES), "allow_runtime_lora_updating": True} \
        if _runs_lora(model) else {}
    return ServeOptions(model=model, port=0, faults=tuple(faults), kv="paged", block_size=BLOCK_SIZE,
                        prefix_caching=True, max_len=MAX_LEN, enable_prompt_embeds=True, detectors=(),
                        threads=threads, **tier, **lora)


def _runs_lora(model: str) -> bool:
    from kvtui.models.registry import find_model

    entry = find_model(model)
    return entry is not None and entry.lora


def describe(model: str = "default") -> str:
    """The conformance server's configuration in words, for the note the command prints when it starts it."""
    options = serve_options(model)
    tier = (f", {options.extra['num_blocks'] - 1} blocks over a {options.kv_offload_blocks}-block offload tier"
            if options.kv_offload_blocks else "")
    lora = f", LoRA adapters {' and '.join(m.name for m in options.lora_modules)}" if options.lora_modules else ""
    return f"paged KV, {BLOCK_SIZE}-token blocks, prefix caching{tier}, prompt embeddings{lora}"


@contextlib.contextmanager
def local_server(model: str = "default", faults: tuple[str, ...] = (), threads: int | None = None) -> Iterator[str]:
    """Start the conformance server (serve_options), yield its URL, stop it after.

    Raises:
        kvtui.serve.main.BadInput, ValueError: a fault this configuration cannot take, a model that cannot load.
        OSError: no port could be bound.
    """
    from kvtui.serve.server import ServeServer

    with ServeServer(serve_options(model, faults, threads)) as server:
        yield server.url
