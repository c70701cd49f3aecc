"""LoRA adapters in `kvtui serve`, as vLLM's OpenAI server serves them.

- `--lora-modules name=path` (repeatable; vLLM's JSON form `{"name", "path", "base_model_name"}` too) loads
  a peft LoRA folder at startup; `name` alone is one of kvtui's built-in local adapters (lora-a, lora-b,
  lora-c: kvtui/models/lora.py), made here for the served model, no network. `--enable-lora` turns LoRA
  on without startup adapters (for runtime loading); `--lora-modules` turns it on by itself.
- A request whose `model` is an adapter's name runs under it; the served model's name (or none) runs
  under none; any other name is vLLM's 404 (`The model \\`x\\` does not exist.`, type NotFoundError).
- `GET /v1/models` lists each adapter after the base model: id = its name, `root` = its folder,
  `parent` = the base model's served name (vLLM's ModelCard).
- `POST /v1/load_lora_adapter` {lora_name, lora_path, load_inplace} and `POST /v1/unload_lora_adapter`
  {lora_name}, vLLM's runtime LoRA updating: only with `--allow-runtime-lora-updating` or vLLM's
  environment variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (without it the routes do not exist: 404), as
  vLLM. Loading a loaded name again is vLLM's 400 unless `load_inplace` is true: then it is a reload, the
  adapter's next version (engine/lora.py AdapterRegistry), which requests submitted from then on run
  under; the prefix-cache key carries the version, so they never reuse the old version's blocks (unless
  the fault lora_reload_stale takes the version out of the key). A folder that cannot be run (a missing
  file, a bad adapter_config.json value, weights that are NaN, infinite or too large for the model's
  dtype: engine/lora_files.py) is a 400 naming the file and the field or tensor; anything unexpected is
  the request's JSON 500 (serve/jsonsafe.py), never a plain-text one.

Threads: a folder is read (and a local adapter made) in a tokenizing thread; the engine thread installs
it between two steps (the session intake's `call`, kvtui/run/intake.py), in order with the requests
queued before and after it, so a request sent after the load's answer runs under the new version and one
in flight keeps its own.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from kvtui.serve.protocol import ApiError

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch for the load/unload routes
INSTALL_TIMEOUT_S = 60.0  # the longest a load waits for the engine thread's step boundary


@dataclass(frozen=True)
class LoraModule:
    """One --lora-modules value: the adapter's name, its folder (None: a built-in local adapter) and the
    base model it is for (vLLM's base_model_name; None: the served model)."""

    name: str
    path: str | None = None
    base_model_name: str | None = None


def parse_lora_modules(values) -> tuple[LoraModule, ...]:
    """--lora-modules values as LoraModules: `name=path`, vLLM's JSON `{"name", "path", "base_model_name"}`,
    or a built-in name alone.

    Raises:
        ValueError: one line naming the value and the fix (an empty name or path, an unknown built-in name,
            bad JSON, a name given twice).
    """
    from kvtui.models.lora import BUILTIN_ADAPTERS

    out: list[LoraModule] = []
    for value in values or ():
        value = value.strip()
        if value.startswith("{"):
            module = _json_module(value)
        elif "=" in value:
            name, _, path = value.partition("=")
            if not name.strip() or not path.strip() or "=" in path:
                raise ValueError(f"--lora-modules {value}: give name=path (one '=', both non-empty), or a built-in "
                                 f"name alone ({', '.join(BUILTIN_ADAPTERS)})")
            module = LoraModule(name.strip(), path.strip())
        elif value in BUILTIN_ADAPTERS:
            module = LoraModule(value)
        else:
            raise ValueError(f"--lora-modules {value or repr(value)}: not a built-in adapter "
                             f"({', '.join(BUILTIN_ADAPTERS)}); give its folder as {value or 'name'}=path")
        if any(m.name == module.name for m in out):
            raise ValueError(f"--lora-modules: {module.name} is given twice; give each adapter one name")
        out.append(module)
    return tuple(out)


def _json_module(value: str) -> LoraModule:
    try:
        data = json.loads(value)
        module = LoraModule(**data)
    except (ValueError, TypeError) as e:
        raise ValueError(f"--lora-modules {value}: not vLLM's JSON form {{\"name\", \"path\", \"base_model_name\"}} "
                         f"({str(e).splitlines()[0]})") from None
    if not isinstance(module.name, str) or not module.name or not isinstance(module.path, str) or not module.path:
        raise ValueError(f"--lora-modules {value}: the JSON form needs a non-empty name and path")
    return module


def check_modules(modules: tuple[LoraModule, ...]) -> None:
    """The cheap startup check: each given folder exists. Raises ValueError (one line)."""
    for m in modules:
        if m.path is not None and not Path(m.path).expanduser().is_dir():
            raise ValueError(f"--lora-modules {m.name}={m.path}: no such folder; give a peft LoRA folder "
                             "(adapter_config.json + adapter_model.safetensors)")


def read_adapter(loaded, name: str, path: str | None):
    """Read adapter `name` for the served model (`loaded`): the peft folder `path`, or the built-in local
    adapter made for the model. Slow (disk, maybe peft): call off the event loop and the engine thread.

    Returns (LoraAdapter, its folder as /v1/models' `root` shows it). Raises ValueError (one line)."""
    from kvtui.engine.lora import load_adapter
    from kvtui.models.lora import resolve_adapter

    folder = resolve_adapter(loaded.model_id, loaded.model.config, name, None if path is None else
                             str(Path(path).expanduser()), None)
    return load_adapter(loaded.model, name, folder), str(path if path is not None else folder)


class ServedAdapters:
    """The adapters a server serves, as the HTTP side sees them: name -> (root, parent, LoraAdapter read),
    in load order. The engine side is each session's AdapterRegistry, which `install_all` fills for a new
    session and `load`/`unload` change between steps."""

    def __init__(self, base_name: str, enabled: bool) -> None:
        self.base_name, self.enabled = base_name, enabled
        self.cards: dict[str, tuple[str, str, object]] = {}
        self.lock = threading.Lock()
        self.changing: asyncio.Lock | None = None  # one load or unload at a time (made on the server's loop)

    def change_lock(self) -> asyncio.Lock:
        """The lock a runtime load or unload holds from its name check to its install, so two loads of one
        new name cannot both pass the check (the second gets vLLM's "already been loaded")."""
        if self.changing is None:
            self.changing = asyncio.Lock()
        return self.changing

    def add(self, module: LoraModule, adapter, root: str) -> None:
        parent = module.base_model_name or self.base_name
        with self.lock:
            self.cards[module.name] = (root, parent, adapter)

    def names(self) -> list[str]:
        with self.lock:
            return list(self.cards)

    def install_all(self, registry) -> None:
        """Install every adapter into a new session's registry (before its engine thread steps)."""
        with self.lock:
            adapters = [adapter for _, _, adapter in self.cards.values()]
        for adapter in adapters:
            registry.add(adapter)

    def model_cards(self, created: int) -> list[dict]:
        """/v1/models' adapter entries (vLLM's ModelCard of a LoRA: id, root = folder, parent = base)."""
        with self.lock:
            items = list(self.cards.items())
        return [{"id": name, "object": "model", "created": created, "owned_by": "kvtui", "root": root,
                 "parent": parent, "max_model_len": None} for name, (root, parent, _) in items]


def not_found(model: str) -> ApiError:
    """vLLM's 404 for a `model` the server does not serve (neither the base model nor an adapter)."""
    return ApiError(404, f"The model `{model}` does not exist.", param="model", code=404, kind="NotFoundError")


def running_and_waiting(engine) -> tuple[str, str]:
    """The adapter names of the engine's running and waiting requests, sorted and comma-joined (vLLM's
    vllm:lora_requests_info labels). Engine thread."""
    def names(requests) -> str:
        return ",".join(sorted({r.input.lora.name for r in requests if r.input.lora is not None}))

    return names(engine.scheduler.running), names(engine.scheduler.waiting)


class LoraInfoGauge:
    """vLLM's `vllm:lora_requests_info` gauge on a server's metrics registry: labels running_lora_adapters,
    waiting_lora_adapters and max_lora, value the Unix time of the last change. kvtui has no limit on the
    adapters of one batch; max_lora is the number of adapters loaded. Only the current label set is kept
    (vLLM keeps every past one; readers take the newest)."""

    def __init__(self, registry) -> None:
        from prometheus_client import Gauge

        self.gauge = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                           ("running_lora_adapters", "waiting_lora_adapters", "max_lora"), registry=registry)
        self.labels: tuple[str, str, str] | None = None

    def update(self, running: str, waiting: str, loaded: int) -> None:
        labels = (running, waiting, str(loaded))
        if labels != self.labels:
            self.gauge.clear()
            self.gauge.labels(*labels).set(time.time())
            self.labels = labels


