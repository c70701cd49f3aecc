"""The load generator's fidelity (kvtui/remote/fidelity.py), its lean HTTP client (kvtui/remote/wire.py),
the mock OpenAI server (kvtui/remote/mock_openai.py) and `kvtui bench --part loadgen`'s table.

Timing checks run against the mock in a process of its own, with bounds wide enough for a busy 2-core
machine; the impossible-rate check makes the client late on purpose (a listener that sleeps on the loop)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from fake_openai import LLAMACPP_METRICS, FakeOpenAI

from kvtui.bench.loadgen import MockProcess, arrival_rate, markdown
from kvtui.cli.replay import replay_summary
from kvtui.events import Arrive, Finish, LoadFidelity, ServerSample, parse_event
from kvtui.models import build_tiny_tokenizer
from kvtui.record import read_recording
from kvtui.remote.fidelity import FidelityMeter, quantile, warning
from kvtui.remote.openai import stream_request
from kvtui.remote.session import TargetOptions, TargetSession
from kvtui.remote.wire import WirePool, usable
from kvtui.scenario import parse_scenario
from kvtui.summary import print_summary
from kvtui.tui.server_panels import _fidelity
from kvtui.tui.server_track import ServerTrack

TOK = build_tiny_tokenizer()
BODY = {"stream": True, "stream_options": {"include_usage": True}, "prompt": [1, 2, 3], "max_tokens": 32}


@pytest.fixture(scope="module")
def mock():
    with MockProcess(first_token_ms=20, gap_ms=5, tokens=32) as server:
        yield server


@pytest.fixture(scope="module")
def slow_mock():
    with MockProcess(first_token_ms=150, gap_ms=20, tokens=4) as server:
        yield server


def scenario(rate: float, n: int):
    return parse_scenario(f"name: fidelity\nseed: 1\nmax_requests: {n}\nmodel: tiny-llama\n"
                          f"arrivals: {{process: poisson, rate_per_s: {rate}}}\nprompts: {{kind: passphrase}}\n"
                          "output_tokens: 32\nsampling: {temperature: 0.0, ignore_eos: true}\n")


def run_session(url: str, rate: float, n: int, record=None, listeners=()):
    session = TargetSession(scenario(rate, n), TOK, TargetOptions(url=url, max_concurrency=1000),
                            detectors=("canary",), record_path=record, listeners=tuple(listeners))
    return session, session.run()


# -- the mock ------------------------------------------------------------------------------------
def test_mock_sends_the_first_token_after_its_delay_then_one_every_gap(slow_mock):
    async def go():
        pool = WirePool(slow_mock.url)
        result = await stream_request(pool, "/v1/completions", BODY, timeout_s=10, clock=time.perf_counter)
        await pool.aclose()
        return result

    before = len(slow_mock.arrivals())
    r = asyncio.run(go())
    assert r.finish_reason == "length" and r.text == " tok" * 4 and r.completion_tokens == 4
    ttft = r.first_s - r.sent_s
    assert 0.150 <= ttft < 0.150 + 0.100  # not before its delay; a busy machine may add some
    gaps = [b - a for a, b in zip(r.chunk_times_s, r.chunk_times_s[1:])]
    assert len(gaps) == 3 and sum(gaps) >= 3 * 0.020 - 0.005  # the tokens are timed from the arrival
    assert len(slow_mock.arrivals()) == before + 1


def test_mock_answers_models_and_404s_the_rest(mock):
    models = httpx.get(f"{mock.url}/v1/models").json()
    assert models["data"][0]["id"] == "mock"
    assert httpx.get(f"{mock.url}/metrics").status_code == 404


# -- the lean client ------------------------------------------------------------------------------
def test_wire_pool_reuses_one_connection_for_requests_in_turn(mock):
    async def go():
        pool = WirePool(mock.url)
        results = [await stream_request(pool, "/v1/completions", BODY, timeout_s=10) for _ in range(4)]
        await pool.aclose()
        return pool, results

    pool, results = asyncio.run(go())
    assert [r.output_tokens for r in results] == [32] * 4
    assert pool.opened == 1 and pool.retried == 0


class ClosingServer:
    """Answers each request on a connection with a short SSE stream saying `Connection: keep-alive`, then
    closes that connection anyway (as llama.cpp's server does); counts the requests it read."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests = 0
        self.headers: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                while len(body) < length:
                    body += conn.recv(65536)
                self.requests += 1
                self.headers.append(head)
                events = (b'data: {"choices":[{"index":0,"text":"a","finish_reason":"length"}]}\n\n'
                          b"data: [DONE]\n\n")
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: keep-alive\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(events), events))
                time.sleep(0.05)  # the close comes after the answer: a client may reuse the connection first

    def close(self) -> None:
        self.sock.close()


