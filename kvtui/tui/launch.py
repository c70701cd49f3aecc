"""Entry points for the CLI: `run_dashboard` (kvtui run without --headless) and `replay_dashboard`
(kvtui replay without --summary).

Everything that can fail on bad input (scenario, model, recording path) runs before Textual takes
the terminal, so errors reach the caller as ordinary exceptions and the terminal stays intact.
"""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

# CPU cores kept free of torch's intra-op (OpenMP) threads while the dashboard runs, for the UI
# thread. On 2 cores, 2 OpenMP threads plus any other busy thread slow a step 10-30x (measured).
# Measured (2 cores, other load present, virtual clock, engine tokens per second of
# step time): SmolLM2 8 x 24 tokens: headless 1 thread 138-152, dashboard 1 thread 136-148 (98%),
# headless 2 threads 4-12; tiny-llama (pure-Python steps of ~3 ms, the worst case for sharing the
# GIL with the UI): headless 3216-3534, dashboard 1986-2258 (63%).
UI_CORES = 1


def default_torch_threads() -> int:
    """Torch threads for the engine worker: torch's default, capped so UI_CORES cores stay free
    (at least 1)."""
    import torch

    return max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) - UI_CORES))


def run_dashboard(scenario_path: str | Path, *, model: str | None = None, dtype: str | None = None,
                  clock: str = "wall", record: str | Path | None = None, layout: str | None = None,
                  device: str = "cpu", faults: tuple[str, ...] | list[str] = (),
                  detectors: tuple[str, ...] | None = None, clear_faults: bool = False, progress: bool = True,
                  torch_threads: int | None = None, cost_model: str = "auto", on_closed=None,
                  enforce_eager: bool = False, batch_invariant: bool | None = None, compile: bool | None = None,
                  on_signal=None):
    """Run a scenario live in the dashboard until `q` (or the terminal closes).

    Args:
        scenario_path: scenario YAML.
        model, dtype: override the scenario's model / dtype (e.g. "tiny-llama", "bfloat16").
        clock: "wall" (real time, the default here), "paced" (the virtual clock held to real time) or
            "virtual" (modeled time, as fast as the engine goes).
        record: JSONL recording path; a restart (`r`) records to NAME.restartN.jsonl.
        layout: "padded" or "packed" to override the scenario's engine layout.
        device: torch device.
        faults: faults on from the start (added to the scenario's); clear_faults: drop the scenario's.
        detectors: which detectors run (None: all).
        progress: show model-loading progress on stderr.
        torch_threads: torch.set_num_threads for the engine worker (None: default_torch_threads()).
            It is process-wide: the dashboard process runs nothing else on torch.
        on_closed: called with the last Session once it closed (the CLI reads its recording_error).
        enforce_eager: transformers' own modules instead of kvtui's fused forward.
        batch_invariant: overrides the scenario's engine.batch_invariant when given.
        compile: the compiled decode step (EngineConfig.compile; None: where it can run).
        on_signal: called with the signal number when SIGTERM or SIGINT stopped the dashboard (after the
            session closed and wrote its summary); the CLI exits 128 + that number.

    Returns:
        (summary, header) of the last session: kvtui.events.Summary (None if it never closed cleanly)
        and its Header.

    Raises:
        kvtui.scenario.ScenarioError, kvtui.models.ModelLoadError, OSError (recording path),
        ValueError (bad clock/layout/fault/detector): all before the terminal is taken over.
    """
    from kvtui.detect import DETECTOR_NAMES
    from kvtui.faults import check_fault_names
    from kvtui.models import check_model_available, load_model
    from kvtui.models.labels import model_label
    from kvtui.record import check_unlocked, restart_path
    from kvtui.scenario import load_scenario
    from kvtui.session import build_session
    from kvtui.tui.app import KvtuiApp
    from kvtui.tui.live import LiveSource

    if clock not in ("wall", "paced", "virtual"):
        raise ValueError(f"clock {clock!r}: use 'wall', 'paced' or 'virtual'")
    check_fault_names(faults)
    scenario = load_scenario(scenario_path)
    name = model or scenario.model
    check_model_available(name)
    if record is not None:
        check_writable(Path(record))
        check_unlocked(record)
    loaded: list = []

    def prepare() -> None:
        loaded.append(load_model(name, dtype=dtype or scenario.dtype, device=device, progress=False))

    def make_session(listener, generation: int):
        return build_session(scenario, loaded[0], clock=clock, record=restart_path(record, generation), device=device,
                             layout=layout, faults=tuple(faults), clear_faults=clear_faults,
                             detectors=DETECTOR_NAMES if detectors is None else tuple(detectors),
                             listeners=(listener,), cost_model=cost_model, enforce_eager=enforce_eager,
                             batch_invariant=batch_invariant, compile=compile)

    source = LiveSource(make_session, prepare=prepare, loading_text=f"loading the model ({model_label(name)})…",
                        torch_threads=torch_threads or default_torch_threads())
    signum = run_app(KvtuiApp(source), source)
    summary = source.shutdown()
    if source.error is not None:
        raise source.error
    if on_closed is not None:
        on_closed(source.session)
    if signum is not None and on_signal is not None:
        on_signal(signum)
    return summary, source.session.header()


def check_writable(path: Path) -> None:
    """Raise OSError now (before the terminal is taken) when a recording cannot be created at `path`:
    its folder cannot be made, the file cannot be opened for appending, or it exists and is not a
    regular file (a device such as /dev/full takes the open and fails at the first line, and a
    recording written to /dev/null would be lost)."""
    if path.exists() and not path.is_file():
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    existed = path.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8"):
        pass
    if not existed:
        path.unlink()


def replay_dashboard(recording_path: str | Path, *, speed: float = 1.0) -> None:
    """Play a recording in the dashboard (no model loaded) until `q`.

    Raises:
        kvtui.record.RecordingError: the file cannot be read (before the terminal is taken over).
        ValueError: speed <= 0.
    """
    from kvtui.tui.app import KvtuiApp
    from kvtui.tui.replay import ReplaySource

    if speed <= 0:
        raise ValueError(f"{speed = } must be > 0")
    source = ReplaySource.from_file(recording_path, speed=speed)
    run_app(KvtuiApp(source), source)


def run_app(app, source) -> int | None:
    """app.run() with SIGTERM and SIGINT turned into a clean quit (the live session still writes its summary).

    Args:
        app: the KvtuiApp to run; source: its Source (kvtui/tui/sources.py), whose `request_stop` a signal calls.

    Returns:
        the number of the signal that stopped it, or None when it ended otherwise (q).
    """
    caught: list[int] = []

    def on_signal(signum, frame):
        caught.append(signum)
        source.request_stop()
        app.call_later(app.exit)

    previous = {}
    for signum in (signal.SIGTERM, signal.SIGINT):
        try:
            previous[signum] = signal.signal(signum, on_signal)
        except ValueError:  # not the main thread
            pass
    try:
        app.run()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return caught[0] if caught else None