# -- runtime loading (POST /v1/load_lora_adapter, /v1/unload_lora_adapter) -----------------------------
class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = ""
    lora_int_id: int | None = None


def _user_error(message: str) -> ApiError:
    return ApiError(400, message, code=400, kind="InvalidUserInput")


async def load_lora(ctx, body: LoadLoRAAdapterRequest, off_loop) -> str:
    """Load (or with load_inplace reload) an adapter: read off the loop, install between engine steps, one
    load or unload at a time. Returns vLLM's success text. Raises ApiError as vLLM answers (400
    InvalidUserInput / BadRequestError)."""
    async with ctx.adapters.change_lock():
        return await _load(ctx, body, off_loop)


async def _load(ctx, body: LoadLoRAAdapterRequest, off_loop) -> str:
    served: ServedAdapters = ctx.adapters
    if not served.enabled:
        raise ApiError(400, "LoRA is not enabled on this server: start it with --enable-lora", code=400,
                       kind="BadRequestError")
    if not body.lora_name or not body.lora_path:
        raise _user_error("Both 'lora_name' and 'lora_path' must be provided.")
    if body.lora_name in (ctx.model_name, ctx.model_id):
        raise _user_error(f"'{body.lora_name}' is the base model's name; give the adapter another name.")
    if body.lora_name in served.names() and not body.load_inplace:
        raise _user_error(f"The lora adapter '{body.lora_name}' has already been loaded. If you want to load the "
                          "adapter in place, set 'load_inplace' to True.")
    try:
        adapter, root = await off_loop(read_adapter, ctx.loaded, body.lora_name, body.lora_path)
    except ValueError as e:  # every bad folder, file, config value or weight (engine/lora_files.py): one line
        raise ApiError(400, str(e), param="lora_path", code=400, kind="BadRequestError") from None
    installed = await _in_engine(ctx, lambda registry: registry.add(adapter))
    served.add(LoraModule(body.lora_name, body.lora_path), installed, root)
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


