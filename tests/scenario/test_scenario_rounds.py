"""`arrivals: {process: rounds}` (closed-loop rounds) and passphrase `openings`: planning, validation, and
the gate in both runners: kvtui's own session (virtual clock) and a `--target` session (fake server)."""

from __future__ import annotations

import httpx
import pytest
from fake_openai import FakeOpenAI

from kvtui.events import Arrive, Finish
from kvtui.models import build_tiny_tokenizer
from kvtui.remote.session import TargetOptions, TargetSession
from kvtui.scenario import ScenarioError, parse_scenario, plan_requests
from kvtui.session import Session

TOK = build_tiny_tokenizer()
ROUNDS = "{process: rounds, rounds: [{size: 1, count: 3}, {size: 2, count: 2}, {size: 3}]}"


def spec(arrivals: str = ROUNDS, prompts: str = "{kind: passphrase}", extra: str = ""):
    return parse_scenario(f"name: rounds-test\nseed: 1\nmodel: tiny-llama\nengine: {{slots: 4, max_len: 128}}\n"
                          f"arrivals: {arrivals}\nprompts: {prompts}\noutput_tokens: 6\n{extra}")


def test_rounds_plan_requests_in_round_order():
    plan = plan_requests(spec(), TOK)
    assert [p.round for p in plan] == [0, 1, 2, 3, 3, 4, 4, 5, 5, 5]
    assert [p.request_id for p in plan] == [f"r{i:03d}" for i in range(10)]
    assert {p.arrival_s for p in plan} == {0.0}  # the times are set while running
    assert [p.round for p in plan_requests(spec(extra="max_requests: 4"), TOK)] == [0, 1, 2, 3]


@pytest.mark.parametrize("text, message", [
    ("arrivals: {process: rounds, rounds: []}\nmax_requests: 2", "rounds"),
    ("arrivals: {process: rounds, rounds: [{size: 0}]}", "size"),
    ("arrivals: {process: rounds, rounds: [{size: 2}]}\nduration_s: 5", "duration_s cannot end rounds"),
    ("prompts: {kind: passphrase, openings: [a, b]}", "template has no {opening}"),
    ('prompts: {kind: passphrase, template: "{opening} {passphrase}"}', "no openings are given"),
])
def test_rounds_and_openings_refuse_what_cannot_run(text, message):
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(f"model: tiny-llama\nmax_requests: 4\narrivals: {{process: burst, size: 1, every_s: 1}}\n{text}"
                       if "arrivals" not in text else f"model: tiny-llama\n{text}")


def test_openings_give_groups_that_share_a_prefix():
    prompts = '{kind: passphrase, openings: ["Alpha story.", "Beta story.", "Gamma story."], ' \
              'template: "{opening} The passphrase is {passphrase}."}'
    plan = plan_requests(spec(prompts=prompts), TOK)
    texts = [p.text for p in plan]
    assert [p.facts.opening for p in plan[:5]] == [0, 1, 2, 0, 1]
    assert texts[0] == f"Alpha story. The passphrase is {plan[0].passphrase}."
    assert texts[4].startswith("Beta story. The passphrase is ")
    assert len({p.passphrase for p in plan}) == len(plan)


def gates_hold(arrives: dict[str, float], finishes: dict[str, float], plan) -> None:
    """Each round arrives together, exactly when (local) / not before (target) the rounds before finished."""
    by_round: dict[int, list[str]] = {}
    for p in plan:
        by_round.setdefault(p.round, []).append(p.request_id)
    for k in range(1, len(by_round)):
        done = max(finishes[rid] for j in range(k) for rid in by_round[j])
        starts = {arrives[rid] for rid in by_round[k]}
        assert len(starts) == 1, f"round {k} did not arrive together: {starts}"
        assert starts.pop() >= done - 1e-9, f"round {k} arrived before round {k - 1} finished"


