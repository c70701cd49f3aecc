"""The recurrent-state pool of a hybrid model: per request, per linear-attention layer, a conv state and a
recurrent state, fixed in size whatever the request's length.

A hybrid (tiny-qwen35moe: gated-delta "linear attention" layers beside full-attention layers) keeps no K/V
for its linear layers. Each one carries, per request:
- a conv state `[conv_dim, kernel]`, as transformers keeps it: the last `kernel` inputs of the depthwise
  causal conv1d (the next token's left context; its first column is never read);
- a recurrent state `[heads, k_dim, v_dim]`: the gated delta rule's fast-weight matrix per value head.

The pool preallocates both for `num_slots` requests in float32 (`[slots, ...]` per layer), slot-indexed like
the KV slot pool (kv_pool.KVPool): a free list hands out the lowest free slot, and `allocate` ZEROES it, so a
request never starts from what an earlier owner left (the one place a slot is handed out and zeroed). A
slot is freed when its request finishes or is preempted. `snapshot` copies one slot's states out as a
StateCheckpoint (a prefix-cache checkpoint) and `restore` copies one back in.

Provenance: the pool notes what each slot holds as a StateOrigin (the request whose forward computed it, the
positions it covers and a digest of their key items), and every checkpoint carries the same for its
contents, so the state_provenance detector can check the state a request starts from against its own
prefix. A slot holding the zero state is what lets a request's first piece take transformers' "no previous
state" path (`holds_zero`); any other slot is read as the request's initial state. Under the
`state_slot_not_reset` fault `allocate` skips the zeroing, so a reused slot is read with its previous
owner's state.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch


def prefix_digest(items: Sequence) -> str:
    """16 hex digits of sha256 over the JSON of a request's key items of positions 0 .. n - 1
    (RequestState.cache_keys: token ids, or strings naming what fills a position): equal digests mean the
    same positions in the same order."""
    payload = [i if isinstance(i, str) else int(i) for i in items]
    return hashlib.sha256(json.dumps(payload, separators=(",", ":")).encode()).hexdigest()[:16]


EMPTY_PREFIX = prefix_digest(())  # what the zero state covers: no position


@dataclass(frozen=True)
class StateOrigin:
    """Where a state's contents came from.

    Attributes:
        writer: the request whose forward computed it ("": the zero state nobody wrote).
        covered: positions it covers (tokens; 0 for the zero state).
        prefix: prefix_digest of the writer's key items of those positions.
    """

    writer: str = ""
    covered: int = 0
    prefix: str = EMPTY_PREFIX

    @property
    def is_zero(self) -> bool:
        return not self.writer and self.covered == 0


@dataclass(frozen=True)
class StateShape:
    """The state geometry of a hybrid model.

    Attributes:
        linear_layers: indices of the model's linear-attention layers, in order.
        conv: one layer's conv state shape, (conv_dim, kernel).
        recurrent: one layer's recurrent state shape, (value heads, k_dim, v_dim).
    """

    linear_layers: tuple[int, ...]
    conv: tuple[int, int]
    recurrent: tuple[int, int, int]

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one request's states take over all linear layers (float32)."""
        conv = self.conv[0] * self.conv[1]
        rec = self.recurrent[0] * self.recurrent[1] * self.recurrent[2]
        return 4 * len(self.linear_layers) * (conv + rec)


def state_shape(config) -> StateShape | None:
    """The StateShape of a transformers config with linear-attention layers (`layer_types` holding
    "linear_attention": Qwen3.5's gated delta net), or None for a model without them."""
    types = getattr(config, "layer_types", None) or ()
    layers = tuple(i for i, t in enumerate(types) if t == "linear_attention")
    if not layers:
        return None
    key_dim = config.linear_key_head_dim * config.linear_num_key_heads
    value_dim = config.linear_value_head_dim * config.linear_num_value_heads
    return StateShape(layers, (2 * key_dim + value_dim, config.linear_conv_kernel_dim),
                      (config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim))


@dataclass(frozen=True)
class StateCheckpoint:
    """One request's recurrent state after its first `num_tokens` positions, copied out of its slot.

    Attributes:
        num_tokens: positions the state covers (a block boundary: k x block_size).
        conv: per linear layer (StateShape.linear_layers order) its conv state [conv_dim, kernel] float32.
        recurrent: per linear layer its recurrent state [heads, k_dim, v_dim] float32.
        writer: the request whose forward computed it ("": the zero state).
        covered: positions its contents cover (None: num_tokens); it differs from num_tokens only when a
            fault kept another state under this boundary (`relabeled`).
        prefix: prefix_digest of the key items of the positions its contents cover ("": not noted).
        publisher: the request that kept it at its boundary when that is not the writer ("": the writer).
    """

    num_tokens: int
    conv: tuple[torch.Tensor, ...]
    recurrent: tuple[torch.Tensor, ...]
    writer: str
    covered: int | None = None
    prefix: str = ""
    publisher: str = ""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.conv + self.recurrent)

    @property
    def origin(self) -> StateOrigin:
        """Where its contents came from (the writer, the positions they cover, their digest)."""
        return StateOrigin(self.writer, self.num_tokens if self.covered is None else self.covered, self.prefix)

    def relabeled(self, num_tokens: int, publisher: str) -> StateCheckpoint:
        """The same contents kept under another boundary (`num_tokens`) by `publisher`: what a fault that
        serves one block's state memory as another's checkpoint publishes. Its origin stays the contents'."""
        origin = self.origin
        return replace(self, num_tokens=num_tokens, covered=origin.covered, publisher=publisher)


