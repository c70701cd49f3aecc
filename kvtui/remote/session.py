"""`kvtui run --target URL`: a scenario's arrivals as real concurrent HTTP requests to a server.

The scenario is planned as for a local run (same seed, same prompts, same lengths; only the tokenizer of
the scenario's model is loaded). Each planned request is sent at its arrival time on the wall clock
(asyncio + httpx, streaming), at most `max_concurrency` at a time, each with its own timeout and no
retry. Events are the local run's (kvtui.events): Header (with `target`), Arrive, FirstToken, Finish,
Contamination, Marker, Summary, plus ServerSample for what the server exposes. All times are seconds
since the run started, measured on the client (time.perf_counter). A recording replays with
`kvtui replay` like a local one.

Detectors: `canary` reads each streamed answer once it has ended (kvtui.detect.CanaryDetector); `reference`
sends each completed greedy request again alone after the load (kvtui.remote.solo_check), past the
server's prefix cache (a fresh `cache_salt`, or `cache_prompt: false` to llama.cpp), and counts a solo
run as checked only when the server did not say it took prompt tokens from its cache.

A scenario with `request_ids` makes each client send an id of its own choosing (kvtui/remote/request_ids.py):
every request then waits at most `request_ids.wait_s`, and after the load come the audit's probes and
GET /health, its findings (hung, lost, stopped_serving) and its one summary line; the reference checks
are skipped when the server stopped serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import httpx

from kvtui.events import (
    FirstToken,
    Header,
    Marker,
    ModelInfo,
    SkipReason,
    Summary,
)
from kvtui.metrics import SLO
from kvtui.remote.embeds import chat_parts, check_expressible, completion_embeds, embedding_table, is_whole
from kvtui.remote.fidelity import FidelityMeter
from kvtui.remote.openai import StreamResult, request_body, stream_request
from kvtui.remote.options import TargetOptions
from kvtui.remote.reach import TargetError as TargetError  # re-exported: the run's one error for its callers
from kvtui.remote.reach import first_model, probe
from kvtui.remote.request_ids import RequestIdAudit, id_fields, id_headers
from kvtui.remote.server_probe import ServerProbe
from kvtui.remote.solo_check import reference_event, uncached
from kvtui.remote.transcription import is_audio, transcribe_request, transcription_form
from kvtui.remote.wire import WirePool
from kvtui.remote.wire import usable as wire_usable
from kvtui.request import EmbedsPrompt, TokenPrompt
from kvtui.run.base import RunBase
from kvtui.run.build import arrive_event, finish_event, run_header
from kvtui.run.observers import Arrival, Finished, Observer, build_observers
from kvtui.run.sink import Listener, RunSink

TARGET_DETECTORS = ("reference", "canary")
MEASURED = ("every time: seconds since the run started, on the client's wall clock (time.perf_counter)",)
FINISH_REASONS = ("stop", "length", "abort", "error")


class _ClientCancel(Exception):
    """Raised from a stream's chunk callback to cut a request the scenario cancels (rounds' `cancel`)."""


# what /v1/models' `owned_by` says of the server
SERVER_KINDS = {"llamacpp": "llama.cpp", "vllm": "vLLM", "sglang": "SGLang", "kvtui": "kvtui"}


class TargetSession(RunBase):
    """One run of a scenario against a target server.

    Args:
        scenario: a kvtui.scenario.Scenario.
        tokenizer: the scenario model's tokenizer (kvtui.models.load_tokenizer), for planning.
        options: TargetOptions.
        record_path: JSONL recording to write, or None.
        detectors: some of TARGET_DETECTORS.
        listeners: callables receiving every typed event (e.g. the dashboard).
        planned: the requests to send instead of the scenario's plan (the noninterference audit).
        clock: the time source (seconds; time.perf_counter); tests pass a fake one.

    Raises:
        ValueError: an unknown detector, or a max_concurrency/timeout below 1 / 0.
        OSError: the recording cannot be created.
    """

    def __init__(self, scenario, tokenizer, options: TargetOptions, *, record_path=None,
                 detectors: tuple[str, ...] = TARGET_DETECTORS, listeners: tuple[Listener, ...] = (),
                 planned: list | None = None, clock: Callable[[], float] = time.perf_counter,
                 model: str | None = None) -> None:
        from kvtui.scenario import plan_requests

        unknown = sorted(set(detectors) - set(TARGET_DETECTORS))
        if unknown:
            raise ValueError(f"detector {unknown[0]!r} needs the engine's internals; against a target use "
                             f"{', '.join(TARGET_DETECTORS)}")
        if options.max_concurrency < 1 or options.timeout_s <= 0:
            raise ValueError("--max-concurrency must be >= 1 and --timeout > 0")
        self.scenario, self.tokenizer, self.options, self.detectors = scenario, tokenizer, options, tuple(detectors)
        plan = planned if planned is not None else plan_requests(scenario, tokenizer, sessions=True)
        # a session's later turns wait for the answer before them (and a think time): (session, turn) -> request
        self.later_turns = {(p.turn.session, p.turn.turn): p for p in plan if p.turn is not None and p.turn.turn}
        self.pending = sorted((p for p in plan if p.turn is None or not p.turn.turn),
                              key=lambda p: (p.arrival_s, p.request_id))
        self.planned = {p.request_id: p for p in plan}
        self.api = options.api if options.api != "auto" else (
            "transcription" if self.pending and all(is_audio(p) for p in self.pending) else
            "chat" if self.later_turns or all(p.text is not None for p in self.pending) else "completions")
        if self.later_turns and self.api != "chat":
            raise ValueError(f"sessions send each later turn as a chat with the answers before it; --api {self.api} "
                             "cannot carry one: use --api chat (or auto)")
        self.embeds_table = None  # the scenario model's input embedding table, for prompts sent as rows
        self._embeds: dict[str, object] = {}  # request id -> its prompt_embeds (the load and the solo run alike)
        if any(p.images for p in self.pending):
            raise ValueError("prompts kind image_passphrase cannot be sent to a --target yet: kvtui's client sends "
                             "no image parts; run it locally (--model dinov2-smollm2), or serve that model with "
                             "`kvtui serve` and send image_url parts (docs/serve.md, Images)")
        if any(isinstance(p.input, EmbedsPrompt) for p in self.pending):
            self.api = self._embeds_api(options.api)
            self.embeds_table = embedding_table(model or scenario.model)
        # what watches the load from outside (the canary); `reference` is the solo reruns after it
        self.observers: list[Observer] = build_observers(self.detectors, target=True)
        self.sink = RunSink(SLO(scenario.slo.ttft_s, scenario.slo.tpot_s), clock=self.now, record_path=record_path,
                            listeners=listeners, background_sync=True)
        self.warnings = timeline_warnings(scenario)
        self.id_audit = None  # the request-id audit (a scenario's request_ids), when the plan carries client ids
        if scenario.request_ids is not None and any(p.client_id is not None for p in self.pending):
            if self.api == "transcription":
                raise ValueError("request_ids: clients' request ids go with chat and completions requests; an audio "
                                 "scenario's uploads carry none: drop the section, or use text prompts")
            self.id_audit = RequestIdAudit(scenario.request_ids, scenario.seed, self.pending)
            self.warnings += overlap_warnings(self.pending)
        self.spans: dict[str, tuple[float, float]] = {}  # request id -> (sent, ended), for the request-id audit
        self.timeline = [e for e in scenario.timeline if e.marker]
        self.fault_history: list = []  # a target's faults are its own: none known to the client
        self.results: dict[str, StreamResult] = {}
        self.in_flight: dict[str, str] = {}  # request id -> a text unique to it (slot attribution)
        self.served_model: str | None = options.served_model
        self.server_kind: str | None = None  # SERVER_KINDS' values, from /v1/models' owned_by
        self.stop_requested = False
        self.held_s, self._held_since = 0.0, None  # arrivals held (seconds so far, since when)
        self._round, self._round_start = None, 0.0  # `process: rounds`: the round sent last, and when
        self.summary: Summary | None = None
        self._load_client = None  # what the load's requests go out on: a WirePool, or the httpx client
        self.fidelity = FidelityMeter(self.now)  # planned vs actual send times (kvtui/remote/fidelity.py)
        self.fidelity.max_concurrency = options.max_concurrency
        self.load_fidelity = None  # the LoadFidelity at the load's end
        self._fidelity_emitted = (-1.0, -1)  # the last live LoadFidelity: when, and at how many sends
        self.reference_checked = 0
        self.reference_cached = self.reference_uncached_verified = 0
        self.solo_results: dict[str, StreamResult] = {}  # the compared solo runs, by request id
        self.reference_skips: Counter = Counter()  # SkipReason -> requests left unchecked
        self._header: Header | None = None
        self._clock = clock
        self._t0 = clock()

    def _embeds_api(self, asked: str) -> str:
        """The API of a plan sent as embedding rows: completions when every position is a row, chat for a
        mixed mask (kvtui/remote/embeds.py).

        Raises:
            ValueError: mask_pairs, a plan mixing both, or an --api that cannot carry the masks.
        """
        check_expressible(self.pending)
        embedded = [p for p in self.pending if isinstance(p.input, EmbedsPrompt)]
        kinds = {"completions" if is_whole(p) else "chat" for p in embedded}
        if len(kinds) > 1 or len(embedded) < len(self.pending):
            raise ValueError("a --target plan mixes prompts sent as embedding rows with other prompts")
        api = kinds.pop()
        if asked not in ("auto", api):
            raise ValueError(f"--api {asked} cannot carry these prompt embeddings: they are sent to the {api} API "
                             "(embeds: all as completions' prompt_embeds, a mixed mask as chat prompt_embeds parts)")
        return api

    # -- what the run tells (kvtui.run.outcome.RunOutcome; the sink's properties: kvtui.run.base.RunBase) --
    faults_known = False  # a target server's faults are its own: fault_history says nothing

    # -- events ----------------------------------------------------------------------------------
    def now(self) -> float:
        """Seconds since the run started (wall clock)."""
        return self._clock() - self._t0

    def header(self) -> Header:
        """The recording's first line: scenario, the target, the served model and the client options."""
        if self._header is None:
            o = self.options
            self._header = run_header(
                self.scenario, model=ModelInfo(id=self.served_model or self.scenario.model, dtype="served"),
                engine={"api": self.api, "server": self.server_kind, "max_concurrency": o.max_concurrency,
                        "timeout_s": o.timeout_s,
                        "served_model": self.served_model, "logprobs": o.logprobs, "tolerance": o.tolerance,
                        **({"reference_url": o.reference_url} if o.reference_url else {}),
                        **({"prompt_embeds": True} if self.embeds_table is not None else {})},
                clock="wall", detectors=self.detectors, measured=MEASURED, target=o.url)
        return self._header

    # -- the run -----------------------------------------------------------------------------------
    def run(self, on_progress: Callable[[TargetSession], None] | None = None) -> Summary:
        """Drive the whole scenario, then the reference checks; returns the summary (also written last).

        Raises:
            TargetError: the server cannot be reached at all or does not answer JSON (nothing was sent).
        """
        return asyncio.run(self.run_async(on_progress))

    async def run_async(self, on_progress: Callable[[TargetSession], None] | None = None) -> Summary:
        """run() inside a running event loop."""
        # the load goes out on kvtui.remote.wire's pooled keep-alive connections where it can (plain http://);
        # everything else (models, probes, solo runs, the request-id audit's probes) on httpx, one at a time
        limits = httpx.Limits(max_connections=self.options.max_concurrency + 2, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=self.options.url.rstrip("/"), transport=self.options.transport,
                                     timeout=httpx.Timeout(self.options.timeout_s), limits=limits) as client:
            await self._resolve_model(client)
            self._load_client = self._wire_pool() or client
            if self.id_audit is not None:
                await self.id_audit.before_load(client)  # /health as it answers before any request
            # what exists now (the tokenizer, the plan: hundreds of thousands of objects) is left out of the
            # garbage collector's full passes, each of which would stop the sending loop for tens of ms
            gc.collect()
            gc.freeze()
            # the server's counters at the start, read before it: a probe after it (tens of ms against a
            # server with large /metrics) would make the first requests late on their schedule
            probe = ServerProbe(client, self.in_flight)
            first_sample = await probe.sample(0.0)
            self._t0 = await self._load_start()
            self._start_recording(self.header())  # the header unwritable (e.g. /dev/full): OSError, nothing sent
            self.fidelity.start()
            if first_sample is not None:
                self.emit(first_sample)
            poller = asyncio.create_task(self._poll(probe, on_progress))
            markers = asyncio.create_task(self._markers())
            try:
                await self._wait_all(await self._drive(client))
                self._end_of_load()
                await self._sample(probe)  # the load's end: the server's counters before the references
                if self.id_audit is not None and not self.stop_requested:
                    await self._audit_ids(client)
                if "reference" in self.detectors and not self.stop_requested and self._server_stopped():
                    self.reference_skips[SkipReason.SERVER_STOPPED] += sum(
                        r.finish_reason in ("stop", "length") and self.planned[rid].sampling.temperature == 0
                        for rid, r in self.results.items())
                    self._reference_status(pending=0)
                elif "reference" in self.detectors and not self.stop_requested:
                    await self._references(client)
                elif "reference" in self.detectors:
                    self.reference_skips[SkipReason.STOPPED] += sum(r.finish_reason in ("stop", "length")
                                                           for r in self.results.values())
                    self._reference_status(pending=0)
            finally:
                poller.cancel()
                markers.cancel()
                await asyncio.gather(poller, markers, return_exceptions=True)
                if isinstance(self._load_client, WirePool):
                    await self._load_client.aclose()
                gc.unfreeze()
            sample = await probe.sample(self.now())
            if sample is not None:
                self.emit(sample)
        return self.close()

    def _wire_pool(self) -> WirePool | None:
        """The load's pooled connections (kvtui/remote/wire.py), None where the load goes on httpx (a test
        transport, https, a proxy). llama.cpp's server and the request-id audit get a connection per request
        (`Connection: close`, never retried): llama.cpp drops a stream's connection although it says
        Keep-Alive, and the audit must see each request exactly once."""
        if not wire_usable(self.options.url, self.options.transport):
            return None
        return WirePool(self.options.url, fresh=self.server_kind == "llama.cpp" or self.id_audit is not None)

    async def _load_start(self) -> float:
        """The moment the load starts, on `clock` (the run's t = 0): now. A subclass that sends the load
        from elsewhere (kvtui/remote/workers.py) readies its senders here and returns their shared start."""
        return self._clock()

    def _end_of_load(self) -> None:
        """The load's fidelity at its end (before the probes and solo runs): emitted, and kept for the summary."""
        if self.load_fidelity is None:
            self.load_fidelity = self.fidelity.figures(self.now())
            self.emit(self.load_fidelity)

    async def _resolve_model(self, client: httpx.AsyncClient) -> None:
        """Check the server (and the reference server, when named) answers /v1/models with JSON; take the
        served model's name from it unless given.

        Raises:
            TargetError: as kvtui.remote.reach.first_model.
        """
        first = await first_model(client, self.options.url, self.served_model)
        if self.served_model is None:
            self.served_model = first.get("id")
        if first.get("owned_by") in SERVER_KINDS:
            self.server_kind = SERVER_KINDS[first["owned_by"]]
        if self.options.reference_url:  # the solo runs' server answers too, before any request is sent
            async with httpx.AsyncClient(base_url=self.options.reference_url.rstrip("/"),
                                         transport=self.options.transport) as reference:
                await first_model(reference, self.options.reference_url, self.options.served_model, "--reference-target")

    async def _drive(self, client: httpx.AsyncClient) -> list[asyncio.Task]:
        """Send each planned request at its arrival time; returns the request tasks."""
        cap = asyncio.Semaphore(self.options.max_concurrency)
        tasks = []
        while self.pending and not self.stop_requested:
            p = self.pending[0]
            await self._wait_until(p.arrival_s)
            if p.round is not None and p.round != self._round:
                await self._wait_round(tasks)
                self._round, self._round_start = p.round, self.now()
            if self.stop_requested:
                break
            at = self._round_start if p.round is not None else p.arrival_s + self.held_s
            p = replace(self.pending.pop(0), arrival_s=at)
            arrive = arrive_event(p)
            arrival = Arrival(p.request_id, arrive.passphrase, spoken=p.spoken, sampling=p.sampling)
            self.emit(arrive)
            self._emit_all(o.on_arrive(arrival) for o in self.observers)
            tasks.append(asyncio.create_task(self._one(client, cap, p)))
            await asyncio.sleep(0)  # let it go out now: a loop behind its schedule would otherwise send in bursts
        return tasks

    async def _wait_round(self, tasks: list[asyncio.Task]) -> None:
        """`process: rounds`: wait until every request sent so far has finished (and arrivals are not held)."""
        while not self.stop_requested and (self._held_since is not None or any(not t.done() for t in tasks)):
            await asyncio.sleep(0.02)

    async def _wait_all(self, tasks: list[asyncio.Task]) -> None:
        """Wait for every request; a stop cancels those still in flight (they finish as `abort`)."""
        pending = set(tasks)
        while pending:
            if self.stop_requested:
                for task in pending:
                    task.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.1)

    async def _wait_until(self, t: float) -> None:
        """Sleep until `t` on the plan's schedule (later by the time arrivals were held)."""
        while not self.stop_requested and (self._held_since is not None or self.now() < t + self.held_s):
            await asyncio.sleep(0.05 if self._held_since is not None else min(t + self.held_s - self.now(), 0.1))

    def hold(self, on: bool) -> None:
        """Hold new arrivals (the dashboard's pause) or let them go again, later by the time held;
        requests in flight go on. Any thread."""
        if on and self._held_since is None:
            self._held_since = self.now()
        elif not on and self._held_since is not None:
            self.held_s += self.now() - self._held_since
            self._held_since = None

    async def _markers(self) -> None:
        """The timeline's markers, each at its time, while the run lasts."""
        for item in self.timeline:
            await self._wait_until(item.at_s)
            if self.stop_requested:
                return
            self.emit(Marker(t=self.now(), text=item.marker))

    @property
    def request_timeout_s(self) -> float:
        """One request's limit: --timeout, lowered to request_ids.wait_s in a request-id audit."""
        if self.id_audit is None:
            return self.options.timeout_s
        return min(self.options.timeout_s, self.id_audit.wait_s)

    async def _one(self, client: httpx.AsyncClient, cap: asyncio.Semaphore, p) -> None:
        """One request: wait for a place under the cap, stream it, emit its first token and finish."""
        result = StreamResult(sent_s=self.now())
        ready, cap_wait, sending = result.sent_s, 0.0, False
        try:
            waits = cap.locked()  # no place free under --max-concurrency: that wait is the cap's, not lag
            async with cap:
                cap_wait = self.now() - ready if waits else 0.0
                self.in_flight[p.request_id] = p.passphrase or p.text or ""
                result = StreamResult(sent_s=self.now())
                sending = True
                if is_audio(p):
                    await self._transcribe(client, p, result)
                else:
                    path, body = self._body(p, temperature=None)
                    if self.options.uncached_load:
                        body = uncached(body, self.server_kind)
                    send_as = self.id_audit.spec.send_as if self.id_audit is not None else ()
                    # each chunk seen as it comes only where the scenario cuts the answer after n tokens;
                    # otherwise the stream's events are parsed at its end (kvtui.remote.openai.stream_request)
                    cut = None if p.cancel_after is None else (
                        lambda r, piece: self._on_chunk(p.request_id, r, p.cancel_after))
                    await stream_request(self._load_client, path, {**body, **id_fields(p.client_id, send_as)},
                                         timeout_s=self.request_timeout_s, clock=self.now, result=result,
                                         on_chunk=cut, on_first=lambda r: self._first_token(p.request_id, r),
                                         headers=id_headers(p.client_id, send_as, p.request_id))
        except asyncio.CancelledError:
            result.finish_reason, result.error = "abort", "stopped before the answer ended"
        except _ClientCancel:
            result.finish_reason = "abort"
            result.error = f"cancelled by the client after {p.cancel_after} tokens (the scenario's rounds cancel)"
        finally:
            self.in_flight.pop(p.request_id, None)
        lag = self.fidelity.record(p.arrival_s, result.sent_s, cap_wait) if sending else None
        self.results[p.request_id] = result
        self._finish(p, result, lag)
        if p.turn is not None:
            await self._next_turn(client, cap, p, result)

    async def _next_turn(self, client: httpx.AsyncClient, cap: asyncio.Semaphore, p, result: StreamResult) -> None:
        """A session's next turn, once `p` (its turn before) has answered: after its think time, the chat so far
        (the server's real answer to `p` in it) and the follow-up, sent as a request of its own. A turn that
        failed, or a stop, ends the session: its later turns stay unsent."""
        from kvtui.scenario.prompts import chat_ids

        key = (p.turn.session, p.turn.turn + 1)
        if key not in self.later_turns or self.stop_requested or result.finish_reason not in ("stop", "length"):
            return
        at = self.now() - self.held_s + self.later_turns[key].turn.think_s  # on the plan's schedule
        await self._wait_until(at)
        if self.stop_requested:
            return
        chat = [*(self._messages(p) or [{"role": "user", "content": p.text}]),
                {"role": "assistant", "content": result.text}, {"role": "user", "content": self.later_turns[key].text}]
        nxt = replace(self.later_turns.pop(key), arrival_s=at + self.held_s, messages=tuple(chat),
                      input=TokenPrompt(tuple(chat_ids(self.tokenizer, chat))))
        self.planned[nxt.request_id] = nxt  # what its solo rerun replays: this very chat
        self.emit(arrive_event(nxt))
        self._emit_all(o.on_arrive(Arrival(nxt.request_id, sampling=nxt.sampling, same_as=p.turn.session))
                       for o in self.observers)
        await self._one(client, cap, nxt)

    async def _transcribe(self, client: httpx.AsyncClient, p, result: StreamResult, *,
                          temperature: float | None = None, live: bool = True) -> StreamResult:
        """A speech request: its clip uploaded to /v1/audio/transcriptions (remote/transcription.py); the
        whole transcript is its one chunk, reported as a first token and to the canary when `live` (the
        load; not its solo rerun)."""
        form = transcription_form(p, self.served_model, temperature=temperature)
        await transcribe_request(client, p, form, timeout_s=self.options.timeout_s, clock=self.now, result=result)
        if live and result.chunk_times_s:
            self._first_token(p.request_id, result)
        return result

    def _body(self, p, temperature: float | None) -> tuple[str, dict]:
        if isinstance(p.input, EmbedsPrompt):  # the same rows, encoded once, for the load and the solo run
            if p.request_id not in self._embeds:
                self._embeds[p.request_id] = (completion_embeds(p, self.embeds_table) if is_whole(p) else
                                              chat_parts(p, self.tokenizer, self.embeds_table))
            data = self._embeds[p.request_id]
            if isinstance(data, str):
                return request_body(p, "completions", self.served_model, logprobs=self.options.logprobs,
                                    temperature=temperature, prompt_embeds=data)
            return request_body(p, "chat", self.served_model, logprobs=self.options.logprobs,
                                messages=[{"role": "user", "content": data}], temperature=temperature)
        return request_body(p, self.api, self.served_model, logprobs=self.options.logprobs,
                            messages=self._messages(p), temperature=temperature)

    def _messages(self, p) -> list | None:
        """Chat messages to send instead of one user message with the prompt text: the scenario's own for a
        prompt-file entry that is a chat; the decoded token ids for a prompt without text (synthetic)."""
        if self.api != "chat":
            return None
        if p.messages is not None:  # a session's later turn: the chat so far, the server's answers in it
            return list(p.messages)
        if p.text is None:
            return [{"role": "user", "content": self.tokenizer.decode(p.prompt_ids, skip_special_tokens=True)}]
        index = p.facts.prompt_index
        prompts = getattr(self.scenario.prompts, "prompts", None)
        item = prompts[index] if index is not None and prompts else None
        return item if isinstance(item, list) else None

    def _first_token(self, request_id: str, result: StreamResult) -> None:
        """The request's first chunk has come: its FirstToken event. (The observers see the answer's text
        once, whole, at its end: the canary checks the final text, kvtui/detect/canary.py.)"""
        self.emit(FirstToken(t=result.first_s, request_id=request_id, ttft_s=result.first_s - result.sent_s))

    def _on_chunk(self, request_id: str, result: StreamResult, cancel_after: int) -> None:
        """A chunk of a request the scenario cuts after `cancel_after` tokens: its first token, and the cut."""
        if len(result.chunk_times_s) == 1:
            self._first_token(request_id, result)
        if max(len(result.tokens), len(result.chunk_times_s)) >= cancel_after:
            raise _ClientCancel  # leaves the stream: the connection closes, as a client going away

    def _finish(self, p, r: StreamResult, send_lag_s: float | None = None) -> None:
        reason = r.finish_reason if r.finish_reason in FINISH_REASONS else "stop"
        detail = r.error or ("" if reason == r.finish_reason else f"server finish_reason {r.finish_reason!r}")
        end = r.end_s if r.end_s is not None and reason in ("stop", "length") else self.now()
        self.spans[p.request_id] = (r.sent_s, end)
        ids = r.token_ids()
        done = Finished(p.request_id, r.text, end, -1, reason, completed=reason in ("stop", "length"))
        self._emit_all(o.on_finish(done) for o in self.observers)
        self.emit(finish_event(
            p, text=r.text, t=end, finish_reason=reason, detail=detail, prompt_ids=tuple(p.prompt_ids),
            output_ids=ids, arrival_s=p.arrival_s, sent_s=r.sent_s, first_token_s=r.first_s, finish_s=end,
            token_times_s=tuple(r.chunk_times_s), prompt_tokens=r.prompt_tokens, completion_tokens=r.output_tokens,
            cached_tokens=r.cached_tokens, send_lag_s=send_lag_s))

    async def _poll(self, probe: ServerProbe, on_progress) -> None:
        """Sample the server's /metrics and /slots every poll interval until cancelled, the first one
        interval after the start (the sample at the start was taken before it)."""
        while True:
            await asyncio.sleep(self.options.poll_interval_s)
            await self._sample(probe)
            self._live_fidelity()
            if on_progress is not None:
                on_progress(self)

    def _live_fidelity(self) -> None:
        """A LoadFidelity about every second while the load runs and requests finish (the dashboard's)."""
        when, sent = self._fidelity_emitted
        now, count = self.now(), len(self.fidelity.sent)
        if self.load_fidelity is None and count > sent and now - when >= 1.0:
            self._fidelity_emitted = (now, count)
            self.emit(self.fidelity.figures(now))

    async def _sample(self, probe: ServerProbe) -> None:
        sample = await probe.sample(self.now())
        if sample is not None:
            self.emit(sample)

    async def _references(self, client: httpx.AsyncClient) -> None:
        """Send each completed greedy request again alone (temperature 0), one at a time; compare."""
        ordered = sorted(self.results.items(), key=lambda kv: kv[0])
        greedy = [(rid, r) for rid, r in ordered if r.finish_reason in ("stop", "length")
                  and self.planned[rid].sampling.temperature == 0]
        # sampled (temperature > 0) answers are not compared; failed or aborted requests have no answer to
        # compare and are neither checked nor skipped (the summary counts them as failed)
        completed = sum(1 for _, r in ordered if r.finish_reason in ("stop", "length"))
        self.reference_skips[SkipReason.SAMPLED] += completed - len(greedy)
        self._reference_status(pending=len(greedy))
        if greedy:
            where = f" to {self.options.reference_url}" if self.options.reference_url else ""
            self.emit(Marker(t=self.now(), text=f"reference check: {len(greedy)} prompts sent again{where}, one at a "
                             "time"))
        async with contextlib.AsyncExitStack() as stack:
            if self.options.reference_url:  # a control server (e.g. its prompt cache off) answers the solo runs
                client = await stack.enter_async_context(httpx.AsyncClient(
                    base_url=self.options.reference_url.rstrip("/"), transport=self.options.transport,
                    timeout=httpx.Timeout(self.options.timeout_s)))
            for k, (rid, batched) in enumerate(greedy):
                if self.stop_requested:
                    self.reference_skips[SkipReason.STOPPED] += 1
                else:
                    await self._reference_one(client, rid, batched)
                self._reference_status(pending=len(greedy) - k - 1)

    async def _reference_one(self, client: httpx.AsyncClient, rid: str, batched: StreamResult) -> None:
        """One solo run, past the server's prefix cache; compared only when the server did not say it
        took part of the prompt from its cache (KV the load wrote would make the "solo" run a copy)."""
        if is_audio(self.planned[rid]):  # no prefix cache across audio: the clip is part of the key
            solo = await self._transcribe(client, self.planned[rid], StreamResult(sent_s=self.now()), temperature=0.0,
                                          live=False)
        else:
            path, body = self._body(self.planned[rid], temperature=0.0)
            solo = await stream_request(client, path, uncached(body, self.server_kind),
                                        timeout_s=self.options.timeout_s, clock=self.now)
        if solo.finish_reason == "error":
            self.reference_skips[SkipReason.ERROR] += 1
            self.emit(Marker(t=self.now(), text=f"reference check of {rid} skipped: {solo.error}"))
            return
        if solo.cached_tokens:
            self.reference_cached += 1
            of = f" of {solo.prompt_tokens}" if solo.prompt_tokens is not None else ""
            self.emit(Marker(t=self.now(), text=f"reference check of {rid} not counted: the server took "
                             f"{solo.cached_tokens}{of} prompt tokens from its prefix cache"))
            return
        self.reference_checked += 1
        self.reference_uncached_verified += solo.cached_tokens == 0
        self.solo_results[rid] = solo
        event = reference_event(rid, batched, solo, tolerance=self.options.tolerance, t=self.now(),
                                suspects=self.overlapping(rid))
        if event is not None:
            self.emit(event)

    async def _audit_ids(self, client: httpx.AsyncClient) -> None:
        """The request-id audit after the load: probes with fresh ids and /health, then its findings."""
        audit = self.id_audit
        self.emit(Marker(t=self.now(), text=f"request-id audit: {len(audit.prompts)} requests with fresh ids, one at "
                                            f"a time{', then GET /health' if audit.spec.health else ''}"))
        await audit.probe(client, partial(self._send_probe, client))
        for name, value, result in audit.probes:
            said = "answered" if result.finish_reason in ("stop", "length") else result.error or result.finish_reason
            self.emit(Marker(t=self.now(), text=f"request-id audit: {name} ({value}): {said}"))
        canary = [e for e in self.contamination if e.detector == "canary"]
        for event in audit.findings(self.results, self.spans, canary, self.now()):
            self.emit(event)

    async def _send_probe(self, client: httpx.AsyncClient, planned, headers: dict, fields: dict,
                          timeout_s: float) -> StreamResult:
        """One request of the audit's probes: `planned`'s prompt with the probe's id, alone."""
        path, body = self._body(planned, temperature=None)
        return await stream_request(client, path, {**body, **fields},
                                    timeout_s=min(timeout_s, self.options.timeout_s), clock=self.now,
                                    headers=headers)

    def _server_stopped(self) -> bool:
        """The request-id audit found that the server stopped serving (no solo run could be sent)."""
        return self.id_audit is not None and bool(self.id_audit.probes or self.id_audit.spec.health) and \
            self.id_audit.stopped_serving

    def _reference_counts(self) -> dict:
        return {"checked": self.reference_checked, "skipped_by_reason": self.reference_skips, "pending": 0,
                "cached": self.reference_cached, "uncached_verified": self.reference_uncached_verified}

    def overlapping(self, rid: str) -> tuple[str, ...]:
        """Requests whose send-to-end interval overlapped `rid`'s (the ones that could have reached it)."""
        me = self.results[rid]
        start, end = me.sent_s, me.end_s if me.end_s is not None else me.sent_s
        return tuple(sorted(other for other, r in self.results.items() if other != rid and r.sent_s <= end
                            and (r.end_s if r.end_s is not None else r.sent_s) >= start))

    def abandon(self) -> None:
        """The run never started (the server could not be reached): close the recording and remove it
        when nothing was written to it."""
        self.sink.abandon_recording()

    def close(self) -> Summary:
        """Write the summary line and close the recording (once)."""
        aborted = any(r.finish_reason == "abort" for r in self.results.values())
        line = self.id_audit.line(self.results) if self.id_audit is not None and self.id_audit.outcomes else None
        if self.load_fidelity is None and self.fidelity.sent:  # stopped or failed before the load's end
            self.load_fidelity = self.fidelity.figures(self.now())
        unsent = len(self.pending) + len(self.later_turns)
        return self._close_run(work_left=unsent > 0 or aborted, requests_not_submitted=unsent,
                               request_id_audit=line, load_fidelity=self.load_fidelity,
                               trace_prefix_hits=self._trace_prefix_hits())

    def _trace_prefix_hits(self) -> dict | None:
        """A trace run's prefix hits (kvtui.scenario.trace.hit_table) over the trace's requests sent (a session's
        later turns left out): the trace's theoretical hits beside the server's reported cached tokens; None for
        other arrivals."""
        from kvtui.scenario.trace import hit_table

        arrivals = self.scenario.arrivals
        if getattr(arrivals, "process", None) != "trace":
            return None
        sent = sorted((self.planned[rid] for rid in self.results if not (self.planned[rid].turn and
                                                                         self.planned[rid].turn.turn)),
                      key=lambda p: (p.arrival_s, p.request_id))  # the trace's rows: sessions' first turns
        rows = [(p.tenant, p.facts.hash_ids, len(p.prompt_ids), self.results[p.request_id].prompt_tokens,
                 self.results[p.request_id].cached_tokens) for p in sent]
        return {row.who: row.as_dict() for row in hit_table(rows, arrivals.hash_block_size)}


