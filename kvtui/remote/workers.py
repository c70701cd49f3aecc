"""`kvtui run SCENARIO --target URL --workers N [--ray ADDRESS]`: the load sent from N Ray workers.

One client process falls behind its schedule at some rate (docs/loadgen.md); past it, the load is
split. The seeded plan is sharded by index: the k-th request in send order (arrival time, then request
id) goes to worker k mod N. Each worker (a Ray actor: one process, one event loop thread) loads the
scenario model's tokenizer, plans the scenario again from its seed and keeps its own shard, so only the
scenario travels; it checks that it holds the request ids the driver expects. All of them send against
one shared start: the driver picks a wall-clock moment (time.time(), START_LEAD_S ahead), each worker
maps it onto its own time.perf_counter, and every time a worker measures (sent, first chunk, each chunk,
end) is in seconds since that start, the driver's run clock too. On one machine the clocks agree; on a
cluster they agree as well as the nodes' clocks do (NTP: typically a millisecond or better).

Each worker sends as the single-process client does (the same bodies, the same pooled connections,
at most ceil(max_concurrency / N) requests of its own in flight) and keeps each finished request's
record (kvtui.remote.openai.StreamResult with its pieces and chunk times, the wait for a place under its
cap). The driver takes the finished records every COLLECT_S; for each one it emits what the
single-process client emits (the first token, the finish event with the whole answer to the observers,
the fidelity figures), so the detectors, the recording, the reference checks and the dashboard run on the
driver as before. Arrivals are emitted on the driver at their planned times.

A worker that dies (its process killed, its node lost) is reported: a marker names it, and each request
it held that had not come back finishes as an error saying so (what the server did with it is unknown);
none is dropped. Requests of its shard that had not arrived yet finish the same way at their arrival.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, replace

import httpx

from kvtui.events import FirstToken, Marker
from kvtui.remote.openai import StreamResult
from kvtui.remote.reach import TargetError
from kvtui.remote.session import TargetSession
from kvtui.remote.wire import WirePool

RAY_MISSING = "--workers sends the load from Ray workers, and Ray is not installed: pip install 'kvtui[ray]'"
START_LEAD_S = 1.0  # the shared start lies this far ahead of the moment the workers are told it (seconds)
COLLECT_S = 0.05  # how often the driver takes the workers' finished records (seconds)
WAIT_NOTE_S = 10.0  # while the workers start, a marker this often says how many are ready (seconds)
PROBE_S = 3.0  # how long a --ray HOST:PORT has to accept a TCP connection before ray.init is tried (seconds)


@contextlib.contextmanager
def _terminal_stderr():
    """Around ray.init: where sys.stderr has no file descriptor (the dashboard: Textual captures it), the
    process's own stderr stands in, since ray.init enables faulthandler on sys.stderr (which fails on the
    capture); yields True there, and Ray is then started with its log level at ERROR, so that its lines
    do not draw over the dashboard. Elsewhere nothing changes (yields False)."""
    try:
        has_fd = sys.stderr.fileno() >= 0
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        has_fd = False
    if has_fd or sys.__stderr__ is None:
        yield False
        return
    captured, sys.stderr = sys.stderr, sys.__stderr__
    ray_logger = logging.getLogger("ray")
    level = ray_logger.level
    ray_logger.setLevel(logging.ERROR)
    try:
        yield True
    finally:
        sys.stderr = captured
        ray_logger.setLevel(level)


@contextlib.contextmanager
def _kept_stop_handlers(ray):
    """Around ray.init in the main thread: the process's SIGINT / SIGTERM handling stays what it was (the CLI's
    stop handlers: "stopping; writing the summary", exit 128 + the signal's number).

    ray.init replaces them twice over: in Python, a SIGTERM handler that exits at once (sys.exit(15), set as
    it begins), and natively, when its core worker starts, absl's failure handler over SIGTERM (a C++ stack
    dump on stderr, the Python handler called, and an alarm that aborts the process 3 s later: exit 15 or
    134). Here Ray's Python handler is not installed while it starts (a signal meanwhile reaches the handler
    that was there), and afterwards each handler is set again with signal.signal, which puts Python's own
    native handler back over the failure handler. A SIGTERM in the moment between the core worker's start
    and that (its dump is on stderr by then) has the abort's alarm cancelled, unless the process uses
    SIGALRM itself. Outside the main thread (the dashboard's worker) nothing can be set and nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kept = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    utils = getattr(getattr(ray, "_private", None), "utils", None)
    ray_sets = getattr(utils, "set_sigterm_handler", None)  # how ray.init sets its own (Ray 2.x)
    came: list[int] = []
    if callable(kept[signal.SIGTERM]):
        def noted(signum, frame):  # the kept handler, noting that a SIGTERM came while Ray started
            came.append(signum)
            kept[signal.SIGTERM](signum, frame)

        signal.signal(signal.SIGTERM, noted)
    if ray_sets is not None:
        utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        if ray_sets is not None:
            utils.set_sigterm_handler = ray_sets
        for signum, handler in kept.items():
            if handler is not None:  # None: set outside Python, which cannot be set again from here
                signal.signal(signum, handler)
        if came and signal.getsignal(signal.SIGALRM) == signal.SIG_DFL:
            signal.alarm(0)  # absl's abort, had its failure handler caught the SIGTERM
            signal.signal(signal.SIGALRM, signal.SIG_DFL)  # and its handler of the alarm


def _nothing_answers(address: str) -> str | None:
    """For a plain HOST:PORT `address` (not `auto`, not `ray://...`): "nothing answers on HOST:PORT" when no
    TCP connection to it opens within PROBE_S seconds (ray.init would retry for minutes there), else None
    (it answers, or the address is no HOST:PORT and Ray judges it)."""
    if "://" in address:
        return None
    host, colon, port = address.rpartition(":")
    host = host.strip("[]")  # [::1]:6379
    if not colon or not host or not port.isdigit():
        return None
    try:
        with socket.create_connection((host, int(port)), timeout=PROBE_S):
            return None
    except (OSError, OverflowError):  # refused, timed out, unknown host, port out of range
        return f"nothing answers on {address}"


def init_ray(address: str | None, workers: int):
    """Start Ray for --workers: the cluster at `address` (`ray.init(address=...)`), or a local runtime of
    `workers` CPUs when None; with Ray's log at ERROR (its start-up lines stay out of the report; the dashboard:
    _terminal_stderr), and the process's SIGINT / SIGTERM handlers as they were (_kept_stop_handlers). A plain
    HOST:PORT address must accept a TCP connection within PROBE_S seconds first. Returns the `ray`
    module; the caller shuts Ray down.

    Raises:
        TargetError: the address is malformed or no cluster answers there (one line naming --ray and the fix).
    """
    import ray

    def no_cluster(reason: str) -> TargetError:
        return TargetError(f"--ray {address}: no Ray cluster there ({reason}); give the address `ray start "
                           "--head` printed (HOST:6379), or leave --ray out for a local runtime")

    silent = _nothing_answers(address) if address else None
    if silent:
        raise no_cluster(silent)
    with _terminal_stderr(), _kept_stop_handlers(ray):
        more = {"logging_level": logging.ERROR}  # Ray's start-up lines (INFO, a token WARNING) stay out of the report
        try:
            if address:
                ray.init(address=address, log_to_driver=False, **more)
            else:
                ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False, **more)
        except (ValueError, ConnectionError, RuntimeError) as e:  # Ray's words for a bad or unreachable address
            raise no_cluster(" ".join(str(e).split()) or type(e).__name__) from None
    return ray