def test_a_connection_the_server_closed_is_sent_again_once_and_fresh_mode_never_reuses():
    server = ClosingServer()

    async def go(fresh: bool):
        pool = WirePool(server.url, fresh=fresh)
        results = []
        for _ in range(3):
            results.append(await stream_request(pool, "/v1/completions", BODY, timeout_s=10))
            await asyncio.sleep(0.15)  # the server has closed the idle connection by now
        await pool.aclose()
        return pool, results

    try:
        pool, results = asyncio.run(go(False))
        assert [r.finish_reason for r in results] == ["length"] * 3
        assert server.requests == 3  # each request read once: the retried ones had not been read
        pool, results = asyncio.run(go(True))
        assert [r.finish_reason for r in results] == ["length"] * 3 and pool.retried == 0 and pool.opened == 3
        assert all(b"Connection: close" in h for h in server.headers[3:])
    finally:
        server.close()


def test_wire_errors_read_as_httpx_errors():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed

    async def go():
        return await stream_request(WirePool(f"http://127.0.0.1:{port}"), "/v1/completions", BODY, timeout_s=5)

    r = asyncio.run(go())
    assert r.finish_reason == "error" and r.error.startswith("ConnectError")
    assert usable("http://127.0.0.1:8000") and not usable("https://example.com") \
        and not usable("http://h:1", transport=object())


# -- fidelity -------------------------------------------------------------------------------------
def test_fidelity_figures_from_planned_and_sent_times():
    cpu = iter([10.0, 10.5])
    now = iter([0.0, 2.0])
    meter = FidelityMeter(lambda: next(now), cpu=lambda: next(cpu))
    meter.start()
    for k in range(11):  # planned every 0.1 s; sent 1 ms late, the last 40 ms late
        meter.record(k * 0.1, k * 0.1 + (0.040 if k == 10 else 0.001))
    f = meter.figures(2.0)
    assert f.requests_sent == 11 and f.requested_rate_per_s == pytest.approx(10.0)
    assert f.achieved_rate_per_s == pytest.approx(10 / 1.039)
    assert f.lag_p50_s == pytest.approx(0.001) and f.lag_max_s == pytest.approx(0.040)
    assert f.lag_p99_s == pytest.approx(quantile(sorted(meter.lags), 0.99)) and f.lag_p99_s > 0.010
    assert f.client_cpu_s == pytest.approx(0.5) and f.client_cpu_share == pytest.approx(0.25)
    assert f.warning.startswith("the client limited this run, not the server") and "p99 36 ms (max 40 ms)" in f.warning
    assert "busy machine" in f.warning  # a late client at 25% of a core was starved, not slow


def test_no_warning_when_on_time_and_the_cap_is_named_when_it_held_requests():
    on_time = LoadFidelity(t=1, requests_sent=5, requested_rate_per_s=100, achieved_rate_per_s=97,
                           lag_p50_s=0.001, lag_p99_s=0.002, lag_max_s=0.002)
    assert warning(on_time) is None  # 3% short over 4 gaps is 1 ms behind: no shortfall
    capped = on_time.model_copy(update={"requests_sent": 500, "achieved_rate_per_s": 60, "capped": 300})
    assert warning(capped, 8).startswith("the concurrency cap (--max-concurrency 8) held back 300 requests")


