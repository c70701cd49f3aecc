"""LoRA adapters in `kvtui serve` (kvtui/serve/lora.py), on tiny-llama: a request's `model` selects the adapter
and gets peft's merged model's greedy tokens (a separate instance), the base name gets the base answer,
/v1/models lists the adapters with their parent, an unknown model is vLLM's 404, runtime loading reloads an
adapter as a new version whose requests never reuse the old version's cached blocks (but do under the fault
lora_reload_stale, which the detectors then report), vllm:lora_requests_info, and bad startup input in one
line."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from test_lora import _oracle

from kvtui.models.lora import local_adapter
from kvtui.serve.lora import LoraModule, parse_lora_modules
from kvtui.serve.server import ServeOptions, ServeServer

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13] * 3  # 27 tokens: 6 full blocks of 4
OTHER = [20, 21, 22, 23] * 5
NEW = 8


def _options(**kw) -> ServeOptions:
    return ServeOptions(model="tiny-llama", port=0, slots=4, max_len=128, kv="paged", block_size=4,
                        prefix_caching=True, lora_modules=(LoraModule("lora-a"), LoraModule("lora-b")),
                        allow_runtime_lora_updating=True, detectors=("prefix_provenance", "reference"), **kw)


def _collect(server: ServeServer) -> ServeServer:
    """Keep the engine's Finish events (request id -> output token ids) on `server.finished`."""
    from kvtui.events import Finish

    server.finished = {}
    server.session.listeners.append(
        lambda e: server.finished.__setitem__(e.request_id, list(e.output_ids)) if isinstance(e, Finish) else None)
    return server


@pytest.fixture(scope="module")
def server():
    with ServeServer(_options()) as running:
        yield _collect(running)


def complete(server: ServeServer, model: str | None, prompt: list[int]) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True}
    if model is not None:
        body["model"] = model
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120)


def ids(server: ServeServer, response: httpx.Response) -> list[int]:
    """The token ids the engine sampled for a whole (non-streamed) response. The session's listeners see the
    request's Finish event after the step that ends it, which can be after the response went out: wait."""
    assert response.status_code == 200, response.text
    rid, deadline = response.json()["id"], time.monotonic() + 30
    while rid not in server.finished:
        assert time.monotonic() < deadline, f"no Finish event for {rid}"
        time.sleep(0.01)
    return server.finished[rid]


