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


def serve_options(model: str = "default", faults: tuple[str, ...] = (), threads: int | None = None):
    """The ServeOptions of the conformance server: a free port, paged KV with prefix caching, prompt
    embeddings on, no engine detectors (the checks judge from outside)."""
    from kvtui.serve.server import ServeOptions

    return ServeOptions(model=model, port=0, faults=tuple(faults), kv="paged", block_size=BLOCK_SIZE,
                        prefix_caching=True, max_len=MAX_LEN, enable_prompt_embeds=True, detectors=(),
                        threads=threads)


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
