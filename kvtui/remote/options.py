"""How to reach and drive a target server (TargetOptions), light to import: the command line reads its
`--target` options' defaults from here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx

# Top-1 minus top-2 logprob (nats) under which a divergence counts as numeric. Batched-vs-solo flips
# measured on llama-server (SmolLM2 Q4_1, CPU, -np 4) had gaps under 0.05; bfloat16 GPU servers flip
# gaps up to a few tenths (kvtui's own bfloat16 tolerance is 0.5 logits), so the default is 0.5.
DEFAULT_TOLERANCE = 0.5


@dataclass(frozen=True)
class TargetOptions:
    """How to reach and drive a target server.

    Attributes:
        url: base URL, e.g. http://127.0.0.1:8000 (the /v1/... paths are added).
        api: "chat", "completions", or "auto" (chat when every prompt has text, else completions).
        served_model: the `model` field to send; None asks /v1/models and takes the first.
        max_concurrency: requests in flight at most (later arrivals wait for a free place).
        timeout_s: one request's limit (seconds), from send to the end of its stream.
        poll_interval_s: seconds between two polls of /metrics and /slots.
        tolerance: top-2 logprob gap (nats) under which a reference divergence is numeric.
        logprobs: ask for top logprobs (the reference check labels divergences with them).
        transport: an httpx transport to use instead of the network (tests).
        uncached_load: send every load request past the server's prefix cache too, as the reference
            runs are (the noninterference audit: its runs must not read each other's KV).
        reference_url: base URL of the server the reference (solo) runs go to, e.g. a second instance
            of the same server and model with its prompt cache off; None: the target itself.
    """

    url: str
    api: str = "auto"
    served_model: str | None = None
    max_concurrency: int = 64
    timeout_s: float = 120.0
    poll_interval_s: float = 0.5
    tolerance: float = DEFAULT_TOLERANCE
    logprobs: bool = True
    transport: httpx.AsyncBaseTransport | None = None
    uncached_load: bool = False
    reference_url: str | None = None