class StatePool:
    """Conv and recurrent states for `num_slots` requests, per linear-attention layer (see module docstring).

    Args:
        shape: the model's StateShape.
        num_slots: requests whose states it holds at once (>= 1).
        device: where the tensors live (the model's device).

    Attributes:
        conv: layer index -> [slots, conv_dim, kernel] float32.
        recurrent: layer index -> [slots, heads, k_dim, v_dim] float32.
        owner: per slot its request id, None when free.
        held: per slot the StateOrigin of what it holds (the zero state at first).

    Raises:
        ValueError: num_slots < 1.
    """

    def __init__(self, shape: StateShape, num_slots: int, device: torch.device | str = "cpu") -> None:
        if num_slots < 1:
            raise ValueError(f"{num_slots = } must be >= 1")
        self.shape = shape
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.conv = {i: torch.zeros((num_slots, *shape.conv), dtype=torch.float32, device=self.device)
                     for i in shape.linear_layers}
        self.recurrent = {i: torch.zeros((num_slots, *shape.recurrent), dtype=torch.float32, device=self.device)
                          for i in shape.linear_layers}
        self.owner: list[str | None] = [None] * num_slots
        self.held: list[StateOrigin] = [StateOrigin()] * num_slots
        self._staged: dict[tuple[int, int], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    @property
    def num_free(self) -> int:
        return sum(o is None for o in self.owner)

    @property
    def num_used(self) -> int:
        return self.num_slots - self.num_free

    def allocate(self, owner: str, *, zero: bool = True) -> int:
        """The lowest free slot, now `owner`'s, its conv and recurrent states ZEROED in every layer: the one
        place a slot is handed out. zero=False (the state_slot_not_reset fault) skips the zeroing: the slot
        keeps what its previous owner left. Raises RuntimeError when none is free (callers check num_free)."""
        slot = next((s for s, o in enumerate(self.owner) if o is None), None)
        if slot is None:
            raise RuntimeError("no free state slot")
        self.owner[slot] = owner
        if zero:
            for i in self.shape.linear_layers:
                self.conv[i][slot].zero_()
                self.recurrent[i][slot].zero_()
            self.held[slot] = StateOrigin()
        return slot

    def holds_zero(self, slot: int) -> bool:
        """Whether `slot` holds the zero state (zeroed at allocation, nothing written since): a request's first
        piece there may take transformers' "no previous state" path; any other slot is read."""
        return self.held[slot].is_zero

    def zero_checkpoint(self, num_tokens: int, publisher: str = "") -> StateCheckpoint:
        """The zero state kept under boundary `num_tokens` (by `publisher`): what a read of a state nobody
        wrote finds."""
        layers = self.shape.linear_layers
        return StateCheckpoint(num_tokens, tuple(torch.zeros_like(self.conv[i][0]) for i in layers),
                               tuple(torch.zeros_like(self.recurrent[i][0]) for i in layers), "", 0, EMPTY_PREFIX,
                               publisher)

    def free(self, slot: int) -> None:
        """Give `slot` back (its tensors keep their values until the next allocate zeroes them)."""
        self.owner[slot] = None

    def snapshot(self, slot: int, num_tokens: int) -> StateCheckpoint:
        """A copy of `slot`'s states in every layer, covering `num_tokens` positions, written by the slot's owner
        (with the digest the pool noted, when the owner's forward wrote what it holds)."""
        layers = self.shape.linear_layers
        owner, held = self.owner[slot] or "", self.held[slot]
        noted = held.writer == owner and held.covered == num_tokens
        return StateCheckpoint(num_tokens, tuple(self.conv[i][slot].clone() for i in layers),
                               tuple(self.recurrent[i][slot].clone() for i in layers), owner,
                               prefix=held.prefix if noted else "")

    def restore(self, slot: int, checkpoint: StateCheckpoint) -> None:
        """Copy `checkpoint`'s states into `slot`, every layer; the slot now holds its origin."""
        for i, conv, rec in zip(self.shape.linear_layers, checkpoint.conv, checkpoint.recurrent):
            self.conv[i][slot].copy_(conv)
            self.recurrent[i][slot].copy_(rec)
        self.held[slot] = checkpoint.origin

    # -- checkpoints taken inside a forward, one layer at a time ------------------------------------
    def stage(self, slot: int, num_tokens: int, layer: int) -> None:
        """Inside a forward: copy layer `layer`'s states of `slot`, as they are after its first `num_tokens`
        positions (a block boundary the forward just reached), for take_staged to assemble."""
        self._staged.setdefault((slot, num_tokens), {})[layer] = (self.conv[layer][slot].clone(),
                                                                   self.recurrent[layer][slot].clone())

    def take_staged(self) -> dict[tuple[int, int], StateCheckpoint]:
        """The checkpoints staged since the last call, (slot, num_tokens) -> StateCheckpoint, those with every
        layer staged (a forward interrupted between layers leaves partial ones, dropped here)."""
        staged, self._staged = self._staged, {}
        layers = self.shape.linear_layers
        return {(slot, n): StateCheckpoint(n, tuple(parts[i][0] for i in layers), tuple(parts[i][1] for i in layers),
                                           self.owner[slot] or "")
                for (slot, n), parts in staged.items() if all(i in parts for i in layers)}