async def unload_lora(ctx, body: UnloadLoRAAdapterRequest) -> str:
    """Unload an adapter (requests already submitted keep it). Raises ApiError 400/404 as vLLM."""
    served: ServedAdapters = ctx.adapters
    if not body.lora_name:
        raise _user_error("'lora_name' needs to be provided to unload a LoRA adapter.")
    async with served.change_lock():
        if body.lora_name not in served.names():
            raise ApiError(404, f"The lora adapter '{body.lora_name}' cannot be found.", code=404,
                           kind="NotFoundError")
        await _in_engine(ctx, lambda registry: registry.remove(body.lora_name))
        with served.lock:
            served.cards.pop(body.lora_name, None)
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."


async def _in_engine(ctx, fn):
    """fn(the session's AdapterRegistry) in the engine thread between two steps. ApiError 503 when no
    session takes it (stopping) within INSTALL_TIMEOUT_S."""
    from kvtui.serve.bridge import NotAccepting

    try:
        future = ctx.bridge.call_in_engine(lambda session: fn(session.adapters))
        return await asyncio.wait_for(asyncio.wrap_future(future), INSTALL_TIMEOUT_S)
    except (NotAccepting, asyncio.TimeoutError):
        raise ApiError(503, "the server is not taking requests (loading or stopping)", code="unavailable") from None


def add_lora_routes(app, state) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's plain-text 200 answers)."""
    from fastapi.responses import Response

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        ctx = state.ready()
        return Response(await load_lora(ctx, body, state.off_loop), status_code=200)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        return Response(await unload_lora(state.ready(), body), status_code=200)