def test_fidelity_of_a_tiny_run_against_the_mock(mock, tmp_path):
    record = tmp_path / "run.jsonl"
    session, summary = run_session(mock.url, 20.0, 30, record=record)
    f = summary.load_fidelity
    assert summary.requests_completed == 30 and f.requests_sent == 30 and f.capped == 0
    assert all(lag >= 0 for lag in session.fidelity.lags) and f.lag_p50_s >= 0
    assert 0.9 * f.requested_rate_per_s <= f.achieved_rate_per_s <= 1.1 * f.requested_rate_per_s
    assert 0 < f.client_cpu_s and 0 < f.client_cpu_share < 2.0 and f.wall_s > 0.5
    # the recording round-trips: the per-request lags, the events, the summary field; replay reads them
    header, events, recorded_summary, _ = read_recording(record)
    finishes = [e for e in events if isinstance(e, Finish)]
    assert sorted(e.send_lag_s for e in finishes) == pytest.approx(sorted(session.fidelity.lags))
    assert all(e.send_lag_s == pytest.approx(e.sent_s - e.arrival_s) for e in finishes)  # no cap here
    recorded = [e for e in events if isinstance(e, LoadFidelity)]
    assert recorded and recorded[-1] == f
    assert recorded_summary.load_fidelity == f
    assert replay_summary(header, events, recorded_summary).load_fidelity == f


def test_a_client_that_cannot_keep_up_says_so_in_one_line(mock, capsys):
    def slow_listener(event):
        if isinstance(event, Arrive):
            time.sleep(0.03)  # bookkeeping that blocks the sending loop: 30 ms per arrival at 50 req/s

    session, summary = run_session(mock.url, 50.0, 40, listeners=(slow_listener,))
    f = summary.load_fidelity
    assert f.lag_p99_s > 0.1 and f.achieved_rate_per_s < 0.98 * f.requested_rate_per_s
    assert f.warning.startswith("the client limited this run, not the server")
    from rich.console import Console

    console = Console(width=200)
    print_summary(summary, session.header(), console)
    printed = capsys.readouterr().out
    assert printed.count("warning:") == 1 and "schedule lag p50 / p99 / max" in printed
    assert "rate requested / achieved" in printed and "client CPU (the load)" in printed


def test_new_fields_round_trip_and_old_lines_still_parse():
    f = LoadFidelity(t=3.0, requests_sent=4, requested_rate_per_s=20.0, achieved_rate_per_s=19.5, lag_p50_s=0.001,
                     lag_p99_s=0.02, lag_max_s=0.03, client_cpu_s=0.2, wall_s=1.0, client_cpu_share=0.2,
                     warning="late")
    assert parse_event(json.loads(f.to_json())) == f
    finish = Finish(t=1.0, request_id="r0", finish_reason="stop", sent_s=0.5, arrival_s=0.49, send_lag_s=0.01)
    assert parse_event(json.loads(finish.to_json())).send_lag_s == 0.01
    old = json.loads(finish.to_json())
    del old["send_lag_s"]
    assert parse_event(old).send_lag_s is None


def test_an_old_target_recording_still_replays_without_fidelity(mock, tmp_path, capsys):
    """A target recording as kvtui wrote it before it measured fidelity: no load.fidelity lines, no
    send_lag_s, no load_fidelity in the summary (a new run's recording with those taken out)."""
    from rich.console import Console

    new, old = tmp_path / "new.jsonl", tmp_path / "old.jsonl"
    run_session(mock.url, 20.0, 5, record=new)
    lines = []
    for line in new.read_text().splitlines():
        data = json.loads(line)
        if data["type"] == "load.fidelity":
            continue
        data.pop("send_lag_s", None)
        data.pop("load_fidelity", None)
        lines.append(json.dumps(data))
    old.write_text("\n".join(lines) + "\n")
    header, events, recorded, truncated = read_recording(old)
    assert header.target == mock.url and header.version == 3 and not truncated
    summary = replay_summary(header, events, recorded)
    assert summary.load_fidelity is None and summary.requests_completed == 5
    assert all(e.send_lag_s is None for e in events if isinstance(e, Finish))
    print_summary(summary, header, Console(width=200))
    printed = capsys.readouterr().out
    assert "schedule lag" not in printed and "warning:" not in printed and "TTFT p50" in printed


