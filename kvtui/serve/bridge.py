"""Between the HTTP handlers (asyncio, uvicorn's thread) and the thread that steps the session.

In: a handler calls `EngineBridge.submit`; the request goes to the session's thread-safe external
queue and is submitted at the start of the next step. Out: the bridge listens to the session's typed
events in the engine thread and hands each request's news to the handler's asyncio queue with
`loop.call_soon_threadsafe`: a `TokenOut` per sampled token (from the step event), then the request's
`Finish` event, or `Closed` when the session closed before the request ever reached the engine. A
request admitted with part of its prompt from the prefix cache (paged KV) has the hit's tokens set on
its stream (`cached_tokens`) before its first token is queued.

Parallel sampling (`n > 1`): the engine runs the request as n sequences `f"{i}_{request_id}"`; the
bridge routes all of them to the request's one stream, each TokenOut with its sequence's `index`, each
sequence's own Finish (`RequestStream.index_of` tells its index), and the stream is done after n.

Requests are routed by kvtui's own ids (`chatcmpl-<n>-<hex>`, made by the server), never by an id the
client sent, so two clients that send one `x-request-id` each get their own answer. The fault
request_id_keyed (kvtui/faults.py; `kvtui serve --fault request_id_keyed`) breaks exactly that, as a
server that keys its map of waiting clients by the client's id does: a request registers its stream under
its client's x-request-id, a later request with the same id replaces the entry, and a request's first
output claims whatever stream the entry holds then. Of two overlapping requests A and B with one id, A's
answer goes to B's client (as B's own), B's answer to nobody, and A's client waits for ever.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, replace

from kvtui.events import Finish, StepEvent, Summary


@dataclass(frozen=True)
class TokenOut:
    """One sampled token of a request: its id and, when asked for, (token id, logprob) pairs (the
    sampled token first, then the top k)."""

    token_id: int
    logprobs: tuple[tuple[int, float], ...] | None = None
    index: int = 0  # parallel sampling: the choice (sequence) it belongs to


@dataclass(frozen=True)
class Closed:
    """The session closed (server stopping, dashboard restart) before the request was submitted."""


class RequestStream:
    """One request's inbox, read by its handler on the event loop `loop`."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, n: int = 1,
                 client_key: str | None = None) -> None:
        from kvtui.engine.parallel import child_id

        self.request_id = request_id
        self.client_key = client_key  # the client's x-request-id (routed by only under request_id_keyed)
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cached_tokens: int | None = None  # prompt tokens from the prefix cache; None: no prefix cache
        self.n = n
        # the engine ids of its sequences -> choice index (n > 1: vLLM's child ids f"{i}_{request_id}")
        self.indices = {request_id: 0} if n == 1 else {child_id(request_id, i): i for i in range(n)}

    def index_of(self, request_id: str) -> int:
        """The choice index of one of its sequences' engine ids."""
        return self.indices[request_id]

    def sequence_id(self, index: int) -> str:
        """The engine id of its sequence `index` (the inverse of index_of; its first sequence's for an
        index it does not have)."""
        return next((rid for rid, i in self.indices.items() if i == index), next(iter(self.indices)))

    def own_index(self, index: int) -> int:
        """`index` if it is one of its choices, else 0 (another request's output delivered to it)."""
        return index if index < self.n else 0

    def put(self, item) -> None:
        """From any thread: queue `item` for the handler."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop closed: nobody is listening any more
            pass


class NotAccepting(Exception):
    """The bridge takes no requests: no session yet (loading) or the server is stopping."""


class EngineBridge:
    """Routes requests into the current session and their tokens back out.

    `on_event` must be one of the session's listeners (it runs in the engine thread).
    """

    def __init__(self, faults: tuple[str, ...] = ()) -> None:
        from kvtui.faults import FaultName

        self._lock = threading.Lock()
        self.session = None
        self.accepting = False
        self.streams: dict[str, RequestStream] = {}  # engine id -> the stream of the request it belongs to
        # request_id_keyed: the client's x-request-id -> the stream registered last under it, and each
        # request (its stream's request_id) -> the stream its output goes to, claimed at its first output
        self.keyed = FaultName.REQUEST_ID_KEYED in faults
        self._by_client: dict[str, RequestStream] = {}
        self._claimed: dict[str, RequestStream | None] = {}

    def attach(self, session) -> None:
        """Serve through `session` (a serving Session whose listeners include `on_event`)."""
        with self._lock:
            self.session, self.accepting = session, True

    def close_intake(self) -> None:
        """Take no new requests (shutdown begins)."""
        with self._lock:
            self.accepting = False

    def submit(self, planned, *, client_key: str | None = None) -> RequestStream:
        """Queue a request for the next engine step; its arrival is now on the engine clock.

        Args:
            planned: the request (a kvtui.request.PlannedRequest: its id, input, sampling, text and
                canary, tenant, cache_salt, adapter); its arrival_s is replaced by the engine clock's now.
            client_key: the id the client sent (its x-request-id), None without one; only the fault
                request_id_keyed routes by it.

        Raises:
            NotAccepting: loading or stopping.
        """
        request_id = planned.request_id
        stream = RequestStream(request_id, asyncio.get_running_loop(), n=planned.sampling.n, client_key=client_key)
        with self._lock:
            if not self.accepting or self.session is None:
                raise NotAccepting()
            for sequence_id in stream.indices:
                self.streams[sequence_id] = stream
            if self.keyed and client_key:
                self._by_client[client_key] = stream  # a later request with this id takes the entry over
            if self.session.config.kv == "paged" and self.session.config.prefix_caching:
                stream.cached_tokens = 0
            self.session.intake.put(replace(planned, arrival_s=self.session.engine.now()))
        return stream

    def call_in_engine(self, fn):
        """From any thread: `fn(session)` in the engine thread at the next step boundary, in order with the
        requests submitted before and after (kvtui/serve/lora.py installs adapters so). Returns a
        concurrent.futures.Future of its result.

        Raises:
            NotAccepting: loading or stopping.
        """
        with self._lock:
            session = self.session
            if not self.accepting or session is None:
                raise NotAccepting()
            return session.intake.call(lambda: fn(session))

    def precompile(self, spec) -> None:
        """Compile a structured-output grammar (kvtui.engine.request.StructuredOutputs) into the engine's
        cache from the calling thread (a tokenizing worker), so the engine's step does not wait for it.

        Raises:
            ValueError: the grammar does not compile (the library's reason).
            NotAccepting: no session (loading or stopping).
        """
        session = self.session
        if session is None:
            raise NotAccepting()
        session.engine.output.grammar.compile(spec)

    def abort(self, request_id: str) -> None:
        """Abort a request whose client went away (any thread; nothing if it already finished)."""
        with self._lock:
            stream = next((s for s in self.streams.values() if s.request_id == request_id), None)
            if stream is not None and self.session is not None:
                self.session.intake.abort(request_id)

    def in_flight(self) -> int:
        """Requests submitted and not yet finished (one per request, whatever its n)."""
        return len({id(s) for s in self.streams.values()})

    def _route(self, owner: RequestStream | None) -> RequestStream | None:
        """The stream a request's output goes to: its own; under request_id_keyed, the stream its client's
        id held when the request's first output came (claimed once; None when another request had
        claimed it first: the output goes to nobody). Call with the lock held."""
        if owner is None or not self.keyed or not owner.client_key:
            return owner
        if owner.request_id not in self._claimed:
            self._claimed[owner.request_id] = self._by_client.pop(owner.client_key, None)
        return self._claimed[owner.request_id]

    def on_event(self, event) -> None:
        """Session listener (engine thread): route tokens and finishes to their handlers."""
        if isinstance(event, StepEvent):
            for hit in event.prefix_hits:  # admitted this step: before its first token is queued
                stream = self.streams.get(hit.request_id)
                if stream is not None and not stream.cached_tokens:
                    stream.cached_tokens = hit.hit_tokens
            for r in event.running:
                owner = self.streams.get(r.request_id) if r.token_id is not None else None
                with self._lock:
                    stream = self._route(owner)
                if stream is not None:
                    stream.put(TokenOut(r.token_id, r.logprobs, stream.own_index(owner.index_of(r.request_id))))
        elif isinstance(event, Finish):
            with self._lock:
                owner = self.streams.pop(event.request_id, None)
                stream = self._route(owner)
                if owner is not None and owner.request_id in self._claimed and not any(
                        s is owner for s in self.streams.values()):
                    del self._claimed[owner.request_id]  # every sequence of it finished
            if stream is not None and stream is not owner:  # delivered as the other request's own
                event = event.model_copy(update={"request_id": stream.sequence_id(owner.index_of(event.request_id))})
            if stream is not None:
                stream.put(event)
        elif isinstance(event, Summary):  # the session closed: whatever it never took is answered now
            with self._lock:
                left, self.streams, self.accepting = self.streams, {}, False
                self._by_client.clear()
                self._claimed.clear()
            for stream in {id(s): s for s in left.values()}.values():
                stream.put(Closed())
