"""llama.cpp's host-RAM prompt cache audited from outside (scenarios/llama_prompt_cache.yaml).

A public llama.cpp bug report says that with `-np 2`, once the prompt cache holds finished conversations,
new concurrent conversations were restored with another conversation's state. The scenario has that
shape: one shared opening, a passphrase per conversation asked back at temperature 0, 12 conversations
filling the cache one at a time, then 10 rounds of 2 and 10 of 4 at once. The canary names victim and
source of any answer holding another conversation's passphrase.

- With the fake server leaking (tests/fake_openai.py), every leak it made is named, victim and source.
- Against the vendored llama-server (built by scripts/build-llama-server.sh; skipped otherwise), `-np 2`
  with its default flags (RAM cache, idle-slot caching and slot similarity on) and the control with them
  off: the answers are what the server gives. What these runs found is in docs/audits.md (llama.cpp's
  host-RAM prompt cache); the tests pin it: no foreign passphrase either way, every own passphrase echoed, and with
  the default flags the shared opening served from the cache. Each server starts once for the module.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from fake_openai import FakeOpenAI
from prometheus_client.parser import text_string_to_metric_families

from kvtui.events import Contamination, Finish
from kvtui.models import build_tiny_tokenizer
from kvtui.record import read_recording
from kvtui.remote.session import TargetOptions, TargetSession
from kvtui.scenario import load_scenario, plan_requests

KVTUI = [sys.executable, "-m", "kvtui.cli"]
SCENARIO = Path(__file__).parents[2] / "scenarios" / "llama_prompt_cache.yaml"
REQUESTS = 12 + 10 * 2 + 10 * 4
CONTROL_FLAGS = ("--cache-ram", "0", "--no-cache-idle-slots", "-sps", "0")


def test_the_canary_names_every_restored_passphrase_with_its_source():
    """A server answering with the previous different conversation's passphrase: each such answer is a
    cross_request report naming the request whose passphrase it holds, from the streamed text alone."""
    spec = load_scenario(SCENARIO)
    tok = build_tiny_tokenizer()  # the fake reads only the prompt's text: any tokenizer plans the same texts
    fake = FakeOpenAI(leak=True)
    events = []
    session = TargetSession(spec, tok, TargetOptions(url="http://fake", transport=fake.transport()),
                            detectors=("canary",), listeners=(events.append,))
    session.run()
    owner = {p.passphrase: p.request_id for p in plan_requests(spec, tok)}
    truth = {(owner[victim], owner[leaked]) for victim, leaked in fake.leaks}
    reports = {(e.victim, e.source) for e in events if isinstance(e, Contamination)}
    assert len(truth) >= REQUESTS - 1 and reports == truth
    assert all(e.kind == "cross_request" and e.detector == "canary" for e in events if isinstance(e, Contamination))


# -- the vendored llama-server --------------------------------------------------------------------------
def start_server(extra_args=()):
    from kvtui.models import ModelLoadError, default_model_path
    from kvtui.remote.llama_server import LlamaServer, find_llama_server

    if find_llama_server() is None:
        pytest.skip("llama-server not built: run scripts/build-llama-server.sh")
    try:
        gguf = default_model_path()
    except ModelLoadError as exc:
        pytest.skip(str(exc))
    return LlamaServer(gguf, parallel=2, ctx_per_slot=1024, threads=1, startup_timeout_s=300,
                       extra_args=extra_args)


@pytest.fixture(scope="module")
def default_server():
    with start_server() as server:
        yield server


@pytest.fixture(scope="module")
def control_server():
    with start_server(CONTROL_FLAGS) as server:
        yield server


def prompt_counters(url: str) -> float:
    """llamacpp:prompt_tokens_total: prompt tokens the server computed (cached ones excluded)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return next(s.value for family in text_string_to_metric_families(text) for s in family.samples
                if s.name == "llamacpp:prompt_tokens_total")