def test_dashboard_panel_shows_lag_rate_cpu_and_the_warning():
    track = ServerTrack("http://x")
    assert _fidelity(track.view({}).fidelity)[1] == "dim"
    track.apply(LoadFidelity(t=1, requests_sent=9, requested_rate_per_s=200, achieved_rate_per_s=150, lag_p50_s=0.002,
                             lag_p99_s=0.050, lag_max_s=0.06, client_cpu_s=1, wall_s=1, client_cpu_share=1.0,
                             warning="the client limited this run"))
    text, style = _fidelity(track.view({}).fidelity)
    assert "lag p50 2.0 p99 50.0 ms" in text and "150.0/200.0 req/s" in text and "CPU 100%" in text
    assert text.endswith("the client limited this run") and style == "yellow"


# -- the bench's table ----------------------------------------------------------------------------
def test_bench_markdown_and_arrival_rate():
    assert arrival_rate([0.0, 0.5, 1.0]) == 2.0 and arrival_rate([1.0]) is None
    row = {"rate": 100.0, "client": "kvtui", "requests": 500, "rounds": 2, "requested_rate": 101.0,
           "arrival_rate": 100.5, "sent_rate": 100.4, "lag_p50_ms": 0.5, "lag_p99_ms": 4.0, "ttft_p50_ms": 21.0,
           "cpu_share": 0.4, "client_added_ttft_p50_ms": 1.0, "warnings": 0}
    lines = markdown({"cpu": "AMD EPYC", "cores": 2, "load_average": (1.0, 2.0, 3.0), "first_token_ms": 20,
                      "gap_ms": 5, "tokens": 32, "run_seconds": 5, "vllm": False, "rows": [row]})
    assert lines[0].startswith("AMD EPYC, 2 cores, load average 1.00 / 2.00 / 3.00")
    assert "| 100 | kvtui | 101.0 | 100.5 | 100.4 | 0.5 / 4.0 | 21.0 | 1.0 | 40% | 0 of 2 |" in lines
    assert lines[-1].startswith("vllm bench serve: not installed")


# -- the stream read at its end ------------------------------------------------------------------------
def test_a_stream_folded_at_its_end_equals_one_parsed_chunk_by_chunk(mock):
    """The load's requests keep each event after the first chunk as bytes and parse them when the answer
    ends; a caller that watches every chunk (on_chunk) parses each as it comes. Both give the mock's 32
    tokens with their logprobs, one chunk time each, and the first chunk is reported once, when it came."""
    body = {**BODY, "logprobs": 5}
    firsts = []

    async def go():
        pool = WirePool(mock.url)
        folded = await stream_request(pool, "/v1/completions", body, timeout_s=10,
                                      on_first=lambda r: firsts.append((len(r.chunk_times_s), r.first_s)))
        seen = await stream_request(pool, "/v1/completions", body, timeout_s=10, on_chunk=lambda r, piece: None)
        await pool.aclose()
        return folded, seen

    folded, seen = asyncio.run(go())
    assert firsts == [(1, folded.first_s)]
    for r in (folded, seen):
        assert r.finish_reason == "length" and r.text == " tok" * 32 and r.completion_tokens == 32
        assert len(r.chunk_times_s) == 32 and r.chunk_times_s == sorted(r.chunk_times_s)
        assert r.first_s == r.chunk_times_s[0] and r.end_s == r.chunk_times_s[-1]
        assert r.token_ids() == ()  # the completions shape carries no ids
    assert folded._unparsed  # the logprobs are not parsed until read
    assert folded.tokens == seen.tokens and not folded._unparsed
    assert folded.tokens[0].top == ((" tok", -0.1), (" tak", -2.5), (" tik", -3.0), (" tuk", -3.5), (" tek", -4.0))