def cached(response: httpx.Response) -> int:
    return (response.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def folder(server: ServeServer, name: str) -> Path:
    return Path(server.adapters.cards[name][0])


def test_the_model_field_selects_the_adapter_and_matches_peft_merged_generate(server):
    """Four requests at once (a mixed batch: lora-a, lora-b, the base by its name, an unknown model): each
    adapter's answer is peft's merged model's greedy generate on a separate instance, the base's is the
    base model's, and the unknown model's 404 leaves the others alone."""
    asks = [("lora-a", PROMPT), ("lora-b", OTHER), ("tiny-llama", OTHER), ("nope", PROMPT)]
    with ThreadPoolExecutor(len(asks)) as pool:
        answers = list(pool.map(lambda a: complete(server, *a), asks))
    assert answers[3].status_code == 404
    assert answers[3].json() == {"error": {"message": "The model `nope` does not exist.", "type": "NotFoundError",
                                           "param": "model", "code": 404}}
    assert [a.json()["model"] for a in answers[:3]] == ["lora-a", "lora-b", "tiny-llama"]  # vLLM's: the adapter
    for (name, prompt), answer in zip(asks[:3], answers[:3]):
        path = None if name == "tiny-llama" else folder(server, name)
        assert ids(server, answer) == _oracle("tiny-llama", path, prompt, NEW), name
    assert _oracle("tiny-llama", folder(server, "lora-a"), PROMPT, NEW) != _oracle("tiny-llama", None, PROMPT, NEW)


def test_a_served_requests_arrive_event_names_its_adapter(server):
    from kvtui.events import Arrive

    seen = []
    listener = lambda e: seen.append(e) if isinstance(e, Arrive) else None  # noqa: E731
    server.session.listeners.append(listener)
    by_model = {model: complete(server, model, OTHER).json()["id"] for model in ("lora-a", None)}
    server.session.listeners.remove(listener)
    lora = {e.request_id: e.lora for e in seen}
    assert (lora[by_model["lora-a"]], lora[by_model[None]]) == ("lora-a", None)


def test_models_lists_the_adapters_with_their_parent(server):
    data = httpx.get(server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["tiny-llama", "lora-a", "lora-b"]
    for card in data[1:]:
        assert card["parent"] == "tiny-llama" and Path(card["root"]).is_dir() and card["object"] == "model"
    one = httpx.get(server.url + "/v1/models/lora-b").json()
    assert one["id"] == "lora-b" and one["parent"] == "tiny-llama"
    assert httpx.get(server.url + "/v1/models/x").json()["error"]["type"] == "NotFoundError"


def test_metrics_publish_lora_requests_info(server):
    complete(server, "lora-a", OTHER)
    text = httpx.get(server.url + "/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="2"' in line and "running_lora_adapters=" in line and "waiting_lora_adapters=" in line


def _reload(server: ServeServer, name: str, path: Path, inplace: bool = True) -> httpx.Response:
    return httpx.post(server.url + "/v1/load_lora_adapter", timeout=120,
                      json={"lora_name": name, "lora_path": str(path), "load_inplace": inplace})


def test_a_reload_is_a_new_version_whose_requests_do_not_reuse_the_old_blocks(server):
    prompt = [60, 61, 62, 63, 64, 65, 66, 67] * 3
    first, again = complete(server, "lora-b", prompt), complete(server, "lora-b", prompt)
    assert (cached(first), cached(again)) == (0, 20)  # one adapter version: its own blocks are reused
    new = local_adapter("tiny-llama", server.loaded.model.config, "lora-b", 77)
    refused = _reload(server, "lora-b", new, inplace=False)
    assert refused.status_code == 400 and refused.json()["error"]["type"] == "InvalidUserInput"
    assert "load_inplace" in refused.json()["error"]["message"]
    loaded = _reload(server, "lora-b", new)
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'lora-b' added successfully."
    assert server.session.adapters.get("lora-b").version == 2
    after = complete(server, "lora-b", prompt)
    assert cached(after) == 0
    assert ids(server, after) == _oracle("tiny-llama", new, prompt, NEW)
    assert not [e for e in server.session.contamination if e.detector == "prefix_provenance"]


def test_runtime_load_and_unload_of_a_new_adapter(server):
    path = local_adapter("tiny-llama", server.loaded.model.config, "lora-x", 5)
    assert _reload(server, "lora-x", path, inplace=False).status_code == 200
    assert complete(server, "lora-x", OTHER).json()["model"] == "lora-x"
    gone = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "lora-x"})
    assert gone.status_code == 200 and gone.text == "Success: LoRA adapter 'lora-x' removed successfully."
    assert complete(server, "lora-x", OTHER).status_code == 404
    again = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "lora-x"})
    assert again.status_code == 404 and again.json()["error"]["type"] == "NotFoundError"
    bad = _reload(server, "lora-y", ROOT / "no-such-folder", inplace=False)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"


def test_two_loads_of_one_new_name_at_once_load_it_once(server, monkeypatch):
    """Both pass the name check only if the check and the install are not one step: then the second would
    install version 2. One of them must get vLLM's "already been loaded" and the adapter stay at version 1.
    Reading the adapter is slowed to 0.5 s so that both requests are inside the load at once."""
    import kvtui.serve.lora as served_lora

    read = served_lora.read_adapter
    monkeypatch.setattr(served_lora, "read_adapter", lambda *args: (time.sleep(0.5), read(*args))[1])
    path = local_adapter("tiny-llama", server.loaded.model.config, "lora-race", 9)
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: _reload(server, "lora-race", path, inplace=False), range(2)))
    assert sorted(a.status_code for a in answers) == [200, 400]
    refused = next(a for a in answers if a.status_code == 400).json()["error"]
    assert refused["type"] == "InvalidUserInput" and "has already been loaded" in refused["message"]
    assert server.session.adapters.get("lora-race").version == 1
    assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "lora-race"}).status_code == 200


def test_under_lora_reload_stale_the_reloaded_adapter_reuses_the_old_blocks_and_is_reported():
    with ServeServer(_options(faults=("lora_reload_stale",))) as server:
        assert cached(complete(server, "lora-a", PROMPT)) == 0
        new = local_adapter("tiny-llama", server.loaded.model.config, "lora-a", 77)
        assert _reload(server, "lora-a", new).status_code == 200
        stale = complete(server, "lora-a", PROMPT)
        assert cached(stale) == 24  # the old version's blocks, under the new version's key
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not [e for e in server.session.contamination
                                                   if e.detector == "reference"]:
            time.sleep(0.2)
        found = {e.detector for e in server.session.contamination}
        assert {"prefix_provenance", "reference"} <= found, found


def test_the_runtime_routes_exist_only_when_allowed(tiny):
    server = ServeServer(ServeOptions(model="tiny-llama", port=0, enable_lora=True, detectors=()),
                         load=lambda options: tiny["tiny-llama"])
    with server:
        r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
        assert r.status_code == 404
        assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "tiny-llama"


