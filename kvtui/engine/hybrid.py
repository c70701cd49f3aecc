"""The forward of a hybrid model (gated-delta "linear attention" layers beside attention layers) in the engine.

HybridRunner runs transformers' own decoder-layer modules (Qwen3.5 MoE: `Qwen3_5MoeDecoderLayer`, whose
mixer is `Qwen3_5MoeGatedDeltaNet` or `Qwen3_5MoeAttention`), layer by layer, with kvtui's PooledCache:

- an attention layer runs the whole batch (padded or packed) through the pooled KV path, as any model;
- a linear-attention layer runs once per request chunk (segment) with exactly that chunk's tokens, as a
  batch of one: no pad token reaches its causal conv or its delta rule, and no other request's tokens
  do, so a batched request computes what it computes alone. The chunk's state slot is bound to the cache
  (PooledCache.bind_state); the layer reads the state its previous chunk left and writes the new one. A
  request's first piece starts from nothing (transformers' "no previous state" path) only where its slot
  holds the zero state (StatePool.holds_zero: zeroed at allocation); a slot holding anything else is read
  as its initial state, which is how the state_slot_not_reset fault's unzeroed slot reaches the request.
  With checkpoints on (paged KV with prefix caching), a chunk that crosses block boundaries runs in pieces
  cut at them and the pool stages each layer's state at every boundary (StatePool.stage), which the state
  side then publishes as checkpoints (state_side.RecurrentState.update_from_output).

kvtui's fused forward runs Llama-family models only, so a hybrid always runs these modules (as with
--enforce-eager), and the batch-invariant mode is refused.
"""

from __future__ import annotations

import torch

from kvtui.engine.attention import PooledCache, StepInterrupted, StepState
from kvtui.engine.batching import BatchTensors, Segment
from kvtui.engine.kv_pool import KVPool
from kvtui.engine.runner import ModelRunner
from kvtui.engine.state_pool import StatePool

FORWARD_NOTE = ("runs transformers' own modules (kvtui's fused forward is Llama-only), its linear-attention layers "
                "once per request chunk")


class HybridRunner(ModelRunner):
    """ModelRunner for a hybrid model (see the module docstring).

    Args:
        model: a transformers causal LM whose body has `layers`, `rotary_emb`, `norm` and `config.layer_types`
            ("linear_attention" or "full_attention" per layer), e.g. Qwen3_5MoeForCausalLM.
        pool: the KV pool of its attention layers (pool.num_layers = attention layers).
        states: the StatePool of its linear-attention layers.
        checkpoint_every: block_size when checkpoints are kept at block boundaries (paged KV with prefix
            caching), else None.
        batch_invariant: refused (ModelRunner raises ValueError: the mode needs the fused forward).
    """

    def __init__(self, model, pool: KVPool, states: StatePool, *, checkpoint_every: int | None = None,
                 batch_invariant: bool = False) -> None:
        super().__init__(model, pool, enforce_eager=True, batch_invariant=batch_invariant)
        self.states = states
        self.cache = PooledCache(pool, states)
        self.linear_layers = frozenset(states.shape.linear_layers)
        self.checkpoint_every = checkpoint_every
        self._zero: dict[int, bool] = {}  # state slot -> it held the zero state when this step began

    def _run_body(self, batch: BatchTensors, state: StepState, *, bind: bool = True, lora=None) -> torch.Tensor:
        """The body layer by layer (attention layers batched, linear layers per chunk); [S, V] float32 logits."""
        if bind:
            self.cache.state = state
        self.states.take_staged()  # what an interrupted step staged is not this step's
        body = self.body
        # a request's first piece starts from nothing only where its slot holds the zero state; any other slot
        # is read as its initial state (what the slot holds, which allocation zeroed unless a fault kept it)
        self._zero = {seg.state_slot: self.states.holds_zero(seg.state_slot) for seg in batch.segments}
        hidden = self.input_embeds(batch)
        position_embeddings = body.rotary_emb(hidden, batch.position_ids)
        mask = batch.additive_mask(self.dtype).to(self.device)
        for index, layer in enumerate(body.layers):
            if index in self.linear_layers:
                hidden = self._per_chunk(index, layer, hidden, batch.segments, position_embeddings)
            else:
                hidden = layer(hidden, position_embeddings=position_embeddings, attention_mask=mask,
                               position_ids=batch.position_ids, cache=self.cache)
        hidden = body.norm(hidden)[batch.sample_row, batch.sample_col]  # [S, hidden]
        return self.head(hidden).float().cpu()

    def _per_chunk(self, index: int, layer, hidden: torch.Tensor, segments: tuple[Segment, ...],
                   position_embeddings) -> torch.Tensor:
        """Layer `index` (a linear-attention decoder layer) over each segment's own tokens, piece by piece
        (_pieces); pad cells keep their input. Returns the new [R, Q, hidden]."""
        if self.cache.interrupt.is_set():
            raise StepInterrupted(f"the step was interrupted at layer {index}")
        out = hidden.clone()
        for seg in segments:
            for start, end in self._pieces(seg):
                cols = slice(seg.q_start + start - seg.start_pos, seg.q_start + end - seg.start_pos)
                self.cache.bind_state(seg.state_slot, fresh=start == 0 and self._zero[seg.state_slot])
                out[seg.row, cols] = layer(hidden[seg.row : seg.row + 1, cols], position_embeddings=position_embeddings,
                                           attention_mask=None, cache=self.cache)[0]
                if self.checkpoint_every and end % self.checkpoint_every == 0:
                    self.states.stage(seg.state_slot, end, index)
        self.cache.bind_state(None, fresh=True)
        return out

    def _pieces(self, seg: Segment) -> list[tuple[int, int]]:
        """The segment's positions [start_pos, end_pos) as (start, end) pieces: one, or with checkpoints on,
        cut at every block boundary inside it."""
        every = self.checkpoint_every
        if not every:
            return [(seg.start_pos, seg.end_pos)]
        cuts = [seg.start_pos] + list(range((seg.start_pos // every + 1) * every, seg.end_pos, every)) + [seg.end_pos]
        return list(zip(cuts[:-1], cuts[1:]))