class _Answer:
    status_code = 200
    path = "/v1/chat/completions"


def _fold(lines: list[bytes], on_chunk=None):
    """`lines` read as one answer's body (clock: 1, 2, 3, ... s); (the result, the error it raised or None)."""
    from kvtui.remote.openai import StreamResult, _read_answer

    async def feed():
        for line in lines:
            yield line

    result = StreamResult(sent_s=0.0)
    clock = iter(range(1, 100))
    try:
        asyncio.run(_read_answer(_Answer(), feed(), None, result, lambda: float(next(clock)), on_chunk))
    except (ValueError, AttributeError) as e:  # what stream_request turns into the request's error (BadAnswer too)
        return result, f"{type(e).__name__}: {e}"
    return result, None


def chunk(piece: str, finish: str | None = None, logprobs=None) -> bytes:
    choice = {"index": 0, "delta": {"content": piece}, "finish_reason": finish,
              **({"logprobs": logprobs} if logprobs is not None else {})}
    return b"data: " + json.dumps({"choices": [choice]}).encode()


def test_a_bad_event_after_the_first_chunk_fails_as_when_read_chunk_by_chunk():
    """An event that is not JSON, or logprobs that cannot be read, fail the request with the error the
    chunk-by-chunk reading gives, the chunks before it kept."""
    lines = [chunk(" a"), b"", chunk(" b"), b"", b"data: {not json", b"", chunk(" c", "stop"), b"data: [DONE]"]
    folded, error = _fold(lines)
    seen, seen_error = _fold(lines, on_chunk=lambda r, piece: None)
    assert error == seen_error and error.startswith("BadAnswer: a stream event that is not JSON: '{not json'")
    assert folded.pieces == seen.pieces == [" a", " b"] and folded.chunk_times_s == [1.0, 2.0]
    bad = [chunk(" a"), chunk(" b", logprobs=[1, 2]), chunk(" c", "stop"), b"data: [DONE]"]
    folded, error = _fold(bad)
    assert error == _fold(bad, on_chunk=lambda r, piece: None)[1] == "AttributeError: 'list' object has no attribute 'get'"
    ids = {"content": [{"id": 7, "token": " x", "logprob": -0.5, "top_logprobs": [{"id": 7, "token": " x",
                                                                                    "logprob": -0.5}]}]}
    good = [chunk(" x", logprobs=ids), chunk(" x", "stop", logprobs=ids), b"data: [DONE]", chunk(" after")]
    folded, error = _fold(good)
    assert error is None and folded.text == " x x" and folded.finish_reason == "stop"  # nothing read after [DONE]
    assert folded.token_ids() == (7, 7) and [t.key for t in folded.tokens] == [7, 7]


def test_the_server_counters_are_read_before_the_schedule_starts():
    """A /metrics that takes 300 ms to answer is read before the load's start, not after it: the first
    request goes out on time, and the start's sample is at t = 0."""
    class SlowMetrics(FakeOpenAI):
        async def handle(self, request):
            if request.url.path == "/metrics":
                await asyncio.sleep(0.3)
            return await super().handle(request)

    fake = SlowMetrics(metrics=LLAMACPP_METRICS)
    spec = parse_scenario("name: probe\nseed: 1\nmax_requests: 2\nmodel: tiny-llama\narrivals: {process: burst, "
                          "size: 2, every_s: 100}\nprompts: {kind: passphrase}\noutput_tokens: 4\n")
    events = []
    session = TargetSession(spec, TOK, TargetOptions(url="http://fake", transport=fake.transport()),
                            detectors=(), listeners=(events.append,))
    session.run()
    lags = [e.send_lag_s for e in events if isinstance(e, Finish)]
    assert len(lags) == 2 and max(lags) < 0.15  # the probe's 300 ms are not in them
    samples = [e for e in events if isinstance(e, ServerSample)]
    assert samples[0].t == 0.0 and samples[0].running == 3.0