# -- bad startup input -------------------------------------------------------------------------------
@pytest.mark.parametrize("values,fragment", [(["lora-z"], "not a built-in adapter"), (["a="], "name=path"),
                                              (["=p"], "name=path"), (["a=b=c"], "name=path"),
                                              (["lora-a", "lora-a=/x"], "given twice"), (["{nope"], "JSON")])
def test_bad_lora_modules_values_are_one_line(values, fragment):
    with pytest.raises(ValueError) as e:
        parse_lora_modules(values)
    assert fragment in str(e.value) and "\n" not in str(e.value)
    assert parse_lora_modules(['{"name": "n", "path": "/p", "base_model_name": "b"}']) == \
        (LoraModule("n", "/p", "b"),)


def test_a_missing_folder_and_a_model_without_adapters_are_one_line(tiny, tmp_path):
    with pytest.raises(ValueError, match=r"^--lora-modules x=.*: no such folder"):
        ServeServer(ServeOptions(model="tiny-llama", port=0, lora_modules=(LoraModule("x", str(tmp_path / "no")),))
                    ).check()
    cases = [("tiny-gpt2", {}, "Llama-family"), ("tiny-llama", {"enforce_eager": True}, "drop --enforce-eager")]
    for model, extra, fragment in cases:
        server = ServeServer(ServeOptions(model=model, port=0, lora_modules=(LoraModule("lora-a"),), **extra),
                             load=lambda options, m=model: tiny[m])
        with pytest.raises(ValueError) as e:
            server.load()
        assert str(e.value).startswith("--lora-modules: ") and fragment in str(e.value)


def test_the_command_refuses_a_bad_lora_module_in_one_line():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "kvtui.cli", "serve", "--model", "tiny-llama", "--port", "0",
                        "--lora-modules", "a=b=c"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and r.stderr.startswith("error: --lora-modules a=b=c")


def test_a_lora_path_that_is_no_folder_is_refused_without_a_download(tiny):
    """A runtime lora_path like `org/name` is no folder here; peft would take it for a hub id."""
    from kvtui.serve.lora import read_adapter

    with pytest.raises(ValueError, match="no folder .*nothing is downloaded"):
        read_adapter(tiny["tiny-llama"], "hub", "someorg/some-adapter")


def test_an_adapter_unloaded_after_its_request_came_in_is_vllms_404():
    """The race of an unload between the HTTP side's check and the engine's submit, made certain: the
    engine side no longer has lora-b while the HTTP side still lists it. The request gets vLLM's 404 body
    (it was a 500 internal_error), and the server serves the next request as before."""
    with ServeServer(_options()) as running:
        running.session.adapters.remove("lora-b")
        gone = complete(running, "lora-b", PROMPT)
        assert gone.status_code == 404, gone.text
        assert gone.json() == {"error": {"message": "The model `lora-b` does not exist.", "type": "NotFoundError",
                                         "param": "model", "code": 404}}
        assert complete(running, "lora-a", PROMPT).status_code == 200


