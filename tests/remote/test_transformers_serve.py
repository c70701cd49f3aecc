"""kvtui against `transformers serve --continuous-batching`, serving kvtui's own float32 copy of SmolLM2 on
the CPU (scripts/serve-transformers.sh): passphrase requests with ids of the server's choosing come back
right, and `kvtui run scenarios/request_ids.yaml --target URL` as a user runs it finds what its continuous
batching does with two overlapping requests that share one x-request-id: one client hangs, the other's
request fails, and the batching worker is dead: every later request of every client and /health get 503
(docs/findings.md).

The server is transformers 5.24.0, pinned (kvtui.remote.transformers_serve.PINNED_VERSION, installed by
scripts/install-transformers-serve.sh into a venv of its own), not the transformers kvtui runs on: the
finding belongs to 5.24.0, whose serving code keys the batching manager by the client's x-request-id.
5.25.0 keys it by ids of its own (the same audit there: 0 hung, 0 lost, both probes answered, /health
200), so on kvtui's own newer transformers these tests would test the newer release, not kvtui.

One pinned server for the whole module, started once (about 15 s) and killed at the end; the module is
one xdist group. The control runs first: the audit leaves the server dead. The bench peer's body runs
against the pinned server and against the transformers kvtui runs on (the bench's own peer). Skipped,
naming the install command, where the pinned venv is missing; skipped where the default model or
transformers' serving extras are missing. The scripts' own checks need nothing.
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

ROOT = Path(__file__).resolve().parents[2]
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


def fake_python(path: Path) -> Path:
    """An executable that passes the script's import check and version question, fails /health and, as the
    server, prints one line and exits 3: a server that dies before it is ready."""
    path.write_text("#!/bin/sh\n"
                    'case "$*" in\n'
                    '  *"import transformers.cli.serving.server"*) exit 0 ;;\n'
                    '  *"print(transformers.__version__)"*) echo 9.9.9; exit 0 ;;\n'
                    '  *"transformers.cli.transformers import main"*) echo "no such model"; exit 3 ;;\n'
                    "esac\nexit 1\n")
    path.chmod(0o755)
    return path


def test_script_names_the_log_when_the_server_dies_before_it_is_ready(tmp_path):
    """One line, the log's path last, and exit 1 (the exit code was once printed into the message)."""
    from kvtui.remote.vllm_cpu import free_port

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    log = tmp_path / "server.log"
    out = subprocess.run(["bash", str(SCRIPT), "--python", str(fake_python(tmp_path / "python")), "--model",
                          str(tmp_path / "model"), "--port", str(free_port()), "--wait", "20", "--log", str(log)],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "KVTUI_CACHE_DIR": str(tmp_path)})
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "no such model", f"serve-transformers: error: transformers serve exited before it was ready (log above, "
                         f"whole log: {log})"]


@pytest.mark.parametrize("release, line", [
    ("5.24", "serve-transformers: error: --transformers 5.24: give a whole release such as 5.24.0"),
    ("5.24.0/..", "serve-transformers: error: --transformers 5.24.0/..: give a whole release such as 5.24.0"),
    ("4.99.0", "serve-transformers: error: --transformers 4.99.0: not installed in {cache}/transformers-serve/4.99.0: "
               "run scripts/install-transformers-serve.sh 4.99.0"),
])
def test_script_serves_an_installed_release_or_says_how_to_install_it(release, line, tmp_path):
    out = subprocess.run(["bash", str(SCRIPT), "--transformers", release], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "KVTUI_CACHE_DIR": str(tmp_path)})
    assert (out.returncode, out.stderr.strip()) == (2, line.format(cache=tmp_path))


# -- the install script, without installing anything ------------------------------------------------------
INSTALL = ROOT / "scripts" / "install-transformers-serve.sh"


def install(*args: str, cache: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(INSTALL), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "KVTUI_CACHE_DIR": str(cache), "PYTHON": sys.executable, **env})


def test_the_install_script_defaults_to_the_release_the_tests_pin():
    from kvtui.remote.transformers_serve import PINNED_VERSION

    assert subprocess.run(["bash", "-n", str(INSTALL)], capture_output=True).returncode == 0
    assert re.search(r'VERSION="\$\{TRANSFORMERS_SERVE_VERSION:-([^}]+)\}"', INSTALL.read_text()).group(1) == \
        PINNED_VERSION == "5.24.0"


