"""`kvtui serve`: uvicorn in a background thread, one engine thread that owns the Session.

Threads:
- the HTTP thread runs uvicorn's event loop (no signal handlers of its own): handlers tokenize, hand
  requests to the engine thread through the session's external queue, and stream tokens back;
- the engine thread steps a serving Session (`Session(serving=True)`): a plain thread that sleeps on
  the session's submission event when idle, or, with the dashboard, the dashboard's engine worker
  (LiveSource), so the dashboard shows the served engine live;
- the main thread loads the model (uvicorn answers /health with 503 meanwhile), then waits for Ctrl-C
  / SIGTERM (or runs the dashboard). Stopping: take no new requests, stop the session (in-flight
  requests are aborted and their clients get finish_reason "abort"; the reference checks still
  waiting are skipped and counted), write the recording's summary, stop uvicorn. Each wait is
  bounded, so a stop never hangs.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
import traceback

import uvicorn

from kvtui.serve.app import ServeContext, ServerState, create_app
from kvtui.serve.bridge import EngineBridge
from kvtui.serve.metrics import ServeMetrics
from kvtui.serve.options import ServeOptions, serve_budget

# where a scenario field comes from on the command line, for error messages
FLAGS = {"engine.kv": "--kv", "engine.block_size": "--block-size", "engine.prefix_caching": "--prefix-caching",
         "engine.kv_offload_blocks": "--kv-offload-blocks",
         "engine.slots": "--slots", "engine.max_len": "--max-len", "engine.max_batch_size": "--max-batch-size",
         "engine.max_tokens_per_step": "--max-tokens-per-step", "engine.layout": "--layout",
         "engine.max_waiting": "--max-waiting", "model": "--model", "dtype": "--dtype", "engine": "engine"}


def serve_scenario(options: ServeOptions):
    """The Scenario a served session runs under: the model and engine knobs; its arrivals are unused
    (requests come from HTTP clients).

    Raises:
        ValueError: one line naming the flag at fault (a pool that does not fit in memory, a max_len the
            model cannot serve, ...).
    """
    import pydantic

    from kvtui.scenario import Scenario

    engine = {"slots": options.slots, "max_len": options.max_len, "max_batch_size": options.max_batch_size,
              "max_tokens_per_step": options.max_tokens_per_step or serve_budget(options.max_batch_size),
              "layout": options.layout, "max_waiting": options.max_waiting, "kv": options.kv, **options.extra}
    if options.kv == "paged":
        engine.update(block_size=options.block_size, prefix_caching=options.prefix_caching)
    if options.kv_offload_blocks:
        engine.update(kv_offload_blocks=options.kv_offload_blocks)
    try:
        return Scenario.model_validate({
            "name": "kvtui serve", "description": "requests from HTTP clients (OpenAI API)", "model": options.model,
            "dtype": options.dtype, "max_requests": 1, "engine": engine})
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        cause = (first.get("ctx") or {}).get("error")
        where = ".".join(str(p) for p in (*first["loc"], *getattr(cause, "subpath", ())))
        raise ValueError(f"{FLAGS.get(where, where or 'engine')}: {first['msg'].removeprefix('Value error, ')}") \
            from None


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) and listening, as uvicorn would bind it (SO_REUSEADDR, so a
    port in TIME_WAIT is taken; port 0: a free one).

    Raises:
        OSError: the host does not resolve, or the address cannot be bound (e.g. "Address already in use").
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


class ServeServer:
    """One `kvtui serve` in this process (tests start several, each on its own port).

    Args:
        options: ServeOptions (port 0 binds a free port; `.port` says which).
        load: loads the model from options (default: kvtui.models.load_model); tests pass a slow one.

    Use: start_http() (503 while loading), load(), then start_engine() (or run the dashboard), and
    stop(). As a context manager it does all of them.
    """

    def __init__(self, options: ServeOptions, *, load=None, warn=None) -> None:
        self.options = options
        self.warn = warn or _warn
        self.state = ServerState()
        self.app = create_app(self.state, api_key=options.api_key, max_request_bytes=options.max_request_bytes,
                              runtime_lora=options.allow_runtime_lora_updating)
        from kvtui.faults import server_faults

        self.bridge = EngineBridge(server_faults(options.faults))
        self._load = load or _load_model
        self.loaded = None
        self.metrics: ServeMetrics | None = None
        self.adapters = None  # the LoRA adapters served (serve/lora.py ServedAdapters), once loaded
        self._lora_info = None  # vllm:lora_requests_info (serve/lora.py LoraInfoGauge) when LoRA is on
        self.session = None
        self.summary = None
        self.error: BaseException | None = None
        self._http: uvicorn.Server | None = None
        self._http_thread: threading.Thread | None = None
        self._engine_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._port = 0

    # -- HTTP ---------------------------------------------------------------------------------------
    def start_http(self, timeout_s: float = 30.0) -> None:
        """Bind the address, then start uvicorn on that socket in a background thread and wait until it
        serves. kvtui binds it itself, so an address in use is one OSError here and uvicorn, which
        would log its own error line first, never tries.

        Raises:
            OSError: the address cannot be bound (in use, not permitted), its strerror saying which.
        """
        sock = listening_socket(self.options.host, self.options.port)
        config = uvicorn.Config(self.app, host=self.options.host, port=self.options.port, log_level="warning",
                                access_log=False, lifespan="off", timeout_graceful_shutdown=5)
        self._http = uvicorn.Server(config)
        self._http_thread = threading.Thread(target=self._http.run, kwargs={"sockets": [sock]},
                                             name="kvtui-serve-http", daemon=True)
        self._http_thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._http.started:
            if not self._http_thread.is_alive() or time.monotonic() > deadline:
                sock.close()
                raise OSError(f"cannot serve on {self.options.host}:{self.options.port}")
            time.sleep(0.01)
        self._port = sock.getsockname()[1]

    @property
    def port(self) -> int:
        """The bound TCP port (known once start_http returned)."""
        return self._port

    @property
    def url(self) -> str:
        """e.g. http://127.0.0.1:8000 (no /v1)."""
        return f"http://{self.options.host}:{self.port}"

    # -- model and session --------------------------------------------------------------------------
    @property
    def engine_faults(self) -> tuple[str, ...]:
        """The --fault names that act in the engine; the others (scope "server": request_id_keyed) act in
        the bridge, which the constructor set up with them."""
        from kvtui.faults import server_faults

        return tuple(n for n in self.options.faults if n not in server_faults(self.options.faults))

    def check(self) -> None:
        """What load() checks before it reads any weights: the fault names and where they act, the engine
        values, the --lora-modules folders and LoRA against --enforce-eager / --batch-invariant
        (config.py lora_mode_problem, as `kvtui run` asks it), the model's name or path (when the
        default loader loads it).

        Raises:
            ValueError: a bad engine value or fault name; kvtui.models.ModelLoadError: an unknown model
                or one that is not installed.
        """
        self._checked_scenario()
        from kvtui.config import lora_mode_problem
        from kvtui.serve.lora import check_modules

        check_modules(self.options.lora_modules)
        problem = self.lora_enabled and lora_mode_problem(enforce_eager=self.options.enforce_eager,
                                                          batch_invariant=bool(self.options.batch_invariant))
        if problem:  # before any weights load: the flags alone decide it
            flag = "--enforce-eager" if self.options.enforce_eager else "--batch-invariant"
            raise ValueError(f"{self._lora_flag}: {problem}: drop {flag}")
        if self._load is _load_model:
            from kvtui.models import check_model_available

            check_model_available(self.options.model)

    def _checked_scenario(self):
        """The serving scenario the options make, once its faults can act in its engine (ValueError if not)."""
        from kvtui.faults import check_fault_names, fault_misfit

        check_fault_names(self.options.faults)
        from kvtui.models.registry import kind_of

        self._refuse_model_misfit(kind_of(self.options.model))
        scenario = serve_scenario(self.options)
        engine = scenario.engine  # the flags and any extra engine fields, as the session will run them
        for name in self.engine_faults:  # a fault that cannot act here would never fire
            why = fault_misfit(name, engine.layout, engine.kv, engine.prefix_caching, bool(engine.kv_offload_blocks))
            if why:
                raise ValueError(f"--fault {name}: {why.removeprefix(f'fault {name} ')}, so it would never fire; "
                                 "`kvtui faults` lists where each fault acts (--layout, --kv, --prefix-caching "
                                 "and --kv-offload-blocks pick where)")
        return scenario

    def _refuse_model_misfit(self, kind) -> None:
        """ValueError (one line) for an engine --fault that does not act on a `kind` model (a ModelKind; None:
        not known yet, a model given by path before it loads): a state fault on an attention-only model, a
        non-state fault on a hybrid, an image fault on a text model. No setting makes such a fault act."""
        from kvtui.faults import kind_refusal

        problem = kind_refusal(self.engine_faults, kind, self.options.model)
        if problem:
            raise ValueError(problem)

    def load(self) -> None:
        """Load the model and prepare the serving session's factory (the session itself is made by
        `start_engine` or the dashboard).

        Raises:
            ValueError: a bad engine value or fault/detector name; kvtui.models.ModelLoadError.
        """
        self.scenario = self._checked_scenario()
        self.loaded = self._load(self.options)
        self._refuse_model_misfit(getattr(self.loaded, "kind", None))  # a model given by path: known now
        paged = self.scenario.engine.kv == "paged"
        self.metrics = ServeMetrics(self.options.served_model_name or self.loaded.model_id,
                                    block_size=self.scenario.engine.block_size if paged else None,
                                    prefix_caching=paged and self.scenario.engine.prefix_caching)
        self._load_adapters()

    @property
    def lora_enabled(self) -> bool:
        """--enable-lora, or adapters given with --lora-modules."""
        return self.options.enable_lora or bool(self.options.lora_modules)

    @property
    def _lora_flag(self) -> str:
        """The flag that turned LoRA on, for error lines."""
        return "--lora-modules" if self.options.lora_modules else "--enable-lora"

    def _load_adapters(self) -> None:
        """With LoRA on: check the model can run adapters and read the --lora-modules adapters (making the
        built-in local ones). Raises ValueError (one line naming the flag)."""
        from kvtui.engine.lora import lora_problem
        from kvtui.serve.lora import LoraInfoGauge, ServedAdapters, read_adapter

        self.adapters = ServedAdapters(self.metrics.model_name, self.lora_enabled)
        if not self.lora_enabled:
            return
        problem = lora_problem(self.loaded.model, enforce_eager=self.options.enforce_eager,
                               batch_invariant=bool(self.options.batch_invariant))
        if problem:
            raise ValueError(f"{self._lora_flag}: {problem}")
        for module in self.options.lora_modules:
            try:
                adapter, root = read_adapter(self.loaded, module.name, module.path)
            except ValueError as e:
                raise ValueError(f"--lora-modules {module.name}: {e}") from None
            self.adapters.add(module, adapter, root)
        self._lora_info = LoraInfoGauge(self.metrics.registry)

    def make_session(self, listener=None, generation: int = 0):
        """A serving Session wired to the bridge and the metrics (a LiveSource SessionFactory too);
        the server answers requests once it exists.

        Raises:
            ValueError: a bad engine value; OSError: the recording path.
        """
        from kvtui.record import restart_path
        from kvtui.session import build_session

        listeners = ((listener,) if listener else ()) + (self.bridge.on_event, self.metrics.on_event,
                                                         self._recording_failed)
        session = build_session(self.scenario, self.loaded, clock="wall", device=self.options.device,
                                record=restart_path(self.options.record, generation), faults=self.engine_faults,
                                detectors=self.options.detectors, listeners=listeners, serving=True,
                                enforce_eager=self.options.enforce_eager, batch_invariant=self._batch_invariant,
                                compile=self.options.compile)
        self.adapters.install_all(session.adapters)  # before the engine thread steps it
        self.session = session
        self.bridge.attach(session)
        self.state.context = ServeContext(self.bridge, self.metrics, self.loaded.tokenizer, session.engine.pool.max_len,
                                          self.metrics.model_name, self.loaded.model_id,
                                          getattr(self.loaded, "feature_extractor", None),
                                          self._embeds_spec(session.engine.pool.max_len),
                                          getattr(getattr(self.loaded, "image_encoder", None), "tokens", None),
                                          self.adapters, self.loaded)
        return session

    @property
    def _batch_invariant(self) -> bool | None:
        """--batch-invariant as given; left unset with LoRA on: off (adapters do not run in that mode, and
        its automatic choice would refuse every adapter request)."""
        if self.options.batch_invariant is None and self.lora_enabled:
            return False
        return self.options.batch_invariant

    def _embeds_spec(self, max_len: int):
        """The model's EmbedsSpec under --enable-prompt-embeds (None without it, or for a speech model)."""
        from kvtui.serve.embeds import EmbedsSpec

        if not self.options.enable_prompt_embeds or getattr(self.loaded, "feature_extractor", None) is not None:
            return None
        return EmbedsSpec.of(self.loaded.model, max_len)

    def _recording_failed(self, event) -> None:
        """Session listener: a failed write stopped the recording; say so once (serving goes on)."""
        from kvtui.events import RecordingFailed

        if isinstance(event, RecordingFailed):
            self.warn(f"{event.path}: recording stopped after {event.lines} lines: {event.error}; serving goes on "
                      "without it (counted in kvtui:recording_errors_total)")

    # -- engine thread (no dashboard) ---------------------------------------------------------------
    def start_engine(self) -> None:
        """Make the session and step it in a background thread until stop()."""
        session = self.make_session()
        self._engine_thread = threading.Thread(target=self._engine_loop, args=(session,), name="kvtui-serve-engine",
                                               daemon=True)
        self._engine_thread.start()

    def _engine_loop(self, session) -> None:
        if self.options.threads:
            import torch

            torch.set_num_threads(self.options.threads)
        from kvtui.engine import StepInterrupted

        try:
            while not self._stop.is_set():
                self._timed_step(session)
        except StepInterrupted:  # stop() cut the step in progress short: a stop, not an error
            pass
        except BaseException as e:  # a bug: say it, stop serving, still write the summary
            self.error = e
            traceback.print_exc()
        finally:
            self.bridge.close_intake()
            session.stop_requested = True
            self.summary = session.close()
            self._stop.set()

    def _timed_step(self, session) -> None:
        """session.step_once(), its wall and thread CPU time counted when it ran an engine step (not when
        it idled or ran reference checks): kvtui:engine_step_wait_seconds says how long the engine thread
        waited for the GIL or the CPU."""
        before, wall, cpu = session.engine.step_index, time.perf_counter(), time.thread_time()
        session.step_once()
        if session.engine.step_index != before:
            self.metrics.on_engine_step(time.perf_counter() - wall, time.thread_time() - cpu)
        if self._lora_info is not None:
            from kvtui.serve.lora import running_and_waiting

            self._lora_info.update(*running_and_waiting(session.engine), len(session.adapters.adapters))

    @property
    def engine_stopped(self) -> bool:
        """The engine thread ended (stop() or an error)."""
        return self._engine_thread is not None and not self._engine_thread.is_alive()

    # -- stop ------------------------------------------------------------------------------------------
    def stop(self, timeout_s: float = 60.0) -> None:
        """Take no new requests, abort what is in flight, write the summary, stop uvicorn. Bounded:
        returns within about `timeout_s` + 10 seconds whatever happens. Safe to call more than once.

        The step in progress is interrupted at its next layer and a reference check at its next step,
        so a stop under load takes well under a second, not the seconds a long prefill step or a batch
        of reference checks would; uvicorn stops listening at once and lets the open responses end
        (each gets its finish: "abort" for what was in flight)."""
        self.bridge.close_intake()
        self._stop.set()
        if self._http is not None:
            self._http.should_exit = True
        if self.session is not None and self._engine_thread is not None:
            self.session.stop_requested = True  # a reference check in progress stops at its next step
            self.session.engine.interrupt()  # a long step stops at its next layer (it would take seconds)
        if self._engine_thread is not None:
            self._engine_thread.join(timeout_s)
        self.stop_http()

    def stop_http(self, timeout_s: float = 10.0) -> None:
        """Stop uvicorn (open responses get up to 5 s to end) and wait for its thread."""
        if self._http is not None:
            self._http.should_exit = True
        if self._http_thread is not None:
            self._http_thread.join(timeout_s)
        self.state.close()

    def __enter__(self) -> ServeServer:
        self.start_http()
        try:
            self.load()
            self.start_engine()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def _warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr, flush=True)


def _load_model(options: ServeOptions):
    import torch

    from kvtui.engine.fused import choose_kernels_at_load
    from kvtui.models import load_model

    loaded = load_model(options.model, dtype=options.dtype, device=options.device, progress=options.progress)
    # the kernel choice now, announced before the server starts, and made with the threads the engine
    # thread will compute with (torch's thread count is per thread; the choice is kept per process)
    announce = (lambda line: print(f"note: {line}", file=sys.stderr, flush=True)) if options.progress else None
    previous = torch.get_num_threads()
    if options.threads:
        torch.set_num_threads(options.threads)
    try:
        choose_kernels_at_load(loaded.model, announce)
    finally:
        torch.set_num_threads(previous)
    return loaded