def ray_available() -> bool:
    """Ray can be imported (the `kvtui[ray]` extra is installed)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def seeded_plan(scenario, tokenizer, rate: float | None = None) -> list:
    """The scenario's plan from its seed; with a sweep's `rate` (req/s), re-timed to Poisson arrivals at it
    (kvtui.remote.sweep.retimed): what the driver and each worker plan alike."""
    from kvtui.remote.sweep import retimed
    from kvtui.scenario import plan_requests

    plan = plan_requests(scenario, tokenizer)
    return retimed(plan, rate, scenario.seed) if rate is not None else plan


def send_order(plan: list) -> list:
    """The plan in send order (arrival time, then request id): a request's index in it picks its shard."""
    return sorted(plan, key=lambda p: (p.arrival_s, p.request_id))


@dataclass
class Sent:
    """One finished request, as a worker hands it back.

    Attributes:
        request_id: the planned request's id. result: what its stream gave (times: seconds since the
            shared start). cap_wait_s: its wait for a place under the worker's cap (seconds).
        sending: its POST went out (False: stopped before it was sent).
    """

    request_id: str
    result: StreamResult
    cap_wait_s: float = 0.0
    sending: bool = True


class ShardSession(TargetSession):
    """A worker's side: its shard of the plan, sent at the planned times against the shared start, each
    finished request kept (in `done`) for the driver instead of emitted. No detectors, no recording.

    Args:
        scenario, tokenizer, options: as TargetSession (options' max_concurrency: this worker's own cap).
        index, workers: this shard (0-based) of how many.
        model: the scenario model (prompt embeddings' table). api, served_model, server_kind: as the
            driver resolved them from the server.
        rate: a sweep's rate (req/s): the plan re-timed to Poisson arrivals at it (seeded_plan).
    """

    def __init__(self, scenario, tokenizer, options, *, index: int, workers: int, model: str, api: str,
                 served_model: str | None, server_kind: str | None, rate: float | None = None) -> None:
        plan = send_order(seeded_plan(scenario, tokenizer, rate))
        mine = [p for k, p in enumerate(plan) if k % workers == index]
        super().__init__(scenario, tokenizer, options, detectors=(), planned=mine, model=model)
        self.api, self.served_model, self.server_kind = api, served_model, server_kind
        self.done: list[Sent] = []

    def _finish(self, p, r: StreamResult, send_lag_s: float | None = None) -> None:
        cap_wait = r.sent_s - p.arrival_s - send_lag_s if send_lag_s is not None else 0.0
        self.done.append(Sent(p.request_id, r, max(cap_wait, 0.0), send_lag_s is not None))

    async def send(self, start_wall: float) -> int:
        """Send the shard: each request at its planned time after `start_wall` (time.time()); returns how
        many finished."""
        limits = httpx.Limits(max_connections=self.options.max_concurrency + 2, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=self.options.url.rstrip("/"), timeout=httpx.Timeout(
                self.options.timeout_s), limits=limits) as client:
            self._load_client = self._wire_pool() or client
            self._t0 = self._clock() - (time.time() - start_wall)  # now() = seconds since the shared start
            self.fidelity.start()
            try:
                await self._wait_all(await self._drive(client))
            finally:
                if isinstance(self._load_client, WirePool):
                    await self._load_client.aclose()
                gc.unfreeze()
        return len(self.done)