@pytest.mark.parametrize("args, env, release", [((), {}, "5.24.0"), (("5.25.0",), {}, "5.25.0"),
                                                 ((), {"TRANSFORMERS_SERVE_VERSION": "5.23.1"}, "5.23.1")])
def test_the_install_script_with_a_matching_stamp_does_nothing(args, env, release, tmp_path):
    python = tmp_path / "transformers-serve" / release / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\nexit 1\n")
    python.chmod(0o755)
    key = (f"transformers[serving]=={release} torch==2.13.0 python={sys.version_info[0]}.{sys.version_info[1]} "
           f"arch={os.uname().machine}")
    (tmp_path / "transformers-serve" / release / "stamp.txt").write_text(key + "\ninstalled: earlier\n")
    out = install(*args, cache=tmp_path, **env)
    assert (out.returncode, out.stderr) == (0, "")
    assert out.stdout.strip() == (f"install-transformers-serve: up to date: {tmp_path}/transformers-serve/{release}/venv "
                                  f"({key})")


@pytest.mark.parametrize("args, env, line", [
    (("5.24",), {}, "transformers release '5.24': give a whole release such as 5.24.0"),
    (("--bogus",), {}, "unknown argument --bogus (see --help)"),
    ((), {"TRANSFORMERS_SERVE_VERSION": "latest"}, "transformers release 'latest': give a whole release such as 5.24.0"),
    ((), {"PYTHON": "/nonexistent/python3"}, "/nonexistent/python3 not found: install Python 3.10-3.13 or set "
                                             "PYTHON=/path/to/python3"),
])
def test_the_install_script_refuses_bad_input_in_one_line(args, env, line, tmp_path):
    out = install(*args, cache=tmp_path, **env)
    assert (out.returncode, out.stderr.strip()) == (2, f"install-transformers-serve: error: {line}")
    assert not (tmp_path / "transformers-serve").exists()


def test_the_pinned_finder_names_the_install_command(tmp_path, monkeypatch):
    from kvtui.remote.transformers_serve import find_pinned_transformers_serve, install_dir

    monkeypatch.setenv("KVTUI_CACHE_DIR", str(tmp_path))
    assert install_dir() == tmp_path / "transformers-serve" / "5.24.0"
    assert find_pinned_transformers_serve() == (
        f"transformers serve 5.24.0 is not installed in {tmp_path}/transformers-serve/5.24.0: run "
        "scripts/install-transformers-serve.sh 5.24.0 (about 2 minutes)")
    (install_dir() / "venv" / "bin").mkdir(parents=True)
    (install_dir() / "venv" / "bin" / "python").write_text("")
    (install_dir() / "stamp.txt").write_text("transformers[serving]==5.25.0 torch==2.13.0 python=3.11 arch=x86_64\n")
    assert find_pinned_transformers_serve() == (
        f"{tmp_path}/transformers-serve/5.24.0/stamp.txt names another release than transformers 5.24.0: run "
        "scripts/install-transformers-serve.sh 5.24.0 --force")


# -- the server --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """transformers serve 5.24.0, the pinned release (helpers.transformers_serve with no python)."""
    from helpers import transformers_serve

    yield from transformers_serve(tmp_path_factory)


