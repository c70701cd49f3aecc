"""One HTTP request's engine requests read as one: a /v1/completions body with a list of prompts submits one
engine request per prompt (each with its n sequences), and its handler reads all of them through one queue.

Choice numbering is vLLM's (vllm/entrypoints/openai/completion/serving.py): sequence i of prompt p is choice
`p * n + i`. A single prompt is the same with p = 0, so the text and chat endpoints read every request this
way.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from kvtui.events import Finish
from kvtui.serve.bridge import Closed, RequestStream, TokenOut


class Choices:
    """The streams of one HTTP request's prompts merged into `queue`, with choice indices across prompts.

    Args:
        streams: one RequestStream per prompt, in prompt order (each of the same n).
        prompt_tokens: each prompt's token count (usage counts each prompt once, whatever n).
    """

    def __init__(self, streams: list[RequestStream], prompt_tokens: list[int]) -> None:
        self.streams = streams
        self.n = streams[0].n  # sequences per prompt
        self.total = len(streams) * self.n  # choices in the response
        self.prompt_tokens = sum(prompt_tokens)
        self.request_ids = [s.request_id for s in streams]
        self._index = {seq: p * self.n + i for p, s in enumerate(streams) for seq, i in s.indices.items()}
        self.queue: asyncio.Queue = asyncio.Queue()
        self._pumps = [asyncio.ensure_future(self._pump(p, s)) for p, s in enumerate(streams)]

    async def _pump(self, prompt: int, stream: RequestStream) -> None:
        """Forward one prompt's items with their choice index; it ends after its n finishes (or Closed)."""
        left = stream.n
        while left:
            item = await stream.queue.get()
            if isinstance(item, TokenOut):
                item = replace(item, index=prompt * self.n + item.index)
            elif isinstance(item, Finish):
                left -= 1
            elif isinstance(item, Closed):
                left = 0
            self.queue.put_nowait(item)

    def index_of(self, request_id: str) -> int:
        """The choice index of an engine sequence id."""
        return self._index[request_id]

    def prompt_of(self, index: int) -> int:
        """The prompt a choice index belongs to."""
        return index // self.n

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens taken from the prefix cache, all prompts together (None: no prefix cache)."""
        counts = [s.cached_tokens for s in self.streams if s.cached_tokens is not None]
        return sum(counts) if counts else None

    def abort(self, bridge) -> None:
        """Abort every prompt's engine request (any that finished already is left alone) and stop forwarding."""
        for request_id in self.request_ids:
            bridge.abort(request_id)
        self.close()

    def close(self) -> None:
        """Stop the forwarding tasks."""
        for pump in self._pumps:
            pump.cancel()