# -- bad adapters at runtime and at startup: a 400 naming the file and the field, the connection kept ----------
def _bad_folder(server: ServeServer, tmp_path: Path, name: str, config=None, weights=None) -> Path:
    """A copy of the served lora-a folder with adapter_config.json changed by `config` (a dict updater) and
    the weights by `weights` (a state-dict updater)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / name
    shutil.copytree(folder(server, "lora-a"), bad)
    if config is not None:
        values = json.loads((bad / "adapter_config.json").read_text())
        config(values)
        (bad / "adapter_config.json").write_text(json.dumps(values))
    if weights is not None:
        state = load_file(bad / "adapter_model.safetensors")
        weights(state)
        save_file(state, bad / "adapter_model.safetensors")
    return bad


def test_bad_adapter_folders_are_400s_naming_the_field_on_a_connection_that_stays_open(server, tmp_path):
    """r: 0 and a string lora_alpha were a plain-text 500 (ZeroDivisionError, TypeError), a traceback and a reset
    connection; NaN weights loaded (200). Each is now vLLM's 400 BadRequestError naming the file and the field or
    tensor, and the same kept-alive connection goes on to a completion."""
    import http.client
    import json

    key = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
    cases = [
        (_bad_folder(server, tmp_path, "r0", config=lambda c: c.update(r=0)),
         "adapter_config.json: r must be a positive integer (the adapter's rank), got 0"),
        (_bad_folder(server, tmp_path, "alpha", config=lambda c: c.update(lora_alpha="16")),
         "adapter_config.json: lora_alpha must be a finite number, got \"16\""),
        (_bad_folder(server, tmp_path, "nan", weights=lambda s: s[key].__setitem__((0, 0), float("nan"))),
         f"adapter_model.safetensors: {key} holds NaN; an adapter's weights must be finite numbers"),
        (_bad_folder(server, tmp_path, "huge", weights=lambda s: [t.mul_(1e20) for t in s.values()]),
         "adapter_model.safetensors: layer 0 down_proj: lora_B @ lora_A x scaling (the weight delta peft's merge "
         "adds) overflows float32, the model's dtype: the adapter's weights are too large"),
    ]
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    for bad, message in cases:
        conn.request("POST", "/v1/load_lora_adapter", json.dumps({"lora_name": bad.name, "lora_path": str(bad)}),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert (response.status, response.getheader("content-type")) == (400, "application/json")
        assert json.loads(response.read()) == {"error": {"message": f"{bad}/{message}", "type": "BadRequestError",
                                                         "param": "lora_path", "code": 400}}
    served = {m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]}
    assert served & {bad.name for bad, _ in cases} == set()  # none of them loaded
    conn.request("POST", "/v1/completions", json.dumps({"model": "lora-a", "prompt": OTHER, "max_tokens": 2}),
                 {"Content-Type": "application/json"})
    assert conn.getresponse().status == 200


def test_an_unexpected_failure_of_a_load_is_a_json_500_and_the_server_goes_on(server, monkeypatch):
    import kvtui.serve.lora as served_lora

    def broken(*args):
        raise TypeError("unsupported operand type(s) for /: 'str' and 'int'")

    monkeypatch.setattr(served_lora, "read_adapter", broken)
    r = _reload(server, "lora-q", folder(server, "lora-a"), inplace=False)
    assert (r.status_code, r.json()) == (500, {"error": {
        "message": "internal error (TypeError: unsupported operand type(s) for /: 'str' and 'int'); this request alone "
                   "failed, the server goes on", "type": "server_error", "param": None, "code": "internal_error"}})
    monkeypatch.undo()
    assert _reload(server, "lora-q", folder(server, "lora-a"), inplace=False).status_code == 200  # the lock was freed
    assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "lora-q"}).status_code == 200


def test_the_openai_client_gets_the_adapters_400_and_then_its_answer(server, tmp_path):
    import openai

    bad = _bad_folder(server, tmp_path, "r-neg", config=lambda c: c.update(r=-1))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/load_lora_adapter", body={"lora_name": "neg", "lora_path": str(bad)}, cast_to=httpx.Response)
    assert caught.value.body == {"message": f"{bad}/adapter_config.json: r must be a positive integer (the adapter's "
                                            "rank), got -1", "type": "BadRequestError", "param": "lora_path", "code": 400}
    answer = client.completions.create(model="lora-b", prompt=OTHER, max_tokens=NEW, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert answer.model == "lora-b" and answer.usage.completion_tokens == NEW


def test_a_bad_startup_adapter_is_one_line_naming_the_field(tiny, tmp_path):
    import json
    import shutil

    bad = tmp_path / "zero"
    shutil.copytree(local_adapter("tiny-llama", tiny["tiny-llama"].model.config, "lora-a", 1), bad)
    (bad / "adapter_config.json").write_text(json.dumps({**json.loads((bad / "adapter_config.json").read_text()),
                                                         "r": 0}))
    server = ServeServer(ServeOptions(model="tiny-llama", port=0, lora_modules=(LoraModule("z", str(bad)),)),
                         load=lambda options: tiny["tiny-llama"])
    with pytest.raises(ValueError) as e:
        server.load()
    assert str(e.value) == f"--lora-modules z: {bad}/adapter_config.json: r must be a positive integer (the adapter's " \
                           "rank), got 0"


def test_serve_refuses_lora_with_the_modes_before_loading_the_model():
    """The same check as `kvtui run` and the scenario schema (config.lora_mode_problem), before any weights load."""
    def no_load(options):
        raise AssertionError("the model was loaded before the check")

    for extra, line in (({"batch_invariant": True}, "--enable-lora: LoRA adapters are not supported in the "
                                                    "batch-invariant mode: drop --batch-invariant"),
                        ({"enforce_eager": True}, "--enable-lora: LoRA adapters run on kvtui's fused forward, which "
                                                  "--enforce-eager replaces: drop --enforce-eager")):
        server = ServeServer(ServeOptions(model="tiny-llama", port=0, enable_lora=True, **extra), load=no_load)
        with pytest.raises(ValueError) as e:
            server.check()
        assert str(e.value) == line
