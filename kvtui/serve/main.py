"""`kvtui serve` from the command line: start, load, serve until Ctrl-C / SIGTERM (or the dashboard's
q), stop cleanly. Bad input becomes BadInput (one line, exit 2 in the CLI)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvtui.models.labels import model_label
from kvtui.serve.server import ServeOptions, ServeServer


class BadInput(Exception):
    """A bad option, model or path: one line naming the flag and the fix."""


@dataclass(frozen=True)
class ServeResult:
    """How a serve ended: the session's Summary and Header (None if it never started), its
    contamination events, the engine thread's exception (None after a clean stop), and why the
    recording stopped early ("" when it is whole or there is none)."""

    summary: object = None
    header: object = None
    contamination: tuple = ()
    error: BaseException | None = None
    recording_error: str = ""


def _result(session, summary, error=None) -> ServeResult:
    if session is None:
        return ServeResult(error=error)
    return ServeResult(summary, session.header(), tuple(session.contamination), error, session.recording_error)


def run_serve(options: ServeOptions, *, dashboard: bool = False, note: Callable[[str], None] = print):
    """Serve until stopped; returns a ServeResult.

    Raises:
        BadInput: the address cannot be bound, the model cannot load, a bad engine value or recording path.
    """
    server = ServeServer(options)
    _check(server)  # a bad name or value is its one line, before anything starts or is said
    try:
        server.start_http()
    except OSError as e:
        raise BadInput(f"--host/--port: cannot listen on {options.host}:{options.port} ({e.strerror or e}); "
                       "check --host or choose another --port") from None
    try:
        from kvtui.models.hardware import bf16_note

        if bf16 := bf16_note(options.dtype, options.device):
            note(bf16)
        note(f"loading {model_label(options.model)}; {server.url}/health answers 503 until it is ready")
        _load(server)
        if dashboard:
            return _dashboard(server)
        return _plain(server, note)
    finally:
        server.stop()


def _check(server: ServeServer) -> None:
    """The options' cheap checks (server.check: fault names and fits, engine values, the model's name or
    path), as BadInput."""
    from kvtui.models import ModelLoadError

    try:
        server.check()
    except (ValueError, ModelLoadError) as e:
        raise BadInput(str(e)) from None


def _load(server: ServeServer) -> None:
    from kvtui.engine.runner import batch_invariant_problem
    from kvtui.models import ModelLoadError

    try:
        server.load()
    except (ValueError, ModelLoadError) as e:
        raise BadInput(str(e)) from None
    problem = server.options.batch_invariant and batch_invariant_problem(server.loaded.model,
                                                                         server.options.enforce_eager)
    if problem:
        raise BadInput(problem.replace("drop it (--batch-invariant, engine.batch_invariant)", "drop --batch-invariant"))


def _recording_error(server: ServeServer, e: OSError) -> BadInput:
    return BadInput(f"--record {server.options.record}: cannot write the recording ({e.strerror or e}); "
                    "choose another path")


def _plain(server: ServeServer, note: Callable[[str], None]):
    """Engine in a plain thread; the main thread waits for Ctrl-C / SIGTERM (a second one exits at once)."""
    stop = threading.Event()

    def on_signal(signum, frame):
        if stop.is_set():
            os._exit(130)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            server.start_engine()
        except OSError as e:
            raise _recording_error(server, e) from None
        note(f"decode steps: {server.session.engine.runner.compile_note}")
        note(f"decode attention: {server.session.engine.runner.attention_note}")
        if server.session.engine.runner.compiled is not None:  # its first compile, or its code from cache
            server.session.engine.runner.compiled.announce = note
        note(f"serving {server.metrics.model_name} at {server.url}/v1 (OpenAI API; /metrics, /health); "
             "Ctrl-C stops")
        while not stop.wait(0.2) and not server.engine_stopped:
            pass
        note("stopping: aborting requests in flight, writing the summary")
        server.stop()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return _result(server.session, server.summary, server.error)


def _dashboard(server: ServeServer):
    """The dashboard's engine worker steps the served session; uvicorn keeps serving in its thread."""
    from kvtui.tui.app import KvtuiApp
    from kvtui.tui.launch import default_torch_threads, run_app
    from kvtui.tui.live import LiveSource

    try:
        source = LiveSource(server.make_session, torch_threads=server.options.threads or default_torch_threads(),
                            interrupt_on_stop=True)  # q stops the engine as Ctrl-C does: the step in progress too
    except OSError as e:
        raise _recording_error(server, e) from None
    try:
        run_app(KvtuiApp(source), source)
    finally:
        server.bridge.close_intake()
        summary = source.shutdown()
        server.stop_http()
    return _result(source.session, summary)
