"""What the command line and the summaries say: a did-you-mean wherever a name is chosen (a choice option,
--detectors, a model, a scenario file, a fault name the engine checks), one line per error (a model that
does not exist, a port that is taken: no note or uvicorn line before kvtui's), a scenario file given to
`kvtui replay`, scenario integers that are not integers, min_tokens above the output lengths; and
summaries that say what they could not see: a blind canary, words rather than tokens from a speech
server, sequences rather than requests under parallel sampling."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvtui.cli.app import main
from kvtui.events import CounterEntry
from kvtui.record import read_recording
from kvtui.serve.server import ServeOptions, ServeServer
from kvtui.summary import canary_blind, passphrase_text

ROOT = Path(__file__).resolve().parents[2]
KVTUI = [sys.executable, "-m", "kvtui.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def kvtui(monkeypatch, capsys, *args: str) -> tuple[int, list[str], str]:
    """Run the command line in this process: (exit code, stderr's non-empty lines, stdout)."""
    monkeypatch.setattr(sys, "argv", ["kvtui", *args])
    monkeypatch.chdir(ROOT)
    code = main()
    captured = capsys.readouterr()
    return code, [line for line in captured.err.splitlines() if line.strip()], captured.out


SCENARIO = """name: msg
seed: 0
max_requests: 6
model: tiny-llama
arrivals: {process: poisson, rate_per_s: 4.0}
prompts: {kind: passphrase}
"""


# -- did you mean ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,hint", [
    (("run", "scenarios/passphrase.yaml", "--headless", "--fault", "stale_slots"), "(did you mean 'stale_slot'?)"),
    (("run", "scenarios/passphrase.yaml", "--headless", "--layout", "paded"), "(did you mean 'padded'?)"),
    (("audit", "scenarios/passphrase.yaml", "--fault", "shared_cach"), "(did you mean 'shared_cache'?)"),
    (("run", "scenarios/passphrase.yaml", "--headless", "--model", "tiny-llama", "--detectors", "canary,refrence"),
     "unknown detector 'refrence' (did you mean 'reference'?)"),
    (("model", "tiny-lama"), "unknown model 'tiny-lama' (did you mean 'tiny-llama'?)"),
    (("validate", "scenarios/passphrse.yaml"), "not found (did you mean 'scenarios/passphrase.yaml'?)"),
    (("run", "passphrase.yaml", "--headless"), "not found (did you mean 'scenarios/passphrase.yaml'?)"),
])
def test_a_mistyped_name_gets_the_closest_one_in_one_line(monkeypatch, capsys, args, hint):
    code, err, _ = kvtui(monkeypatch, capsys, *args)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and hint in err[0], err


def test_a_name_with_nothing_close_gets_no_guess(monkeypatch, capsys):
    code, err, _ = kvtui(monkeypatch, capsys, "run", "scenarios/passphrase.yaml", "--headless", "--fault", "nope")
    assert code == 2 and len(err) == 1 and "did you mean" not in err[0]
    assert "'nope' is not one of 'shared_cache'" in err[0]
    # a scenario file: names compared without their ".yaml" ('nope.yaml' was close to 'empty.yaml' by it)
    code, err, _ = kvtui(monkeypatch, capsys, "run", "nope.yaml", "--headless")
    assert code == 2 and len(err) == 1 and "not found" in err[0] and "did you mean" not in err[0], err


def test_the_engine_and_servers_fault_check_names_the_closest_fault():
    from kvtui.faults import check_fault_names

    with pytest.raises(ValueError, match=re.escape("unknown fault 'stale_slots' (did you mean 'stale_slot'?)")):
        check_fault_names(["stale_slots"])


# -- one line per error ----------------------------------------------------------------------------------
def test_serve_with_an_unknown_model_says_only_its_error():
    out = subprocess.run(KVTUI + ["serve", "--model", "tiny-lama", "--port", "0"], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, env=ENV)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith("error: --model: unknown model 'tiny-lama' (did you mean 'tiny-llama'?)")


def test_serve_on_a_taken_port_says_only_kvtuis_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(KVTUI + ["serve", "--model", "tiny-llama", "--port", str(port)], capture_output=True,
                             text=True, timeout=300, cwd=ROOT, env=ENV)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"error: --host/--port: cannot listen on 127.0.0.1:{port} (Address already in use); check --host or choose "
        "another --port"], out.stderr


