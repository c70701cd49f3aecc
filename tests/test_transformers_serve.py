"""kvtui against `transformers serve --continuous-batching` (transformers 5.24, the one kvtui runs on),
serving kvtui's own float32 copy of SmolLM2 on the CPU (scripts/serve-transformers.sh): passphrase
requests with ids of the server's choosing come back right, and `kvtui run scenarios/request_ids.yaml
--target URL` as a user runs it finds what its continuous batching does with two overlapping requests
that share one x-request-id: one client hangs, the other's request fails, and the batching worker is
dead: every later request of every client and /health get 503 (docs/findings.md).

One server for the whole module, started once (about 15 s) and killed at the end; the module is one
xdist group. The control runs first: the audit leaves the server dead. Skipped when the default model or
transformers' serving extras (fastapi, uvicorn, openai) are missing. The script's own checks need nothing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvtui.events import Contamination
from kvtui.models.default import DEFAULT_GGUF_SHA256, DEFAULT_MODEL_ID
from kvtui.models.gguf import cache_name
from kvtui.record import read_recording

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "serve-transformers.sh"
KVTUI = [sys.executable, "-m", "kvtui.cli"]


# -- the script, without starting anything --------------------------------------------------------------
def test_script_parses_and_points_at_kvtuis_converted_default_model():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    folder = re.search(r'DEFAULT_MODEL_DIR="\$CACHE/([^"]+)"', SCRIPT.read_text()).group(1)
    assert folder == cache_name(DEFAULT_MODEL_ID, DEFAULT_GGUF_SHA256) == "SmolLM2-135M-Instruct-b179c9523d0e"


@pytest.mark.parametrize("args, line", [
    (["--port", "x1"], "serve-transformers: error: --port x1: give a positive whole number"),
    (["--num-blocks", "0"], "serve-transformers: error: --num-blocks 0: give a positive whole number"),
    (["--detach"], "serve-transformers: error: --detach needs --pid-file FILE (to stop the server later)"),
    (["--bogus"], "serve-transformers: error: unknown argument --bogus (see --help)"),
])
def test_script_refuses_bad_arguments_in_one_line(args, line, tmp_path):
    out = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "KVTUI_CACHE_DIR": str(tmp_path)})
    assert (out.returncode, out.stderr.strip()) == (2, line)


def test_script_without_the_converted_model_says_what_to_run(tmp_path):
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "KVTUI_CACHE_DIR": str(tmp_path)})
    assert out.returncode == 2
    assert out.stderr.strip() == ("serve-transformers: error: kvtui's default model is not converted yet "
                                  f"({tmp_path}/SmolLM2-135M-Instruct-b179c9523d0e): run `kvtui model` once")


# -- the server --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from conftest import transformers_serve

    yield from transformers_serve(tmp_path_factory)


def kvtui(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(KVTUI + list(args), capture_output=True, text=True, timeout=600, cwd=ROOT)


@pytest.mark.transformers_serve
@pytest.mark.smollm
@pytest.mark.xdist_group("transformers_serve")
def test_control_with_ids_of_the_servers_choosing_every_answer_is_right(server, tmp_path):
    from kvtui.models.default import cache_dir

    record = tmp_path / "control.jsonl"
    out = kvtui("run", "scenarios/passphrase.yaml", "--target", server.url, "--headless", "--record", str(record),
                "--detectors", "canary")  # its body takes no cache_salt (422), which the solo checks send
    assert out.returncode == 0, out.stdout + out.stderr
    header, _, summary, _ = read_recording(record)
    assert header.model.id == str(cache_dir() / cache_name(DEFAULT_MODEL_ID, DEFAULT_GGUF_SHA256))  # /v1/models
    assert summary.finish_reasons == {"stop": 8} and summary.passphrase_echoed == 8
    assert summary.findings_by_kind == {}


@pytest.mark.transformers_serve
@pytest.mark.smollm
@pytest.mark.xdist_group("transformers_serve")
def test_the_bench_peer_body_runs_the_workload_at_its_forced_lengths(server):
    """kvtui bench --part peers sends transformers serve the workload as text with a generation_config
    forcing each output length, and without ignore_eos (which it refuses with 422): every request
    streams back exactly its length in tokens (one token per chunk)."""
    import json

    import httpx

    from kvtui.bench.peers import Workload, transformers_serve_body
    from kvtui.models import load_model

    tokenizer = load_model("default", progress=False).tokenizer
    work = Workload(prompts=[tokenizer.encode("The capital of France is"), tokenizer.encode("Once upon a time")],
                    outputs=[5, 9], arrivals=[0.0, 0.0])
    body = transformers_serve_body(tokenizer, work, server.model_name)
    for i in range(2):
        sent = {"prompt": None, "max_tokens": work.outputs[i], "temperature": 0, "ignore_eos": True, "stream": True,
                **body(i)}
        sent = {k: v for k, v in sent.items() if v is not None}
        assert "ignore_eos" not in sent and sent["prompt"] == tokenizer.decode(work.prompts[i])
        with httpx.Client(timeout=120) as client, client.stream("POST", f"{server.url}/v1/completions",
                                                                 json=sent) as response:
            assert response.status_code == 200
            chunks = [json.loads(line[6:])["choices"][0] for line in response.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert sum(1 for c in chunks if c.get("text")) == work.outputs[i], chunks
        assert chunks[-1]["finish_reason"] == "length"


@pytest.mark.transformers_serve
@pytest.mark.smollm
@pytest.mark.xdist_group("transformers_serve")
def test_two_overlapping_requests_with_one_x_request_id_kill_the_server(server, tmp_path):
    record = tmp_path / "audit.jsonl"
    out = kvtui("run", "scenarios/request_ids.yaml", "--target", server.url, "--headless", "--record", str(record))
    assert out.returncode == 1, out.stdout + out.stderr
    _, events, summary, _ = read_recording(record)
    found = {e.victim: e for e in events if isinstance(e, Contamination) and e.counts}
    assert {"r000", "r001"}.isdisjoint(found)  # answered before the first duplicate pair
    # the first pair, r004 and r005, sharing one id: a finding naming the other, for each of them on a quiet
    # machine; with the other test worker busy, one of the pair was once not a finding (which one got its
    # answer in before the collision is the server's race), so at least one is required
    pair = {v: found[v] for v in ("r004", "r005") if v in found}
    assert pair, "neither request of the first duplicate pair is a finding"
    assert all((e.source, e.kind in ("hung", "lost")) == (({"r004", "r005"} - {v}).pop(), True) for v, e in pair.items())
    # the batching worker died: the probes with fresh ids and /health after the load get 503, blamed on the
    # pairs that broke it (the first pair among them)
    cause = found["probe0"].source
    assert {"r004", "r005"} <= set(cause.split(","))
    for victim in ("probe0", "probe1", "GET /health"):
        assert (found[victim].kind, found[victim].source, found[victim].evidence.status) == \
            ("stopped_serving", cause, 503)
    assert "cb_worker_dead" in found["GET /health"].evidence.outcome
    # every request sent once it had died failed the same way, whoever sent it and whatever its id
    dead = {v: e for v, e in found.items() if e.detector == "request_id" and e.kind == "lost"
            and "CB worker is dead" in e.evidence.outcome}
    assert len(dead) >= 6 and all(e.evidence.status == 503 for e in dead.values())
    assert all(e.source == cause for v, e in dead.items() if v not in cause.split(",")), dead
    assert summary.finish_reasons["error"] >= 8 and summary.passphrase_echoed == summary.finish_reasons["stop"]
    line = summary.request_id_audit
    assert line in out.stdout.splitlines()  # printed on one line, to paste into a report
    assert "then the server stopped serving other clients: 0 of 2 later requests with fresh ids answered (first: " \
        "HTTP 503: " in line and "CB worker is dead and cannot accept request kvtui-a5e820-probe-0" in line
    assert line.endswith('GET /health 503 {"status":"unhealthy","reason":"cb_worker_dead"}')
    assert summary.reference_skipped_by_reason == {"server_stopped": summary.requests_completed}
