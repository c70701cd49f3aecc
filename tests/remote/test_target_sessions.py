"""Multi-turn sessions and trace replays against servers: each later turn carries the server's actual earlier
answers (the fake OpenAI server's log is the ground truth), think times hold between turns, every turn is
checked by the canary and replayed exactly by its solo rerun; a Mooncake sample replayed against `kvtui serve
--kv paged --prefix-caching` shows the trace's theoretical prefix hits beside the server's cached tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_openai import FakeOpenAI

from kvtui.events import Contamination
from kvtui.models import build_tiny_tokenizer
from kvtui.remote.session import TargetOptions, TargetSession
from kvtui.scenario import load_scenario, parse_scenario
from kvtui.scenario.trace import hit_table, read_trace
from kvtui.summary import trace_hit_rows

ROOT = Path(__file__).resolve().parents[2]
TOK = build_tiny_tokenizer()
FOLLOW_UP = "What was the passphrase? Reply with only the passphrase."


def sessions_scenario(turns: int = 3, think: float = 0.2):
    return parse_scenario(f"name: sessions-test\nseed: 5\nmax_requests: 2\nmodel: tiny-llama\n"
                          f"arrivals: {{process: burst, size: 2, every_s: 100}}\nprompts: {{kind: passphrase}}\n"
                          f"output_tokens: 8\nsessions: {{turns: {turns}, think_time_s: {{distribution: fixed, "
                          f"mean_s: {think}}}}}\n")


def run(fake: FakeOpenAI, spec, **options):
    events = []
    session = TargetSession(spec, TOK, TargetOptions(url="http://fake", transport=fake.transport(), **options),
                            listeners=(events.append,))
    summary = session.run()
    return session, events, summary


def test_each_later_turn_carries_the_servers_actual_answers():
    fake = FakeOpenAI(prefix_cache="prefix")
    session, events, summary = run(fake, sessions_scenario())
    assert sorted(session.results) == ["r000", "r000-t1", "r000-t2", "r001", "r001-t1", "r001-t2"]
    assert summary.requests_not_submitted == 0
    load = [b for b in fake.requests if "cache_salt" not in b]  # the solo reruns carry a fresh salt
    by_turn = {}
    for body in load:
        by_turn.setdefault(len(body["messages"]), []).append(body)
    assert sorted(by_turn) == [1, 3, 5] and all(len(v) == 2 for v in by_turn.values())
    for first in ("r000", "r001"):
        phrase = session.planned[first].passphrase
        answer1 = session.results[first].text
        answer2 = session.results[f"{first}-t1"].text
        assert answer1 == f"The passphrase is {phrase}." and phrase in session.planned[first].text
        turn3 = next(b for b in by_turn[5] if phrase in b["messages"][0]["content"])
        # turn 2's prompt holds turn 1's actual answer text; turn 3's holds both answers
        assert turn3["messages"][1] == {"role": "assistant", "content": answer1}
        assert turn3["messages"][2:] == [{"role": "user", "content": FOLLOW_UP},
                                         {"role": "assistant", "content": answer2},
                                         {"role": "user", "content": FOLLOW_UP}]
        turn2 = next(b for b in by_turn[3] if phrase in b["messages"][0]["content"])
        assert turn2["messages"][1]["content"] == answer1
        # the think time: a turn goes out no sooner than 0.2 s after the answer before it ended
        for k in (1, 2):
            before = session.results[first if k == 1 else f"{first}-t1"]
            assert session.results[f"{first}-t{k}"].sent_s - before.end_s >= 0.2 - 1e-3
    # the fake's prefix cache: each later turn's chat begins with a chat it saw, so it reports cached tokens
    assert [session.results[r].cached_tokens for r in ("r000", "r000-t1", "r000-t2")] == [0, 7, 7]
    # every turn was checked alone, with exactly the chat it sent
    assert summary.reference_checked == 6
    solo = [b for b in fake.requests if "cache_salt" in b]
    assert sorted(len(b["messages"]) for b in solo) == [1, 1, 3, 3, 5, 5]
    assert {tuple(m["content"] for m in b["messages"]) for b in solo} == \
        {tuple(m["content"] for m in b["messages"]) for b in load}
    assert not [e for e in events if isinstance(e, Contamination)]


def test_a_leak_into_a_later_turn_names_the_other_session_once():
    fake = FakeOpenAI(leak=True)  # answers with the passphrase of the previous different request seen
    session, events, _ = run(fake, sessions_scenario(turns=2, think=0.0), max_concurrency=1)
    leaks = [e for e in events if isinstance(e, Contamination) and e.detector == "canary"]
    assert leaks, "the fake leaked"
    firsts = {"r000", "r001"}
    assert all(e.source in firsts for e in leaks)  # a later turn is no source of its own
    assert len({(e.victim, e.source) for e in leaks}) == len(leaks)
    assert all(session.planned[e.victim].passphrase != session.planned[e.source].passphrase for e in leaks)


def test_sessions_refuse_the_completions_api():
    with pytest.raises(ValueError, match="--api chat"):
        TargetSession(sessions_scenario(), TOK, TargetOptions(url="http://fake", api="completions",
                                                              transport=FakeOpenAI().transport()))


def test_a_mooncake_trace_against_the_fake_reports_theoretical_and_cached_hits():
    spec = load_scenario(ROOT / "scenarios" / "trace_mooncake.yaml").model_copy(update={"model": "tiny-llama"})
    fake = FakeOpenAI(prefix_cache="honours_salt")
    session, _, summary = run(fake, spec)
    rows = read_trace("mooncake_sample.jsonl", ROOT / "scenarios" / "traces", "mooncake")
    # by hand from the sample's hash ids and the prompts' lengths (each at least the trace's)
    lengths = [len(session.planned[f"r{i:03d}"].prompt_ids) for i in range(30)]
    expect = hit_table([(None, r.hash_ids, n, None, None) for r, n in zip(rows, lengths)], 32)[0].theoretical
    got = summary.trace_prefix_hits["all"]
    assert (got["trace_hit_tokens"], got["trace_prompt_tokens"]) == (expect.hit_tokens, expect.prompt_tokens)
    assert expect.hit_tokens > 0
    assert got["cached_tokens"] == 0 and got["prompt_tokens"] == 7 * 30  # distinct prompts: no whole-prompt hit
    assert all(isinstance(b["prompt"], list) for b in fake.requests)  # token ids on the completions API


def served_model() -> str:
    """The default model (SmolLM2: its tokenizer says the passphrase's ending in 22 tokens) where it is
    installed, else tiny-llama (a byte-level tokenizer: 68 tokens, which cover more of each prompt's blocks)."""
    from helpers import smollm2_available

    return "default" if smollm2_available() else "tiny-llama"


@pytest.fixture(scope="module")
def paged_server():
    """`kvtui serve --kv paged --block-size 16 --prefix-caching` (served_model()), once for the module."""
    from kvtui.serve.options import ServeOptions
    from kvtui.serve.server import ServeServer

    options = ServeOptions(model=served_model(), port=0, slots=4, max_len=512, kv="paged", block_size=16,
                           prefix_caching=True, detectors=("canary",))
    with ServeServer(options) as server:
        yield server


def test_a_mooncake_sample_replayed_against_kvtui_serve_shows_both_hit_rates(paged_server):
    from kvtui.models import load_tokenizer

    spec = load_scenario(ROOT / "scenarios" / "trace_mooncake.yaml").model_copy(update={"model": served_model()})
    tok = load_tokenizer(served_model())
    session = TargetSession(spec, tok, TargetOptions(url=paged_server.url), detectors=("canary",))
    summary = session.run()
    assert summary.requests_completed == 30
    got = summary.trace_prefix_hits["all"]
    rows = read_trace("mooncake_sample.jsonl", ROOT / "scenarios" / "traces", "mooncake")
    lengths = [len(session.planned[f"r{i:03d}"].prompt_ids) for i in range(30)]
    expect = hit_table([(None, r.hash_ids, n, None, None) for r, n in zip(rows, lengths)], 32)[0].theoretical
    assert (got["trace_hit_tokens"], got["trace_prompt_tokens"]) == (expect.hit_tokens, expect.prompt_tokens)
    assert got["prompt_tokens"] == sum(lengths)  # the server counted the prompts as planned (token ids)
    # the server's prefix cache hit whole 16-token blocks of the shared prefixes: some, never more than the trace
    # allows (a block still being prefilled by a request in flight is no hit yet)
    assert 0 < got["cached_tokens"] <= got["trace_hit_tokens"] and got["cached_tokens"] % 16 == 0
    (label, text), = trace_hit_rows(summary.trace_prefix_hits)
    assert label == "trace prefix hits (all)"
    assert f"({got['trace_hit_tokens']} of {got['trace_prompt_tokens']} prompt tokens)" in text
    assert f"server cached {got['cached_tokens'] / got['prompt_tokens']:.1%}" in text
    print(f"\n{label}: {text}")
