"""What a `--target` run reports and shows, against the fake server (tests/fake_openai.py): failed requests
apart from throughput and reference checks, changed-answer excerpts that show the change, the findings
line, base URLs with /v1, long served model ids, steps a target run does not have, the dashboard in the
seconds before the session exists, and how vLLM's role-only first chat chunk is timed."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading

import httpx
import pytest
from fake_openai import FakeHTTPServer, FakeOpenAI
from rich.console import Console

from kvtui.events import Contamination, Header, ReferenceEvidence
from kvtui.metrics import Metrics
from kvtui.models import ModelLoadError, build_tiny_tokenizer
from kvtui.remote.session import TargetError, TargetOptions, TargetSession
from kvtui.scenario import parse_scenario, plan_requests
from kvtui.summary import differing_excerpts, evidence_text, print_summary

KVTUI = [sys.executable, "-m", "kvtui.cli"]
TOK = build_tiny_tokenizer()


def scenario(n: int = 4):
    return parse_scenario(f"name: report-test\nseed: 3\nmax_requests: {n}\nmodel: tiny-llama\n"
                          "arrivals: {process: burst, size: 16, every_s: 100}\nprompts: {kind: passphrase}\n"
                          "output_tokens: 8\n")


def printed(summary, header, width: int = 200) -> str:
    console = Console(width=width, color_system=None)
    with console.capture() as capture:
        print_summary(summary, header, console)
    return capture.get()


def target_header(model: str = "fake-model") -> Header:
    return Header.model_validate({"type": "header", "clock": "wall", "scenario": {"name": "report-test"},
                                  "model": {"id": model, "dtype": "served"}, "engine": {"api": "chat"},
                                  "target": "http://127.0.0.1:8000"})


# -- failed requests ----------------------------------------------------------------------------------
def test_failed_requests_are_reported_as_failed_and_left_out_of_tokens_and_reference_checks():
    """Two of four requests fail (HTTP 500, a timeout): as vLLM's bench serve counts only successful
    requests, the token totals and output tokens/s are the two answers' (the fake's usage: 7 prompt
    and 5 completion tokens each), and the failed ones are neither checked nor 'skipped (sampled out
    or left at a stop)': the summary names them as failed."""
    spec = scenario(4)
    phrases = sorted(p.passphrase for p in plan_requests(spec, TOK))
    fake = FakeOpenAI(fail=(phrases[0],), hang=(phrases[1],))
    session = TargetSession(spec, TOK, TargetOptions(url="http://fake", transport=fake.transport(), timeout_s=0.5))
    s = session.run()
    assert s.finish_reasons == {"stop": 2, "error": 2}
    assert (s.prompt_tokens, s.generated_tokens) == (2 * 7, 2 * 5)
    assert s.output_tokens_per_s == pytest.approx(10 / s.duration_s)
    assert (s.reference_checked, s.reference_skipped) == (2, 0)
    text = printed(s, session.header())
    assert re.search(r"failed requests +2 \(error 2\): no complete answer", text)
    assert re.search(r"reference checks +2 checked *\n", text) and "skipped" not in text


# -- the report text ------------------------------------------------------------------------------------
def test_changed_answer_excerpts_show_where_the_two_answers_differ():
    """Two answers alike in their first 50 characters: 40-character excerpts from the start printed the
    same text twice; the excerpts now start 10 characters before the first difference."""
    same = "The passphrase is VELVET-ORCHID-42, and the "
    batched, solo = same + "harbor opens at nine.", same + "garden opens at ten."
    start = len(same) - 10
    assert differing_excerpts(batched, solo) == ("…" + batched[start:], "…" + solo[start:])
    assert differing_excerpts("short A", "short B") == ("short A", "short B")  # a difference early: from 0
    report = Contamination(t=1.0, step=-1, detector="reference", kind="corruption", victim="r001", evidence=
                           ReferenceEvidence(token_index=9, batched_token=11, solo_token=12, top2_gap=2.5,
                                             tolerance=0.5, batched_text=batched, solo_text=solo))
    line = evidence_text(report)
    assert f"{'…' + batched[start:]!r} vs {'…' + solo[start:]!r}" in line


def test_findings_line_without_findings_lists_the_reports_alone():
    metrics = Metrics()
    metrics.add_event(Contamination(t=1.0, step=-1, detector="reference", kind="numeric", victim="r001",
                                    evidence=ReferenceEvidence(token_index=2, batched_token=1, solo_token=2,
                                                               top2_gap=0.01, tolerance=0.5, batched_text="a b",
                                                               solo_text="a c")))
    text = printed(metrics.summary(), target_header())
    assert re.search(r"contamination findings +0 \(reports: reference numeric 1\)", text) and "(;" not in text


def test_a_long_served_model_id_is_never_broken_mid_word():
    model = "/root/.cache/kvtui/SmolLM2-135M-Instruct-b179c9523d0e"  # vLLM serves the folder's path
    text = printed(Metrics().summary(), target_header(model), width=100)
    assert f"({model}," in text.replace("\n", " ").split()  # whole, on one line: wrapped at spaces only


