"""`kvtui run --llama-server ARGS` and `--reference-target`: what is refused before any server starts
(one line, exit 2), and how ARGS are read. No llama-server is needed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvtui.remote.llama_server import DEFAULT_PARALLEL, model_gguf, parse_server_args

KVTUI = [sys.executable, "-m", "kvtui.cli"]
SCENARIO = str(Path(__file__).parents[2] / "scenarios" / "llama_hybrid_prompt_cache.yaml")


def test_server_args_give_the_slot_count_and_keep_every_argument():
    assert parse_server_args("-np 2 --cache-reuse 256 -t 1") == (2, ["-np", "2", "--cache-reuse", "256", "-t", "1"])
    assert parse_server_args("--parallel 3 -np 4")[0] == 4  # the last one, as llama-server reads them
    assert parse_server_args("") == (DEFAULT_PARALLEL, [])
    for bad, said in [("-np x", "give a number of slots"), ("-np 0", "give a number of slots"),
                      ("--port 80", "--port is chosen by kvtui"), ("-m a.gguf", "-m is chosen by kvtui"),
                      ("'-np 2", "quotation")]:
        with pytest.raises(ValueError, match=said):
            parse_server_args(bad)


def test_model_gguf_refuses_a_model_llama_server_cannot_serve():
    from kvtui.models import ModelLoadError

    with pytest.raises(ModelLoadError, match="--llama-server serves a GGUF: use --model tiny-qwen35moe"):
        model_gguf("tiny-llama")


@pytest.mark.parametrize("args, said", [
    (["--llama-server", "-np 2 --port 9"], "error: --llama-server: --port is chosen by kvtui"),
    (["--llama-server", "-np 2", "--model", "tiny-gpt2"], "error: --llama-server: --llama-server serves a GGUF"),
    (["--llama-server", "-np 2", "--target", "http://127.0.0.1:9"], "error: --llama-server starts the server itself"),
    (["--reference-target", "http://127.0.0.1:9"], "error: --reference-target goes with --target"),
])
def test_bad_llama_server_options_exit_2_with_one_line(args, said):
    out = subprocess.run(KVTUI + ["run", SCENARIO, "--headless", *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and out.stderr.startswith(said)
