"""The README's main job prints what the README shows: its `kvtui run` command, run as written on the
default model, prints every line of the "What the run prints" block, in that order (`...` stands for
rows the README leaves out, e.g. the duration row, whose measured part is the machine's)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.smollm
ROOT = Path(__file__).resolve().parents[2]


def readme_main_job() -> list[str]:
    """The `kvtui run ...` part of the README's first set-up command, as argv."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    main_job = re.findall(r"```bash\n(.*?)\n```", readme, re.S)[0]
    command = main_job.split("&&")[-1].strip()
    assert command.startswith("kvtui run "), command
    return shlex.split(command)


def readme_printed_block() -> list[str]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## What the run prints", 1)[1]
    block = re.search(r"```\n(.*?)\n```", section, re.S).group(1)
    return [line.rstrip() for line in block.splitlines()]


def test_readme_block_is_what_the_main_job_prints(smollm2, tmp_path):
    argv = readme_main_job()
    at = argv.index("--record") + 1
    readme_record, argv[at] = argv[at], str(tmp_path / "passphrase.jsonl")
    # `--cost-model auto` (the default) would use a `kvtui calibrate` fit stored on this machine; a fresh
    # install has none, which is what the README shows, so pin the built-in one.
    argv += ["--cost-model", "default"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("KVTUI_TEST_THREADS", "1")}
    done = subprocess.run([sys.executable, "-c", "from kvtui.cli import main; main()", *argv[1:]], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = [line.rstrip() for line in done.stdout.splitlines()]
    expected = [line.replace(readme_record, argv[at]) for line in readme_printed_block()]
    assert len(expected) >= 10 and expected[0].startswith("passphrase on SmolLM2-135M-Instruct")
    at = 0
    for line in expected:
        if line.strip() == "...":
            continue
        assert line in printed[at:], f"README line {line!r} is not printed (after line {at}):\n{done.stdout}"
        at = printed.index(line, at) + 1