def test_local_session_sends_each_round_once_the_rounds_before_finished(tiny):
    s = spec()
    events = []
    session = Session(s, tiny["tiny-llama"], clock="virtual", listeners=(events.append,), detectors=("canary",))
    session.run()
    arrives = {e.request_id: e.t for e in events if isinstance(e, Arrive)}
    finishes = {e.request_id: e.finish_s for e in events if isinstance(e, Finish)}
    assert len(arrives) == len(finishes) == 10
    plan = plan_requests(s, tiny["tiny-llama"].tokenizer)
    gates_hold(arrives, finishes, plan)
    # on the virtual clock a round arrives at the very moment the last request before it finished
    assert arrives["r001"] == finishes["r000"] and arrives["r003"] == arrives["r004"] == finishes["r002"]
    assert arrives["r001"] > 0


def test_target_session_sends_each_round_once_the_rounds_before_finished():
    fake = FakeOpenAI(delay_s=0.01)
    events = []
    s = spec()
    session = TargetSession(s, TOK, TargetOptions(url="http://fake", transport=fake.transport()),
                            detectors=("canary",), listeners=(events.append,))
    session.run()
    arrives = {e.request_id: e.t for e in events if isinstance(e, Arrive)}
    finishes = {e.request_id: e.finish_s for e in events if isinstance(e, Finish)}
    assert session.summary.finish_reasons == {"stop": 10}
    gates_hold(arrives, finishes, plan_requests(s, TOK))
    assert fake.max_in_flight == 3  # the last round's three at once, never more


# -- rounds' cancel: the client cuts a request mid-answer ---------------------------------------------
CANCELS = "{process: rounds, rounds: [{size: 1, count: 2}, {size: 3, count: 2, cancel: 2, cancel_after: 2}]}"


def test_cancel_marks_the_first_requests_of_each_round():
    plan = plan_requests(spec(CANCELS), TOK)
    assert [p.cancel_after for p in plan] == [None, None, 2, 2, None, 2, 2, None]
    with pytest.raises(ScenarioError, match="cancel 4 is over the round's size 3"):
        spec("{process: rounds, rounds: [{size: 3, cancel: 4}]}")


def test_local_session_aborts_a_cancelled_request_after_its_tokens(tiny):
    events = []
    Session(spec(CANCELS), tiny["tiny-llama"], clock="virtual", listeners=(events.append,),
            detectors=("canary",)).run()
    finishes = {e.request_id: e for e in events if isinstance(e, Finish)}
    assert {r for r, f in finishes.items() if f.finish_reason == "abort"} == {"r002", "r003", "r005", "r006"}
    assert all(len(finishes[r].output_ids) == 2 for r in ("r002", "r003", "r005", "r006"))
    assert {len(finishes[r].output_ids) for r in ("r000", "r001", "r004", "r007")} == {6}


class _Hosts(httpx.AsyncBaseTransport):
    """A transport that notes each request's host and path and hands it to the fake server."""

    def __init__(self, inner: httpx.AsyncBaseTransport):
        self.inner, self.seen = inner, []

    async def handle_async_request(self, request):
        self.seen.append((request.url.host, request.url.path))
        return await self.inner.handle_async_request(request)


def test_target_session_cuts_cancelled_streams_and_sends_solo_runs_to_the_reference_server():
    fake = FakeOpenAI(delay_s=0.01)
    hosts = _Hosts(fake.transport())
    events = []
    session = TargetSession(spec(CANCELS), TOK, TargetOptions(url="http://load", transport=hosts,
                                                              reference_url="http://control"),
                            listeners=(events.append,))
    session.run()
    finishes = {e.request_id: e for e in events if isinstance(e, Finish)}
    cut = {r for r, f in finishes.items() if f.finish_reason == "abort"}
    assert cut == {"r002", "r003", "r005", "r006"}
    assert all("cancelled by the client after 2 tokens" in finishes[r].detail for r in cut)
    assert session.summary.finish_reasons == {"abort": 4, "stop": 4}
    completions = [host for host, path in hosts.seen if path.endswith("/completions")]
    # 8 load requests to the target, then the 4 completed ones sent again alone to the control
    assert completions == ["load"] * 8 + ["control"] * 4 and session.reference_checked == 4