# -- base URLs -----------------------------------------------------------------------------------------
def test_a_base_url_ending_in_v1_is_taken(tmp_path):
    from kvtui.cli.target import check_url

    assert check_url("http://127.0.0.1:8000/v1/") == check_url("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000"
    assert check_url("http://127.0.0.1:8000/proxy/") == "http://127.0.0.1:8000/proxy"
    path = tmp_path / "s.yaml"
    path.write_text("name: v1\nseed: 3\nmax_requests: 2\nmodel: tiny-llama\n"
                    "arrivals: {process: burst, size: 2, every_s: 9}\nprompts: {kind: passphrase}\noutput_tokens: 8\n")
    with FakeHTTPServer(FakeOpenAI()) as url:
        out = subprocess.run(KVTUI + ["run", str(path), "--target", url + "/v1", "--headless"], capture_output=True,
                             text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"against {url} (fake-model" in out.stdout and re.search(r"requests +2 \(stop 2\)", out.stdout)


def test_a_url_without_v1_models_says_what_to_give():
    def not_found(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, text="Not Found")

    session = TargetSession(scenario(1), TOK, TargetOptions(url="http://host/api", transport=httpx.MockTransport(not_found)))
    with pytest.raises(TargetError, match=r"http://host/api/v1/models answered 404 .* Give http://HOST:PORT"):
        session.run()


# -- the dashboard ---------------------------------------------------------------------------------------
def test_contamination_panel_shows_no_step_for_a_target_report():
    from kvtui.tui import panels
    from kvtui.tui.snapshot_build import build_snapshot
    from kvtui.tui.state import DashboardState

    state = DashboardState()
    state.apply(target_header())
    state.apply(Contamination(t=1.0, step=-1, detector="canary", kind="cross_request", victim="r003",
                              source="r001", evidence={"leaked": "VELVET-ORCHID-42", "matched": "VELVET-ORCHID-42",
                                                       "text": "VELVET-ORCHID-42"}))
    text = panels.contamination(build_snapshot(state), 100, 12).plain
    assert "canary cross_request r003 ← r001" in text and "#-1" not in text


def test_header_keeps_a_long_model_ids_last_part_when_the_whole_does_not_fit():
    from kvtui.tui import panels
    from kvtui.tui.snapshot_build import build_snapshot
    from kvtui.tui.state import DashboardState

    state = DashboardState()
    state.apply(target_header("/root/.cache/kvtui/SmolLM2-135M-Instruct-b179c9523d0e"))
    line = panels.header(build_snapshot(state), "LIVE", 110).plain
    assert "· SmolLM2-135M-Instruct-b179c9523d0e " in line and "/root" not in line and "LIVE" in line


def test_dashboard_is_up_while_the_session_is_made_and_shows_why_it_failed():
    """The tokenizer loads and the requests are planned in the dashboard's worker: the screen says so
    from the first frame (it stayed blank for seconds), and a failure stays on screen until q."""
    from kvtui.tui.app import KvtuiApp, screen_text
    from kvtui.tui.target_source import TargetSource

    release = threading.Event()

    def slow_failure(listener):
        release.wait(30)
        raise ModelLoadError("unknown model 'nope': give a model name or path")

    async def go():
        source = TargetSource(slow_failure, loading_text="loading the tokenizer of nope and planning the requests…")
        app = KvtuiApp(source)
        async with app.run_test(size=(120, 30)) as pilot:
            await pilot.pause(0.5)
            loading = screen_text(app)
            release.set()
            deadline = asyncio.get_running_loop().time() + 30
            while source.setup_error is None:
                assert asyncio.get_running_loop().time() < deadline, "the session was never tried"
                await pilot.pause(0.05)
            await pilot.pause(0.3)
            failed = screen_text(app)
            await pilot.press("q")
        return source, loading, failed

    source, loading, failed = asyncio.run(go())
    assert "LOADING" in loading.splitlines()[0] and "loading the tokenizer of" in loading
    assert "ERROR" in failed.splitlines()[0] and "unknown model 'nope'" in failed
    assert isinstance(source.setup_error, ModelLoadError) and source.summary is None


# -- timing of vLLM's role-only first chat chunk ------------------------------------------------------------
def test_role_only_first_chat_chunk_is_timed_as_vllm_bench_serve_times_it():
    """vLLM's chat stream opens with a chunk holding only `delta.role`, sent together with the first
    token's chunk. vLLM's bench serve (endpoint_request_func.py) timestamps every chunk with a choice:
    TTFT ends at that role chunk and the gap to the first content chunk is an ITL sample of ~0. kvtui
    counts it the same way so its figures compare with bench serve's (docs/audits.md, Endpoints used, says so).
    Fake clock: send at 0, role chunk and first token at 0.4, four more tokens 0.1 apart."""
    steps = [0.4, 0.4, 0.5, 0.6, 0.7, 0.8, 0.8, 0.8]
    fake = FakeOpenAI(clock_steps=steps, now=0.0)
    session = TargetSession(scenario(1), TOK, TargetOptions(url="http://fake", transport=fake.transport()),
                            detectors=(), clock=fake.clock)
    s = session.run()
    body = fake.requests[0]
    assert "messages" in body  # the chat API: the fake's first chunk is role-only
    assert s.time_to_first_token_seconds.p50 == pytest.approx(0.4)
    itl = [0.0, 0.1, 0.1, 0.1, 0.1, 0.0]  # role -> first token, four tokens, last token -> finish chunk
    assert s.inter_token_latency_seconds.count == len(itl)
    assert s.inter_token_latency_seconds.mean == pytest.approx(sum(itl) / len(itl))
    assert json.loads(json.dumps(s.inter_token_latency_seconds.p50)) == pytest.approx(0.1)
