"""The intake: the one place a PlannedRequest (kvtui/request.py) becomes a request of kvtui's engine.

- `Intake.request_input`: the InputSpec as the engine's RequestInput (kvtui/engine/inputs.py): token ids;
  an embeddings prompt's rows from the engine's embedding table; an audio clip read once (AudioFiles);
  an image prompt's parts; a served upload as given; and the request's LoRA adapter attached (the
  version loaded now).
- `Intake.submit`: the engine submit. One request's bad input (an adapter unloaded meanwhile, a value
  no check caught) is `Refused` alone, so its client gets an answer and every other request goes on.
- rounds' `cancel_after`: `cancel_due` aborts a request once it has that many generated tokens.
- the thread-safe queue kvtui serve feeds (`put`, `abort`, `call`), drained in order by the engine
  thread at a step boundary (`drain`).

It returns what it admitted (`Admitted`: the planned request, sequence 0's RequestState, the ids its
sequences run under) or refused, and never calls the run loop back: the Session emits the arrive
events and informs its detectors. This module imports the engine; only the local Session imports it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace

import torch

from kvtui.engine.inputs import RequestInput
from kvtui.engine.lora import AdapterGone, AdapterRegistry, lora_problem
from kvtui.request import AudioClip, EmbedsPrompt, GivenInput, ImagePrompt, PlannedRequest, TokenPrompt


@dataclass(frozen=True)
class Admitted:
    """A request the engine took (a rejection included: the engine reports it finished at its next step).

    Attributes:
        planned: the PlannedRequest submitted.
        state: its RequestState (sequence 0's for n > 1); `state.sampling` is what it runs under (the
            engine may cap max_new_tokens) and `state.input` what it feeds the model.
        sequence_ids: the ids it runs under: (request_id,), or its n sequences' for n > 1.
    """

    planned: PlannedRequest
    state: object
    sequence_ids: tuple[str, ...]


@dataclass(frozen=True)
class Refused:
    """A request whose submit failed: it never reached the engine and finishes alone with `error`.

    Attributes:
        planned: the PlannedRequest.
        detail: one line on why; code: the Finish code ("model_not_found" for an adapter unloaded
            meanwhile, else "internal_error").
    """

    planned: PlannedRequest
    detail: str
    code: str


def load_adapters(loaded, names, *, enforce_eager: bool, batch_invariant: bool) -> AdapterRegistry:
    """The LoRA adapters requests may name (engine/lora.py AdapterRegistry) with `names` loaded.

    Raises:
        ValueError: one line when this engine cannot run adapters (its model, --enforce-eager, the
            batch-invariant mode), rather than rejecting every adapter request.
    """
    registry = AdapterRegistry(loaded.model, loaded.model_id)
    names = tuple(names or ())
    problem = names and lora_problem(loaded.model, enforce_eager=enforce_eager, batch_invariant=batch_invariant)
    if problem:
        raise ValueError(problem)
    for name in names:
        registry.load(name)
    return registry


def embeds_input(spec: EmbedsPrompt, embed: Callable[[list[int]], torch.Tensor]) -> RequestInput:
    """An embeddings prompt's RequestInput: rows [T, hidden] from `embed(ids)` (the model's own input
    embeddings, float32), zero at the positions that stay token ids, as vLLM's renderer leaves them;
    `mask_pairs`' second request: the first's tensor (the rows of `rows_of`, zero where the first had
    token ids) under its own mask. A mask with no token position gives a whole-embeddings input (no mask)."""
    mask = torch.tensor(spec.mask, dtype=torch.bool)
    rows = embed(list(spec.rows_of if spec.rows_of is not None else spec.ids))
    if spec.rows_of is None:
        rows = rows.masked_fill(mask[:, None], 0.0)
    else:
        first = torch.tensor([a == b for a, b in zip(spec.rows_of, spec.ids)], dtype=torch.bool)
        rows = rows.masked_fill(first[:, None], 0.0)
    return RequestInput.from_embeds(rows, list(spec.ids), mask if bool(mask.any()) else None)


class Intake:
    """Turns planned requests into engine requests, for one engine.

    Args:
        engine: the kvtui.engine.Engine requests go to.
        adapters: the AdapterRegistry a request's `adapter` is looked up in (at submit: the version
            loaded then).
        feature_extractor: a speech model's (Whisper's) feature extractor, for audio clips; None for
            other models (an audio clip then fails its submit alone).
    """

    def __init__(self, engine, adapters: AdapterRegistry, feature_extractor=None) -> None:
        self.engine, self.adapters, self.feature_extractor = engine, adapters, feature_extractor
        self._audio_files = None  # AudioFiles, made at the first clip
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # PlannedRequest, a request id to abort, (fn, future)
        self.ready = threading.Event()  # set while the queue may hold something
        self._cancel_at: dict[str, int] = {}  # rounds' cancel: request id -> generated tokens at which it is cut

    # -- one request ----------------------------------------------------------------------------
    def request_input(self, planned: PlannedRequest) -> RequestInput:
        """`planned`'s RequestInput under its LoRA adapter.

        Raises:
            AdapterGone: its adapter is not loaded; OSError, ValueError: its clip cannot be read, or a
            value the RequestInput refuses.
        """
        return self._with_adapter(planned, self._input_of(planned.input))

    def _input_of(self, spec) -> RequestInput:
        if isinstance(spec, TokenPrompt):
            return RequestInput(spec.ids)
        if isinstance(spec, EmbedsPrompt):
            return embeds_input(spec, self.engine.token_embeddings)
        if isinstance(spec, AudioClip):
            return RequestInput(spec.ids, audio=self._audio_file(spec.path))
        if isinstance(spec, ImagePrompt):
            return RequestInput(spec.ids, images=spec.images)
        if isinstance(spec, GivenInput):
            return spec.request_input
        raise TypeError(f"not an InputSpec: {type(spec).__name__}")

    def _audio_file(self, path: str):
        """The AudioInput of a WAV clip, read once (the AudioFiles cache)."""
        if self._audio_files is None:
            from kvtui.engine.encoder_cache import AudioFiles

            self._audio_files = AudioFiles(self.feature_extractor)
        return self._audio_files.get(path)

    def _with_adapter(self, planned: PlannedRequest, request_input: RequestInput) -> RequestInput:
        if planned.adapter is None:
            return request_input
        adapter = self.adapters.get(planned.adapter)
        if adapter is None:
            raise AdapterGone(f"The model `{planned.adapter}` does not exist.")
        return replace(request_input, lora=adapter)

    def submit(self, planned: PlannedRequest) -> Admitted | Refused:
        """Submit `planned` to the engine at its arrival_s. A submit that raises (a duplicate id, an adapter
        unloaded between the HTTP side's check and now, a clip that cannot be read) is Refused, never raised."""
        try:
            state = self.engine.submit(planned.request_id, self.request_input(planned), planned.sampling,
                                       arrival_s=planned.arrival_s, tenant=planned.tenant,
                                       cache_salt=planned.cache_salt)
        except Exception as e:
            gone = isinstance(e, AdapterGone)
            return Refused(planned, str(e) if gone else f"submit failed: {type(e).__name__}: {e}",
                           "model_not_found" if gone else "internal_error")
        if planned.cancel_after is not None:
            self._cancel_at[planned.request_id] = planned.cancel_after
        return Admitted(planned, state, tuple(self.engine.sequence_ids(planned.request_id)))

    def cancel_due(self) -> None:
        """Rounds' `cancel`: abort each request whose client cancels it once it has `cancel_after` generated
        tokens, as a client disconnecting from `kvtui serve` does (it finishes `abort`)."""
        requests = self.engine.requests
        for request_id, at in list(self._cancel_at.items()):
            live = [requests[i] for i in self.engine.sequence_ids(request_id) if i in requests]
            if not live:
                del self._cancel_at[request_id]
            elif max(len(r.generated_ids) for r in live) >= at:
                del self._cancel_at[request_id]
                self.engine.abort(request_id)

    # -- the thread-safe queue (kvtui serve) ------------------------------------------------------
    def put(self, planned: PlannedRequest) -> None:
        """Thread-safe: submit `planned` (its arrival_s: when it arrived on the engine clock) at the next drain."""
        self._queue.put(planned)
        self.ready.set()

    def abort(self, request_id: str) -> None:
        """Thread-safe: abort `request_id` at the next drain (nothing if it already left)."""
        self._queue.put(request_id)
        self.ready.set()

    def call(self, fn: Callable[[], object]) -> Future:
        """Thread-safe: call `fn()` at the next drain, in order with what was queued before and after it.
        Returns a concurrent.futures.Future with its result or exception."""
        future: Future = Future()
        self._queue.put((fn, future))
        self.ready.set()
        return future

    def drain(self) -> list[Admitted | Refused]:
        """Engine thread: everything queued, in order (submits, aborts, calls); returns the submits' outcomes
        in that order."""
        self.ready.clear()
        out: list[Admitted | Refused] = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return out
            if isinstance(item, tuple):
                _call(*item)
            elif isinstance(item, str):
                if any(i in self.engine.requests for i in self.engine.sequence_ids(item)):  # n > 1: its sequences
                    self.engine.abort(item)
            else:
                out.append(self.submit(item))


def _call(fn, future: Future) -> None:
    """Run a queued call: its result or exception goes to its future (never into the step loop)."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except Exception as e:
        future.set_exception(e)