def test_replaying_a_scenario_file_says_it_is_one_and_how_to_run_it(monkeypatch, capsys):
    code, err, _ = kvtui(monkeypatch, capsys, "replay", "scenarios/passphrase.yaml", "--summary")
    assert code == 2 and err == ["error: scenarios/passphrase.yaml is a scenario file, not a recording: run it with "
                                 "`kvtui run scenarios/passphrase.yaml` (add --headless --record runs/NAME.jsonl to "
                                 "record a run that kvtui replay plays)"]
    code, err, _ = kvtui(monkeypatch, capsys, "replay", "README.md", "--summary")
    assert code == 2 and err == ["error: README.md:1: not a kvtui recording (not JSON; a recording is JSON Lines, a "
                                 "header first)"]


@pytest.mark.parametrize("value,got", [("true", "True"), ('"3"', "'3'"), ("3.0", "3.0")])
def test_a_scenario_integer_must_be_an_integer(monkeypatch, capsys, tmp_path, value, got):
    path = tmp_path / "n.yaml"
    path.write_text(SCENARIO + f"sampling: {{n: {value}, temperature: 0.5}}\n")
    code, err, _ = kvtui(monkeypatch, capsys, "validate", str(path))
    assert code == 2 and err == [f"error: {path}:7: sampling.n: expected a whole number, got {got}; write an integer "
                                 "like 4"]


def test_min_tokens_above_every_output_length_is_refused_and_above_some_warned(monkeypatch, capsys, tmp_path):
    """It used to be capped at each request's length without a word."""
    from kvtui.models import load_tokenizer
    from kvtui.scenario import load_scenario, plan_requests

    path = tmp_path / "m.yaml"
    path.write_text(SCENARIO + "output_tokens: {dist: uniform, min: 4, max: 20}\nsampling: {min_tokens: 40}\n")
    code, err, _ = kvtui(monkeypatch, capsys, "validate", str(path))
    lengths = sorted(p.sampling.max_new_tokens for p in plan_requests(load_scenario(path), load_tokenizer("tiny-llama")))
    assert code == 2 and err == [
        f"error: {path}: sampling.min_tokens: 40 is above the output length of every planned request "
        f"({lengths[0]}-{lengths[-1]} tokens), so each would be held to its own length, not to 40; lower "
        f"sampling.min_tokens to {lengths[0]} or less, or raise output_tokens"]
    cut = sorted(lengths)[3]  # above the 3 shortest outputs only
    path.write_text(SCENARIO + f"output_tokens: {{dist: uniform, min: 4, max: 20}}\nsampling: {{min_tokens: {cut}}}\n")
    code, err, _ = kvtui(monkeypatch, capsys, "validate", str(path))
    shorter = [n for n in lengths if n < cut]
    assert code == 0 and len(err) == 1 and err[0].startswith(
        f"warning: {path}: sampling.min_tokens: {cut} is above the output length of {len(shorter)} of the 6 planned "
        f"requests")
    path.write_text(SCENARIO + f"output_tokens: {{dist: uniform, min: 4, max: 20}}\nsampling: {{min_tokens: "
                               f"{lengths[0]}}}\n")
    code, err, _ = kvtui(monkeypatch, capsys, "validate", str(path))
    assert code == 0 and err == []


# -- what the summaries could not see --------------------------------------------------------------------
def test_the_summary_calls_the_canary_blind_only_when_no_answer_held_any_passphrase():
    header, _, summary, _ = read_recording(ROOT / "recordings" / "passphrase.jsonl")
    assert (summary.passphrase_echoed, summary.passphrase_requests) == (8, 8) and not canary_blind(summary, header)
    silent = summary.model_copy(update={"passphrase_echoed": 0})
    assert canary_blind(silent, header) and passphrase_text(silent, header).startswith("0/8: the canary was blind")
    leaked = silent.model_copy(update={"contamination_events_total": (
        CounterEntry(kind="cross_request", detector="canary", value=3),)})
    assert not canary_blind(leaked, header) and passphrase_text(leaked, header) == "0/8"  # answers held others'
    off = header.model_copy(update={"detectors": ("reference",)})
    assert not canary_blind(silent, off)  # no canary ran: nothing to call blind
    assert passphrase_text(silent, header).endswith("findings rest on the other detectors, and a source none of "
                                                    "them names shows as ?")
    alone = header.model_copy(update={"detectors": ("canary",)})  # no other detector to rest on
    assert passphrase_text(silent, alone).endswith("no other detector ran (--detectors canary), so this run could "
                                                   "witness none")


