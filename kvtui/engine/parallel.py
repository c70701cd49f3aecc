"""Parallel sampling (`n > 1`): one request, n sequences that share its prompt's prefill.

Names and seeds follow vLLM V1 (vllm/v1/engine/parallel_sampling.py, `ParentRequest`): child i of
request R is `f"{i}_{R}"`, runs with n = 1, and with a seed draws with `seed + i` (kvtui requests
always carry a seed, so every child is reproducible). Unlike vLLM V1, which submits the children as
separate requests that share the prompt through the prefix cache, kvtui prefills the prompt once,
with child 0 (the lead), and forks the others from it when its prefill samples: a slot cache copies
the prompt's K/V into each child's own slot; paged KV shares the prompt's blocks by reference count
and copies the last, partial block on the first write (copy-on-write). Each child then equals a solo
run of its own sampling parameters, token for token.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvtui.engine.request import RequestState, SamplingParams


def child_id(parent_id: str, index: int) -> str:
    """The request id of sequence `index` of `parent_id` (vLLM's `f"{index}_{request_id}"`)."""
    return f"{index}_{parent_id}"


def child_sampling(params: SamplingParams, index: int) -> SamplingParams:
    """Sequence `index`'s parameters: n = 1 and seed + index (vLLM's rule for a seeded request)."""
    return replace(params, n=1, seed=params.seed + index)


@dataclass
class Families:
    """The engine's parallel-sampling bookkeeping (plain Python).

    Attributes:
        pending: lead request id -> its siblings waiting for the lead's prefill to fork from.
        members: parent id -> the ids of its sequences not yet retired.
    """

    pending: dict[str, list[RequestState]] = field(default_factory=dict)
    members: dict[str, list[str]] = field(default_factory=dict)

    def add(self, parent_id: str, lead: RequestState, siblings: list[RequestState]) -> None:
        self.members[parent_id] = [lead.request_id] + [s.request_id for s in siblings]
        if siblings:
            self.pending[lead.request_id] = siblings

    def ids(self, request_id: str) -> tuple[str, ...]:
        """The sequences a submitted id stands for: its children for n > 1, else itself."""
        return tuple(self.members.get(request_id, (request_id,)))

    def retire(self, request: RequestState) -> None:
        """Forget a retired sequence (and its family once all are gone: bounded memory)."""
        members = self.members.get(request.parent_id or "")
        if members is not None and request.request_id in members:
            members.remove(request.request_id)
            if not members:
                del self.members[request.parent_id]
