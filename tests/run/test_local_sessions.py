"""A scenario with `sessions` run locally: the engine sends each session's first turn only (later turns need
the server's real answers) and the run says so in a marker; the plan is the one without sessions."""

from __future__ import annotations

from kvtui.events import Arrive, Marker
from kvtui.run.build import SESSIONS_LOCAL
from kvtui.scenario import parse_scenario, plan_requests
from kvtui.session import Session


def test_a_local_run_sends_first_turns_and_says_so(tiny):
    spec = parse_scenario("name: s\nseed: 2\nmax_requests: 3\nmodel: tiny-llama\nengine: {slots: 4, max_len: 256}\n"
                          "arrivals: {process: burst, size: 3, every_s: 10}\noutput_tokens: 4\n"
                          "sessions: {turns: 3}\n")
    events = []
    session = Session(spec, tiny["tiny-llama"], clock="virtual", detectors=("canary",), listeners=(events.append,))
    summary = session.run()
    arrived = [e.request_id for e in events if isinstance(e, Arrive)]
    assert arrived == ["r000", "r001", "r002"] and summary.requests_finished == 3
    assert [e.text for e in events if isinstance(e, Marker)] == [SESSIONS_LOCAL]
    without = parse_scenario("name: s\nseed: 2\nmax_requests: 3\nmodel: tiny-llama\n"
                             "arrivals: {process: burst, size: 3, every_s: 10}\noutput_tokens: 4\n")
    tok = tiny["tiny-llama"].tokenizer
    assert [p.prompt_ids for p in plan_requests(spec, tok)] == [p.prompt_ids for p in plan_requests(without, tok)]