def test_parallel_sampling_and_a_random_weight_model_are_summarized_as_what_they_are(monkeypatch, capsys):
    """scenarios/parallel_sampling.yaml on tiny-llama (random weights): 6 requests submitted, some as n = 3
    sequences, and no answer can hold a passphrase."""
    from kvtui.models import load_tokenizer
    from kvtui.scenario import load_scenario, plan_requests

    path = ROOT / "scenarios" / "parallel_sampling.yaml"
    plan = plan_requests(load_scenario(path), load_tokenizer("tiny-llama"))
    sequences = sum(p.sampling.n for p in plan)
    assert len(plan) == 6 and sequences > 6
    code, _, out = kvtui(monkeypatch, capsys, "run", str(path), "--headless", "--model", "tiny-llama",
                         "--detectors", "canary")
    text = " ".join(out.split())
    assert code == 0 and f"requests 6 submitted, {sequences} sequences finished (length {sequences})" in text
    assert f"own passphrase echoed 0/{sequences}: the canary was blind" in text


def test_a_random_weight_server_audit_says_the_canary_was_blind(tmp_path):
    """`kvtui run --target` against kvtui serve on tiny-llama: the canary sees no passphrase in any answer."""
    path = tmp_path / "audit.yaml"
    path.write_text(SCENARIO.replace("max_requests: 6", "max_requests: 4") + "output_tokens: 8\n")
    with ServeServer(ServeOptions(model="tiny-llama", port=0, slots=2, max_len=512, detectors=("canary",))) as server:
        out = subprocess.run(KVTUI + ["run", str(path), "--target", server.url, "--headless", "--detectors", "canary"],
                             capture_output=True, text=True, timeout=600, cwd=ROOT, env=ENV)
    text = " ".join(out.stdout.split())
    assert out.returncode == 0, out.stderr
    assert "own passphrase echoed 0/4: the canary was blind: no answer held a passphrase, its own or another's" in text


# -- --request-ids ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, why", [
    ("", "give at least one place"), (" , ", "give at least one place"),  # said "give each place once"
    ("header,header", "give each place once"), ("traceparnt", "unknown place 'traceparnt'")])
def test_a_bad_request_ids_value_names_what_is_wrong(monkeypatch, capsys, value, why):
    code, lines, _ = kvtui(monkeypatch, capsys, "run", "scenarios/passphrase.yaml", "--headless", "--target",
                           "http://127.0.0.1:9", "--request-ids", value)
    assert code == 2
    assert lines == [f"error: --request-ids {value!r}: {why}; use some of header, user, request_id, traceparent, "
                     "rid, comma-separated (e.g. --request-ids header,user)"]


def test_the_model_command_names_the_linear_kernels_it_runs(monkeypatch, capsys):
    """`kvtui model` says which linear kernels the fused forward runs and why (a forced one named as forced),
    so a user can see that KVTUI_LINEAR_KERNEL took effect; GPT-2 (no fused forward) prints no such line."""
    monkeypatch.setenv("KVTUI_LINEAR_KERNEL", "input_major")
    code, err, out = kvtui(monkeypatch, capsys, "model", "tiny-llama")
    assert code == 0 and "linear kernels: layers input_major, LM head input_major (forced by KVTUI_LINEAR_KERNEL)" in out
    monkeypatch.setenv("KVTUI_DECODE_ATTENTION", "sdpa")  # and the decode attention, forced too
    code, err, out = kvtui(monkeypatch, capsys, "model", "tiny-llama")
    assert code == 0 and "decode attention: SDPA (forced by $KVTUI_DECODE_ATTENTION)" in out
    code, err, out = kvtui(monkeypatch, capsys, "model", "tiny-gpt2")
    assert code == 0 and "linear kernels" not in out