def check_reachable(options: TargetOptions) -> None:
    """Ask the server at `options.url` (and the reference server, when one is named) for /v1/models once,
    before anything slow is set up (kvtui.remote.reach.probe: the one check every command makes).

    Raises:
        TargetError: as kvtui.remote.reach.first_model.
    """
    probe(options.url, options.served_model, transport=options.transport)
    if options.reference_url:
        probe(options.reference_url, options.served_model, transport=options.transport, flag="--reference-target")


def overlap_warnings(planned) -> list[str]:
    """Lines about request-id groups whose requests do not arrive together (different times, or rounds):
    they may not be in flight at once, and a duplicate id then tests little."""
    by_group: dict[int, list] = {}
    for p in planned:
        if p.client_id is not None:
            by_group.setdefault(p.client_id.group, []).append(p)
    apart = [g for g, members in sorted(by_group.items()) if len(members) > 1
             and len({(m.round, m.arrival_s if m.round is None else 0.0) for m in members}) > 1]
    if not apart:
        return []
    first = by_group[apart[0]]
    return [f"request_ids: {len(apart)} id groups arrive at different times (e.g. group {apart[0]}: "
            f"{', '.join(m.request_id for m in first)}), so their requests may not overlap; put each group in one "
            "round of `process: rounds` or one burst"]


def timeline_warnings(scenario) -> list[str]:
    """The scenario's timeline entries a remote server cannot honour (engine knobs, faults)."""
    ignored = [e for e in scenario.timeline if e.engine_overrides() or e.fault_switch]
    if not ignored:
        return []
    return [f"{len(ignored)} timeline entries set engine knobs or faults, which a target server does not take "
            "from kvtui; they are ignored (arrival-rate changes and markers still apply)"]