class ShardWorker:
    """The Ray actor around a ShardSession (async: its methods run on one event loop, so `take` answers
    while `run` sends)."""

    def __init__(self) -> None:
        self.session: ShardSession | None = None
        # a stop or a hold can reach the actor before its prepare ran (an async actor's calls need not run in
        # the order they were sent): kept here and applied to the session once it exists
        self._stopped = False
        self._held = False

    async def prepare(self, scenario, model: str, options, index: int, workers: int, api: str,
                      served_model: str | None, server_kind: str | None,
                      rate: float | None = None) -> tuple[int, list[str]]:
        """Load the tokenizer and plan the shard; returns (this process's id, the shard's request ids)."""
        from kvtui.models import load_tokenizer

        tokenizer = load_tokenizer(model)
        self.session = ShardSession(scenario, tokenizer, options, index=index, workers=workers, model=model,
                                    api=api, served_model=served_model, server_kind=server_kind, rate=rate)
        self.session.stop_requested = self._stopped
        if self._held:
            self.session.hold(True)
        gc.collect()  # the plan and the tokenizer out of the collector's full passes while it sends (ShardSession.send
        gc.freeze()  # unfreezes), as the single client does; here, before the shared start is set
        return os.getpid(), [p.request_id for p in self.session.pending]

    async def run(self, start_wall: float) -> int:
        """Send the shard (ShardSession.send)."""
        return await self.session.send(start_wall)

    async def take(self) -> tuple[list[Sent], float]:
        """The requests finished since the last take (none before prepare), and the CPU seconds this
        worker has used sending (since its shard's start)."""
        if self.session is None:
            return [], 0.0
        done, self.session.done = self.session.done, []
        return done, self.session.fidelity.cpu_used()

    async def stop(self) -> None:
        """Stop sending; requests in flight finish as `abort` (before prepare: the shard is made stopped)."""
        self._stopped = True
        if self.session is not None:
            self.session.stop_requested = True

    async def hold(self, on: bool) -> None:
        """Hold arrivals (the dashboard's pause) or let them go again (before prepare: applied by prepare)."""
        self._held = on
        if self.session is not None:
            self.session.hold(on)


