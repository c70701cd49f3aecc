"""The engine's encoder side: what a request feeds the model besides its token ids, beside the KV cache.

Three kinds of model input sit outside the token-id path, and one interface serves them all:
- none: a text prompt, token ids only (TokenInputs with no rows to splice);
- rows spliced into the input embeddings at some prompt positions: prompt embeddings a client
  supplied, and an image's projected features at its placeholder positions (TokenInputs; images
  through an image encoder and its content-keyed cache, engine/image_side.py);
- cross-attention over an encoder's output (Whisper: engine/encoder.py, CrossAttentionInputs).

The engine picks the implementation once from the loaded model (`make_encoder_side` in engine.py, the
one place that reads the model's kind); the Scheduler owns it and calls it; it never calls back.

| verb | who calls | does |
|---|---|---|
| configure(faults) | Engine (start, set_faults) | takes the faults it acts on |
| problem(input) | Engine.submit | why a RequestInput cannot run on this model ("" when it can) |
| submit(request) | Engine.submit | notes an accepted request's input (RequestState.input) |
| admit(admitted) | Scheduler.admit | encoder work for newly admitted requests; returns modeled seconds |
| bind(chunks) | Scheduler.plan | each planned chunk with its spliced rows; TaintEntry per chunk reading another input's encoder output |
| adjust_logits(logits, generated) | Engine, before sampling | the model kind's own logits rules (Whisper's suppressed tokens) |
| finish(request_id) | Scheduler.finish | the request lets its encoder output go |
| report() | Engine, step report | the StepEvent's encoder fields |

Attributes every implementation has: `model_kind` (a kvtui.model_kinds.ModelKind: which
faults act on the engine), `runner` (the ModelRunner the engine forwards through).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import torch

from kvtui.engine.fault_acts import FaultActs
from kvtui.model_kinds import ModelKind

if TYPE_CHECKING:
    from kvtui.engine.inputs import RequestInput
    from kvtui.engine.request import RequestState


class EncoderSide(Protocol):
    """The verbs every encoder side offers (see the module docstring for who calls each)."""

    model_kind: ModelKind

    def configure(self, faults: frozenset[str]) -> None:
        """Take the faults this side acts on from the next step."""

    def problem(self, inp: RequestInput) -> str:
        """Why `inp` cannot run on this model ("" when it can); one line naming what to change."""

    def submit(self, request: RequestState) -> None:
        """Note an accepted request (its RequestState.input); may add to its cache_salt what its prefix-cache
        keys must cover."""

    def admit(self, admitted: list[RequestState]) -> float:
        """Encoder work for the requests the scheduler just admitted; returns the modeled seconds it
        took (the virtual clock's share; 0.0 without encoder work)."""

    def bind(self, chunks: tuple) -> tuple[tuple, tuple]:
        """The planned chunks with their spliced rows set, and a TaintEntry per chunk that reads another
        input's encoder output (the slot_taint detector's encoder part)."""

    def adjust_logits(self, logits: torch.Tensor, generated: int) -> torch.Tensor:
        """`logits` [V] after the model kind's own rules, for a request that has generated `generated` tokens."""

    def finish(self, request_id: str) -> None:
        """The request is done: its hold on encoder outputs ends (they stay cached while there is room)."""

    def report(self) -> dict:
        """StepEvent fields (encoder cache occupancy and hits); {} without an encoder cache."""


class TokenInputs:
    """Decoder-only models: token ids, and rows spliced into the input embeddings where a request
    supplies them (prompt embeddings, RequestInput.embeds).

    Args:
        hidden_size: the model's input embedding width (a supplied row must have it); None: not checked
            (a bare scheduler in tests).
        kind: its `model_kind` when not the class's (HYBRID for a hybrid's token inputs: which faults act on
            the engine); None: DECODER_ONLY.
    """

    model_kind = ModelKind.DECODER_ONLY

    def __init__(self, hidden_size: int | None = None, kind: ModelKind | None = None) -> None:
        if kind is not None:
            self.model_kind = kind
        self.hidden_size = hidden_size
        self.faults: frozenset[str] = frozenset()
        self.acts = FaultActs()  # where the faults act (the engine hands its notebook in)

    def configure(self, faults: frozenset[str]) -> None:
        self.faults = faults

    def problem(self, inp: RequestInput) -> str:
        if inp.audio is not None:
            return "audio given to a decoder-only model; use a speech model (--model whisper-tiny.en)"
        if inp.images:
            return "images given to a model without an image encoder; use --model dinov2-smollm2"
        if inp.embeds is not None and self.hidden_size is not None and inp.embeds.rows.shape[1] != self.hidden_size:
            return (f"prompt_embeds rows have {inp.embeds.rows.shape[1]} values; this model's embeddings have "
                    f"{self.hidden_size}")
        return ""

    def submit(self, request: RequestState) -> None:
        return None

    def admit(self, admitted: list[RequestState]) -> float:
        return 0.0

    def bind(self, chunks):
        return tuple(self._spliced(c) for c in chunks), ()

    def _spliced(self, chunk):
        """`chunk` (a scheduler.ScheduledChunk) with the supplied rows of the prompt positions it feeds (none: as it is)."""
        embeds = chunk.request.input.embeds
        if embeds is None:
            return chunk
        end = min(chunk.end_pos, chunk.request.prompt_len)
        offsets = [p - chunk.start_pos for p in embeds.supplied_positions if chunk.start_pos <= p < end]
        if not offsets:
            return chunk
        rows = embeds.rows[[chunk.start_pos + o for o in offsets]]
        return replace(chunk, spliced=(tuple(offsets), rows))

    def adjust_logits(self, logits: torch.Tensor, generated: int) -> torch.Tensor:
        return logits

    def finish(self, request_id: str) -> None:
        return None

    def report(self) -> dict:
        return {}