def audit(url: str, tmp_path: Path):
    """kvtui run of the scenario against `url`; returns (exit code, output, finishes, reports, cached tokens)."""
    rec = tmp_path / "run.jsonl"
    computed = prompt_counters(url)
    out = subprocess.run(KVTUI + ["run", str(SCENARIO), "--target", url, "--headless", "--detectors", "canary",
                                  "--timeout", "600", "--record", str(rec)],
                         capture_output=True, text=True, timeout=3600)
    computed = prompt_counters(url) - computed
    _, events, summary, truncated = read_recording(rec)
    assert not truncated and summary is not None, out.stdout + out.stderr
    finishes = [e for e in events if isinstance(e, Finish)]
    cached = sum(f.prompt_tokens for f in finishes) - computed
    return out, summary, finishes, [e for e in events if isinstance(e, Contamination)], cached


def check_clean(out, summary, finishes, reports) -> None:
    assert out.returncode == 0, out.stdout + out.stderr
    assert reports == [] and summary.contamination_total() == 0  # no answer holds another's passphrase
    assert len(finishes) == REQUESTS and summary.requests_completed == REQUESTS
    # SmolLM2 garbles a few passphrases on its own (measured: 69 of 72, the same ones with the cache off)
    assert summary.passphrase_echoed >= 0.9 * REQUESTS
    rounds = {}
    for f in finishes:  # the closed loop held: 12 alone, then pairs, then fours, arriving together
        rounds.setdefault(f.arrival_s, []).append(f.request_id)
    assert sorted(len(v) for v in rounds.values()) == [1] * 12 + [2] * 10 + [4] * 10


def alone(finishes) -> set[str]:
    """The requests that arrived with no other in flight (the 12 that fill the cache one at a time)."""
    rounds = {}
    for f in finishes:
        rounds.setdefault(f.arrival_s, []).append(f.request_id)
    return {ids[0] for ids in rounds.values() if len(ids) == 1}


@pytest.mark.llama_server
def test_prompt_cache_on_and_off_give_the_same_lone_answers_and_no_foreign_passphrase(default_server,
                                                                                     control_server, tmp_path):
    """Default flags, then the control, on the same plan: both clean; every request that ran alone answers
    the same with the cache on as with it off, so nothing the cache restored changed an answer.

    Answers in the concurrent rounds are not compared one for one: llama.cpp's kernels are not batch
    invariant, and which requests share a decode batch (and for how many steps) depends on timing. A CI
    run on another machine saw 5 of the 60 concurrent answers differ between the two servers (none with a
    foreign passphrase, the lone ones all equal); the canary is what guards those rounds."""
    runs = {}
    for name, server in (("default", default_server), ("control", control_server)):
        (tmp_path / name).mkdir()
        out, summary, finishes, reports, cached = audit(server.url, tmp_path / name)
        check_clean(out, summary, finishes, reports)
        runs[name] = ({f.request_id: f.output_text for f in finishes}, cached, alone(finishes))
    (default, cached_on, lone_on), (control, cached_off, lone_off) = runs["default"], runs["control"]
    assert lone_on == lone_off and len(lone_on) == 12
    assert {r: default[r] for r in lone_on} == {r: control[r] for r in lone_on}
    differing = sorted(r for r in default if default[r] != control[r])
    print(f"concurrent answers that differ with the cache on and off: {len(differing)} of {REQUESTS - 12}: "
          f"{differing}; cached prompt tokens {cached_on:.0f} (on) and {cached_off:.0f} (off)")
    assert len(differing) <= (REQUESTS - 12) // 2  # near-tie flips, not answers gone wrong wholesale
    # the shared opening (175 tokens) came from the cache for nearly every conversation: all but each
    # slot's first, measured 12,255 of 14,394 prompt tokens. The control's figure is the same (12,257):
    # a slot reuses its own previous prompt's KV there too, so the RAM cache adds nothing on this load
    assert cached_on >= 175 * (REQUESTS - 4) and cached_off >= 175 * (REQUESTS - 4)