def kvtui(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(KVTUI + list(args), capture_output=True, text=True, timeout=600, cwd=ROOT)


@pytest.mark.transformers_serve
@pytest.mark.smollm
@pytest.mark.xdist_group("transformers_serve")
def test_control_with_ids_of_the_servers_choosing_every_answer_is_right(server, tmp_path):
    """Pinned 5.24.0 (the release the audit below holds a finding on): it answers when ids do not collide."""
    from kvtui.models.default import cache_dir

    assert server.version == "5.24.0"  # the pinned venv's, not kvtui's own transformers
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
@pytest.mark.parametrize("release", ["pinned", "kvtui's own"])
def test_the_bench_peer_body_runs_the_workload_at_its_forced_lengths(release, request, tmp_path_factory):
    """kvtui bench --part peers sends transformers serve the workload as text with a generation_config
    forcing each output length (transformers_serve_body), without ignore_eos (which it refuses with 422):
    through the bench's own client, 5, 9 and 40 tokens, every stream ending with finish_reason "length",
    and each length exact by the server's own usage count. Greedy "The capital of France is" reaches
    SmolLM2's end-of-sequence token before 40 tokens, so the 40 holds only where EOS is switched off.

    On the pinned 5.24.0 and on the transformers kvtui runs on (what the bench's peer serves with; 5.25.0
    today), since the two read generation_config differently: a body with min_new_tokens and no
    eos_token_id forced the lengths on 5.24.0 alone (5.25.0 stopped the 40 early, finish_reason "stop")."""

    import httpx
    from helpers import transformers_serve

    from kvtui.bench.peers import Workload, _stream_all, forced_length_shortfall, transformers_serve_body
    from kvtui.models import load_model

    pinned = request.getfixturevalue("server") if release == "pinned" else None  # skips first without it
    tokenizer = load_model("default", progress=False).tokenizer
    texts = ["The capital of France is", "Once upon a time", "The capital of France is"]
    work = Workload(prompts=[tokenizer.encode(t) for t in texts], outputs=[5, 9, 40], arrivals=[0.0, 0.0, 0.0])

    def check(server) -> None:
        body = transformers_serve_body(tokenizer, work, server.model_name)
        sent = [{k: v for k, v in {"prompt": None, "ignore_eos": True, **body(i)}.items() if v is not None}
                for i in range(3)]
        assert ["ignore_eos" in b for b in sent] == [False] * 3
        assert [b["prompt"] for b in sent] == texts
        outcome = _stream_all(server.url, work, body)  # the bench's streaming client, the three at once
        assert outcome.finish == ["length"] * 3, (outcome.finish, outcome.tokens)
        assert forced_length_shortfall(outcome) is None
        for i, n in enumerate(work.outputs):  # the same body, not streamed: the server counts the tokens
            answer = httpx.post(f"{server.url}/v1/completions", timeout=300, json={
                **sent[i], "max_tokens": n, "temperature": 0, "stream": False}).json()
            assert (answer["usage"]["completion_tokens"], answer["choices"][0]["finish_reason"]) == (n, "length")

    if pinned is not None:
        check(pinned)
    else:
        for own in transformers_serve(tmp_path_factory, python=sys.executable):
            check(own)


@pytest.mark.transformers_serve
@pytest.mark.smollm
@pytest.mark.xdist_group("transformers_serve")
def test_two_overlapping_requests_with_one_x_request_id_kill_the_server(server, tmp_path):
    """Pinned 5.24.0: its finding (docs/findings.md). 5.25.0 keys its batching by ids of its own, and the
    same audit there finds nothing (0 hung, 0 lost, 2 of 2 probes answered, GET /health 200)."""
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


# -- the release that changed it -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fixed_server(tmp_path_factory):
    """transformers serve FIXED_VERSION (5.25.0) from its own pinned venv, for the audit that 5.24.0 fails."""
    from helpers import transformers_serve

    from kvtui.remote.transformers_serve import FIXED_VERSION

    yield from transformers_serve(tmp_path_factory, version=FIXED_VERSION)


@pytest.mark.transformers_serve
@pytest.mark.smollm
@pytest.mark.xdist_group("transformers_serve")
def test_on_5_25_0_the_same_audit_finds_nothing_and_the_server_keeps_serving(fixed_server, tmp_path):
    """Pinned 5.25.0: the same command as above, exit 0. Its batching is keyed by ids the server makes
    (`make_request_id` in cli/serving/model_manager.py), the client's x-request-id only echoed."""
    assert fixed_server.version == "5.25.0"
    record = tmp_path / "audit.jsonl"
    out = kvtui("run", "scenarios/request_ids.yaml", "--target", fixed_server.url, "--headless", "--record",
                str(record))
    assert out.returncode == 0, out.stdout + out.stderr
    _, events, summary, _ = read_recording(record)
    assert [e for e in events if isinstance(e, Contamination) and e.counts] == []
    assert summary.finish_reasons == {"stop": 18} and summary.passphrase_echoed == 18
    assert summary.request_id_audit == (
        "request-id audit (x-request-id): 10 of 18 requests shared an id with another (3 duplicate groups, 1 "
        "near-duplicate group; 10 overlapped one in flight); 0 answers to the wrong client; 0 hung; 0 lost; "
        "afterwards 2 of 2 later requests with fresh ids answered, GET /health 200")