class RayTargetSession(TargetSession):
    """A TargetSession whose load goes out from `workers` Ray workers (the module's docstring).

    Args:
        scenario, tokenizer, options, record_path, detectors, listeners, clock, model: as TargetSession.
        workers: how many workers (>= 1). address: a Ray cluster's address (`ray.init(address=...)`);
            None: a local Ray runtime with `workers` CPUs (or the one already initialized).
        rate: `kvtui sweep`'s rate (req/s): the driver and every worker re-time the seeded plan to Poisson
            arrivals at it (kvtui.remote.sweep.retimed), as the sweep's single-process runs do.

    Raises:
        ValueError: as TargetSession; also workers < 1, a test transport (it cannot cross processes), a
            `planned` list (the workers plan from the seed), `process: rounds` (each round waits for the last
            one's answers: a closed loop).
    """

    def __init__(self, scenario, tokenizer, options, *, workers: int, address: str | None = None,
                 rate: float | None = None, **kwargs) -> None:
        if workers < 1:
            raise ValueError("--workers must be >= 1")
        if options.transport is not None:
            raise ValueError("--workers sends over the network; a test transport cannot reach other processes")
        if kwargs.get("planned") is not None:
            raise ValueError("--workers: each worker plans the scenario from its seed; a plan of other requests "
                             "cannot be sharded")
        if rate is not None:
            kwargs["planned"] = seeded_plan(scenario, tokenizer, rate)
        super().__init__(scenario, tokenizer, options, **kwargs)
        self.rate = rate
        if any(p.round is not None for p in self.pending):
            raise ValueError("--workers: `process: rounds` sends each round once the last one's answers are in, "
                             "which one client decides; run it without --workers")
        self.workers, self.address = workers, address
        self.model_name = kwargs.get("model") or scenario.model
        self.shard = {p.request_id: k % workers for k, p in enumerate(self.pending)}
        self.actors: list = []
        self.pids: list[int] = []  # each worker's process id
        self.dead: dict[int, str] = {}  # worker index -> why it stopped
        self._records: dict[str, asyncio.Future] = {}
        self._runs: list = []
        self._collector: asyncio.Task | None = None
        self._stop_sent = False
        self._started_ray = False
        self._worker_cpu = [0.0] * workers  # each worker's CPU seconds sending, as last taken
        self.fidelity.cpu, self.fidelity.senders = (lambda: sum(self._worker_cpu)), workers

    def header(self):
        """TargetSession's header, its `engine` also saying how many workers sent the load (and the cluster)."""
        if self._header is None:
            h = super().header()
            extra = {"workers": self.workers, **({"ray_address": self.address} if self.address else {})}
            self._header = h.model_copy(update={"engine": {**h.engine, **extra}})
        return self._header

    # -- the workers -------------------------------------------------------------------------------
    def _start_ray(self):
        import ray

        if not ray.is_initialized():
            init_ray(self.address, self.workers)
            self._started_ray = True
        return ray

    async def _load_start(self) -> float:
        """Start the workers, have each plan its shard, tell them the shared start; returns it on `clock`.

        Raises:
            TargetError: a worker's plan is not the driver's (another tokenizer or kvtui), or it failed.
        """
        ray = self._start_ray()
        actor = ray.remote(ShardWorker).options(num_cpus=1)
        options = replace(self.options, max_concurrency=math.ceil(self.options.max_concurrency / self.workers))
        self.actors = [actor.remote() for _ in range(self.workers)]
        try:
            shards = await self._prepared([a.prepare.remote(self.scenario, self.model_name, options, k, self.workers,
                                                            self.api, self.served_model, self.server_kind, self.rate)
                                           for k, a in enumerate(self.actors)])
        except Exception as e:  # a worker that cannot import kvtui, load the tokenizer or plan
            raise TargetError(f"--workers: a Ray worker could not plan its shard: {type(e).__name__}: {e}") from e
        if shards is None:  # stopped while the workers started: nothing is sent
            return self._clock()
        for k, (pid, ids) in enumerate(shards):
            expected = [rid for rid, s in self.shard.items() if s == k]
            if ids != expected:
                raise TargetError(f"--workers: worker {k} planned other requests than this process ({len(ids)} vs "
                                  f"{len(expected)}); give the workers the same kvtui and tokenizer")
            self.pids.append(pid)
        start_wall = time.time() + START_LEAD_S
        self._runs = [a.run.remote(start_wall) for a in self.actors]
        self._collector = asyncio.create_task(self._collect())
        await asyncio.sleep(max(0.0, start_wall - time.time()))
        return self._clock() - (time.time() - start_wall)

    async def _prepared(self, refs: list) -> list | None:
        """The workers' prepare answers, in order; None when a stop came first. While they are not all in
        (Ray starting worker processes, or waiting for free CPUs on a busy cluster), a marker every
        WAIT_NOTE_S tells the listeners (the dashboard) how many are ready, so a slow start shows as progress
        rather than a hang."""
        import ray

        waited, noted = 0.0, 0.0
        while True:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            if len(ready) == len(refs):
                return await asyncio.gather(*refs)
            if self.stop_requested:
                return None
            if waited - noted >= WAIT_NOTE_S:
                noted = waited
                note = Marker(t=0.0, text=f"waiting for the Ray workers to start: {len(ready)} of {len(refs)} "
                                          f"ready after {waited:.0f} s (each needs a free CPU in the cluster)")
                for listener in self.listeners:  # the screen only: the recording starts with its header
                    listener(note)
            await asyncio.sleep(0.1)
            waited += 0.1

    def _future(self, request_id: str) -> asyncio.Future:
        if request_id not in self._records:
            self._records[request_id] = asyncio.get_running_loop().create_future()
        return self._records[request_id]

    async def _collect(self) -> None:
        """Take the finished records from every live worker every COLLECT_S; report a dead one."""
        import ray

        while True:
            live = [k for k in range(self.workers) if k not in self.dead]
            taken = await asyncio.gather(*(self.actors[k].take.remote() for k in live), return_exceptions=True)
            for k, got in zip(live, taken):
                if isinstance(got, BaseException):
                    self._lost_worker(k, got)
                    continue
                got, self._worker_cpu[k] = got
                for sent in got:
                    future = self._future(sent.request_id)
                    if not future.done():
                        future.set_result(sent)
            for k in live:
                if k in self.dead:
                    continue
                ready, _ = ray.wait([self._runs[k]], timeout=0)
                if ready:  # its run ended: an exception there is a worker lost (its records were taken above)
                    try:
                        ray.get(ready[0])
                    except Exception as e:
                        self._lost_worker(k, e)
            if self.stop_requested and not self._stop_sent:
                self._stop_sent = True
                for k in live:
                    self.actors[k].stop.remote()
            await asyncio.sleep(COLLECT_S)

    def _lost_worker(self, k: int, error: BaseException) -> None:
        """Worker `k` died or failed: every request of its shard that has not come back finishes as an error."""
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        reason = f"{type(error).__name__}{': ' + first[:200] if first else ''}"
        self.dead[k] = reason
        lost = [rid for rid, s in self.shard.items() if s == k and not self._future(rid).done()]
        for rid in lost:
            result = StreamResult(sent_s=self.planned[rid].arrival_s, finish_reason="error",
                                  error=f"Ray worker {k} of {self.workers} (pid {self.pids[k]}) was lost before this "
                                        f"request's answer came back ({reason}); what the server did with it is "
                                        "unknown")
            self._future(rid).set_result(Sent(rid, result, 0.0, False))
        self.emit(Marker(t=self.now(), text=f"Ray worker {k} was lost ({reason}): its {len(lost)} unfinished "
                                            "requests finish as errors"))

    # -- the driver's side of each request ------------------------------------------------------------
    async def _one(self, client, cap, p) -> None:
        """Wait for the request's record from its worker; emit what the single-process client emits."""
        self.in_flight[p.request_id] = p.passphrase or p.text or ""
        try:
            sent = await self._future(p.request_id)
        except asyncio.CancelledError:
            sent = Sent(p.request_id, StreamResult(sent_s=self.now(), finish_reason="abort",
                                                   error="stopped before the answer ended"), 0.0, False)
        finally:
            self.in_flight.pop(p.request_id, None)
        r = sent.result
        self._replay_chunks(p.request_id, r)
        lag = self.fidelity.record(p.arrival_s, r.sent_s, sent.cap_wait_s) if sent.sending else None
        self.results[p.request_id] = r
        self._finish(p, r, lag)

    def _replay_chunks(self, request_id: str, r: StreamResult) -> None:
        """The first token, at the time the worker saw it (the observers see the whole answer at its finish,
        as in the single-process client)."""
        if r.first_s is not None and r.chunk_times_s:
            self.emit(FirstToken(t=r.first_s, request_id=request_id, ttft_s=r.first_s - r.sent_s))

    def hold(self, on: bool) -> None:
        """Hold arrivals here and on every live worker (the dashboard's pause)."""
        super().hold(on)
        for k, a in enumerate(self.actors):
            if k not in self.dead:
                try:
                    a.hold.remote(on)
                except Exception:  # a worker gone and not yet reported: the collector reports it
                    pass

    async def run_async(self, on_progress=None):
        """TargetSession.run_async, then the workers stopped (and Ray, when this session started it)."""
        try:
            return await super().run_async(on_progress)
        finally:
            if self._collector is not None:
                self._collector.cancel()
                await asyncio.gather(self._collector, return_exceptions=True)
            if self.actors:
                import ray

                for a in self.actors:
                    try:
                        ray.kill(a)
                    except Exception:  # already gone
                        pass
                self.actors = []  # the run is over: nothing more to tell them (the dashboard's stop, a hold)
            if self._started_ray:
                import ray

                ray.shutdown()
