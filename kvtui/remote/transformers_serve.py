"""`transformers serve --continuous-batching` as scripts/serve-transformers.sh starts it: transformers' own
OpenAI-compatible server, serving kvtui's converted default model on the CPU. Found, started on a free port
and stopped, for the tests, the audits and the benchmark that run against it.

Two releases matter here. The benchmark's peer runs the transformers kvtui itself runs on (this Python's).
The tests that hold a finding run the release it was found on, `PINNED_VERSION`, which
scripts/install-transformers-serve.sh installs into a venv of its own under kvtui's cache: a server's
behaviour belongs to its release (5.24.0 keys continuous batching by the client's x-request-id and dies on
a duplicate; 5.25.0 keys it by ids of its own and does not), while kvtui moves on to newer releases.

The server runs in its own process group; stopping it sends SIGTERM to the group, then SIGKILL to
whatever is left after `stop_timeout_s` (a server whose batching worker died can stay up after SIGTERM,
held by a client connection that will never be answered).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvtui.models.default import cache_dir
from kvtui.remote.reach import listed_first, models_error
from kvtui.remote.vllm_cpu import SCRIPTS, DetachedServer, free_port

# The release the transformers serve tests pin (its findings: docs/findings.md); the default of
# scripts/install-transformers-serve.sh, which tests/remote/test_transformers_serve.py checks agrees.
PINNED_VERSION = "5.24.0"
# The first release whose continuous batching keys requests by ids of the server's own (transformers PR #48918
# targets the x-request-id collision): tests/remote/test_transformers_serve.py pins its clean audit too, from
# `scripts/install-transformers-serve.sh 5.25.0`'s venv.
FIXED_VERSION = "5.25.0"


def install_dir(version: str = PINNED_VERSION) -> Path:
    """Where scripts/install-transformers-serve.sh installs `version`: <kvtui cache>/transformers-serve/VERSION
    (venv/ and stamp.txt)."""
    return cache_dir() / "transformers-serve" / version


def pinned_python(version: str = PINNED_VERSION) -> Path:
    """The interpreter of the venv scripts/install-transformers-serve.sh made for `version` (it may not exist)."""
    return install_dir(version) / "venv" / "bin" / "python"


def find_pinned_transformers_serve(version: str = PINNED_VERSION) -> str | None:
    """Why transformers serve `version` cannot run here, or None when it can: the install's stamp naming
    that release, its venv's python, and what find_transformers_serve checks with it."""
    stamp = install_dir(version) / "stamp.txt"
    if not stamp.is_file() or not pinned_python(version).is_file():
        return (f"transformers serve {version} is not installed in {install_dir(version)}: run "
                f"scripts/install-transformers-serve.sh {version} (about 2 minutes)")
    if not stamp.read_text().startswith(f"transformers[serving]=={version} "):
        return (f"{stamp} names another release than transformers {version}: run "
                f"scripts/install-transformers-serve.sh {version} --force")
    return find_transformers_serve(str(pinned_python(version)),
                                   fix=f"scripts/install-transformers-serve.sh {version} --force")


def transformers_version(python: str = sys.executable) -> str | None:
    """The transformers release `python` imports (e.g. "5.25.0"), or None when it imports none."""
    probe = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('transformers'))"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        return None
    return probe.stdout.strip() or None


def find_transformers_serve(python: str = sys.executable, fix: str = "pip install -e '.[test]'") -> str | None:
    """Why transformers serve cannot run with `python` here, or None when it can: the script beside the
    sources, and transformers' serving package with fastapi, uvicorn and openai importable (`fix`: the
    command the reason names when they are not)."""
    if not (SCRIPTS / "serve-transformers.sh").is_file():
        return f"{SCRIPTS / 'serve-transformers.sh'} is missing (kvtui installed without its scripts/ folder)"
    probe = subprocess.run([python, "-c", "import transformers.cli.serving.server, fastapi, uvicorn, openai"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        return (f"transformers serve cannot run with {python} (it needs fastapi, uvicorn and openai): {fix} "
                f"({(probe.stderr.strip().splitlines() or ['?'])[-1]})")
    return None


class TransformersServer(DetachedServer):
    """scripts/serve-transformers.sh --detach for kvtui's default model, as a context manager.

    Args:
        port: TCP port (None: a free one). threads: OpenMP threads for the model.
        num_blocks / block_size: the continuous-batching KV cache (--cb-num-blocks, --cb-block-size).
        wait_s: how long to wait for /health. log: the server's output file (None: the script's default).
        model: a Hugging Face model folder (None: kvtui's converted default model).
        python: the interpreter whose transformers serves (default: this one, so the transformers kvtui runs
            on; pinned_python() for the release the tests pin).

    Attributes (after start): url (http://127.0.0.1:PORT), start_s (seconds the start took), model_name
    (what /v1/models lists: the model folder's path), version (the transformers release serving, e.g. "5.24.0").

    Raises (start):
        RuntimeError: it cannot run here, or the server did not become healthy (the script's message).
    """

    def __init__(self, *, port: int | None = None, threads: int = 1, num_blocks: int = 64, block_size: int = 16,
                 wait_s: int = 180, log: Path | None = None, model: str | Path | None = None,
                 python: str | Path = sys.executable, stop_timeout_s: float = 10.0) -> None:
        self.port = port or free_port()
        self.threads, self.num_blocks, self.block_size = threads, num_blocks, block_size
        self.wait_s, self.log, self.model, self.python = wait_s, log, model, str(python)
        self.stop_timeout_s = stop_timeout_s
        self.url = f"http://127.0.0.1:{self.port}"
        self.pgid: int | None = None
        self.model_name: str | None = None
        self.start_s: float | None = None
        self.version: str | None = None

    def start(self) -> None:
        """Run the script with --detach; returns once /health answers 200."""
        reason = find_transformers_serve(self.python)
        if reason:
            raise RuntimeError(reason)
        self.version = transformers_version(self.python)
        with tempfile.TemporaryDirectory() as tmp:
            pid_file = Path(tmp) / "pgid"
            args = ["bash", str(SCRIPTS / "serve-transformers.sh"), "--port", str(self.port), "--threads",
                    str(self.threads), "--num-blocks", str(self.num_blocks), "--block-size", str(self.block_size),
                    "--wait", str(self.wait_s), "--python", self.python, "--detach", "--pid-file", str(pid_file)]
            if self.log is not None:
                args += ["--log", str(self.log)]
            if self.model is not None:
                args += ["--model", str(self.model)]
            t0 = time.perf_counter()
            done = subprocess.run(args, capture_output=True, text=True, timeout=self.wait_s + 60)
            self.start_s = time.perf_counter() - t0
            if pid_file.is_file():
                self.pgid = int(pid_file.read_text().strip())
        if done.returncode != 0:
            self.stop()
            raise RuntimeError(f"transformers serve did not start (exit {done.returncode}): "
                               f"{(done.stderr or done.stdout).strip()[-2000:]}")
        import httpx

        response = httpx.get(f"{self.url}/v1/models", timeout=30)
        problem = models_error(response, self.url, None)
        if problem is not None:
            self.stop()
            raise RuntimeError(f"transformers serve started but {problem}")
        self.model_name = listed_first(response).get("id")
