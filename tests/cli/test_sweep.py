"""`kvtui sweep SCENARIO --target URL`: one run per rate against the fake server (tests/fake_openai.py),
served one request at a time so that TTFT grows with the rate: the table's figures against each run's own
recording, the knee, the re-timed arrivals and the SVG's axes."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET

import pytest
from fake_openai import FakeHTTPServer, FakeOpenAI

from kvtui.events import Arrive, Finish
from kvtui.record import read_recording
from kvtui.remote.sweep import SweepPoint, retimed, slo_knee, throughput_knee
from kvtui.scenario import parse_scenario
from kvtui.scenario.plan import derive_seed

KVTUI = [sys.executable, "-m", "kvtui.cli"]
SCENARIO = ("name: sweep-test\nseed: 3\nmax_requests: 6\nmodel: tiny-llama\narrivals: {process: poisson, "
            "rate_per_s: 1}\nprompts: {kind: passphrase}\noutput_tokens: 8\nslo: {ttft_s: 0.5}\n")


class SerialServer(FakeHTTPServer):
    """The fake over HTTP, answering one request at a time (the others wait in its queue): an answer
    takes about 8 chunk delays, so requests that arrive together wait for those before them."""

    def __init__(self, fake: FakeOpenAI, chunk_delay_s: float) -> None:
        super().__init__(fake, chunk_delay_s)
        handler, lock = self.server.RequestHandlerClass, threading.Lock()
        post = handler.do_POST

        def do_post(h):
            with lock:
                post(h)

        handler.do_POST = do_post


def point(rate, tok_s, good, sent=6):
    return SweepPoint(rate=rate, achieved=rate, sent=sent, completed=sent, good=good, output_tok_s=tok_s,
                      goodput=good / 3, ttft_p50_s=0.1, ttft_p99_s=0.2, tpot_p50_s=0.01, findings=0, failed=False,
                      warning=None)


def test_knees_the_last_rate_holding_the_slo_and_where_throughput_stops_rising():
    points = [point(1, 10.0, 6), point(2, 20.0, 6), point(4, 20.9, 5), point(8, 30.0, 6)]
    assert slo_knee(points).rate == 2  # 4 req/s: 5 of 6 met, under 90%; a later recovery does not count
    assert slo_knee(points, share=0.8).rate == 8
    assert throughput_knee(points).rate == 2  # 20.9 tok/s is within 5% of 20.0
    assert throughput_knee(points[:2]).rate == 2  # still rising: the highest rate run
    assert slo_knee([point(1, 10.0, 0)]) is None


def test_the_pictures_mark_no_knee_while_throughput_still_rose():
    """Without an slo and with throughput rising at every rate, the table said "no plateau yet" while the
    plot drew a "knee" line at the highest rate."""
    from kvtui.cli.sweep import knee_to_draw

    rising = [point(2, 11.8, 6), point(8, 43.0, 6)]
    assert knee_to_draw(rising, None, throughput_knee(rising), has_slo=False) is None
    flat = [point(1, 10.0, 6), point(2, 20.0, 6), point(4, 20.9, 6)]
    assert knee_to_draw(flat, None, throughput_knee(flat), has_slo=False).rate == 2
    assert knee_to_draw(flat, slo_knee(flat), throughput_knee(flat), has_slo=True).rate == 4


def test_retimed_arrivals_are_one_poisson_sequence_scaled_by_the_rate():
    from kvtui.models import build_tiny_tokenizer
    from kvtui.scenario import plan_requests

    spec = parse_scenario(SCENARIO)
    base = plan_requests(spec, build_tiny_tokenizer())
    slow, fast = retimed(base, 2.0, 3), retimed(base, 8.0, 3)
    rng = random.Random(derive_seed(3, "sweep_arrivals"))
    gaps = [rng.expovariate(1.0) for _ in range(5)]
    assert [p.arrival_s for p in slow] == pytest.approx([sum(gaps[:k]) / 2.0 for k in range(6)])
    assert [p.arrival_s for p in fast] == pytest.approx([sum(gaps[:k]) / 8.0 for k in range(6)])
    assert [p.prompt_ids for p in slow] == [p.prompt_ids for p in base]  # the same requests, re-timed only


def test_sweep_against_a_one_at_a_time_server_finds_the_knee_and_writes_the_svg(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra: pip install 'kvtui[plot]'")
    pytest.importorskip("plotext", reason="the plot extra: pip install 'kvtui[plot]'")
    path = tmp_path / "sweep.yaml"
    path.write_text(SCENARIO)
    fake = FakeOpenAI()
    with SerialServer(fake, chunk_delay_s=0.03) as url:
        out = subprocess.run(KVTUI + ["sweep", str(path), "--target", url, "--rates", "1,64", "--record-dir",
                                      str(tmp_path / "runs"), "--plot", str(tmp_path / "sweep.svg"),
                                      "--detectors", "canary", "--slo-share", "0.8"],
                             capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "[1/2] 1 req/s" in out.stderr and "[2/2] 64 req/s" in out.stderr
    # each run sent the same six prompts (the same seed), twelve in all
    prompts = [str(r.get("messages") or r.get("prompt")) for r in fake.requests]
    assert len(prompts) == 12 and sorted(prompts[:6]) == sorted(prompts[6:]) and len(set(prompts)) == 6
    rows = {}
    for rate in ("1", "64"):
        header, events, summary, _ = read_recording(tmp_path / "runs" / f"rate-{rate}.jsonl")
        finishes = [e for e in events if isinstance(e, Finish)]
        arrivals = [e.t for e in events if isinstance(e, Arrive)]
        assert len(finishes) == 6 and summary.requests_completed == 6
        rows[rate] = (summary, finishes, arrivals)
        line = next(line for line in out.stdout.splitlines() if line.startswith(f"│ {rate:>10} │"))
        cells = [c.strip() for c in line.strip("│").split("│")]
        ttft = summary.time_to_first_token_seconds
        good = sum(f.first_token_s - f.sent_s <= 0.5 for f in finishes)
        assert cells[2] == f"{summary.output_tokens_per_s:.1f}"
        assert cells[3] == f"{ttft.p50 * 1000:.1f}" and cells[4] == f"{ttft.p99 * 1000:.1f}"
        f = summary.load_fidelity  # goodput over the achieved rate's time: the span of the sends
        assert cells[1] == f"{f.achieved_rate_per_s:.2f}" and cells[6] == f"{f.achieved_rate_per_s * good / 6:.2f}"
        assert cells[7].startswith(f"{good}/6") and cells[8] == "0"
    # one answer takes about 8 x 30 ms: at 1 req/s (gaps of 0.3 s and more) none waits behind two others; at
    # 64 req/s the sixth waits for five before it (over 1 s), so at most half meet TTFT <= 0.5 s
    slow, fast = rows["1"][1], rows["64"][1]
    assert all(f.first_token_s - f.sent_s <= 0.5 for f in slow[1:])
    assert sum(f.first_token_s - f.sent_s <= 0.5 for f in fast) <= 3
    assert "knee: 1 req/s, the highest rate that held the SLO" in out.stdout
    assert "64 req/s broke it" in out.stdout
    svg = ET.parse(tmp_path / "sweep.svg").getroot()
    texts = {"".join(t.itertext()).strip() for t in svg.iter("{http://www.w3.org/2000/svg}text")}
    assert {"Throughput vs latency", "Goodput vs rate", "throughput (output tok/s)", "TTFT (ms)",
            "rate asked (req/s)", "knee 1 req/s"} <= texts
    assert "Throughput vs latency" in out.stdout and "Goodput vs rate" in out.stdout  # the terminal's picture


def test_sweep_refuses_both_or_neither_rate_choice(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(SCENARIO)
    out = subprocess.run(KVTUI + ["sweep", str(path), "--target", "http://127.0.0.1:9"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2 and "give --rates 1,2,4,8 or --until-slo" in out.stderr
    out = subprocess.run(KVTUI + ["sweep", str(path), "--target", "http://127.0.0.1:9", "--rates", "1,x"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "--rates '1,x'" in out.stderr


def test_until_slo_doubles_the_rate_and_stops_at_the_first_run_that_broke_it(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(SCENARIO)
    with SerialServer(FakeOpenAI(), chunk_delay_s=0.03) as url:
        out = subprocess.run(KVTUI + ["sweep", str(path), "--target", url, "--until-slo", "--start-rate", "2",
                                      "--max-rate", "64", "--detectors", "none", "--slo-share", "0.8",
                                      "--no-terminal-plot"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    ran = [float(line.split()[1]) for line in out.stderr.splitlines() if line.startswith("[") and "planned" in line]
    assert ran == [2.0, 4.0, 8.0, 16.0, 32.0, 64.0][:len(ran)]  # doubling from 2 req/s, up to 64
    rows = {}
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip("│").split("│")]
        if line.startswith("│") and len(cells) == 10:
            rows[float(cells[0])] = cells[7]
    assert list(rows) == ran
    # every run before the last held the SLO; the last broke it (at 64 req/s the six requests queue for
    # over 1 s, so it breaks there at the latest)
    assert all(met.endswith(" ok") for rate, met in rows.items() if rate != ran[-1])
    assert rows[ran[-1]].endswith(" broken")
    assert len(ran) >= 2, "2 req/s (gaps of 0.08 s and more, answers of about 0.25 s) should hold the SLO"
    assert f"knee: {ran[-2]:g} req/s, the highest rate that held the SLO" in out.stdout


def test_ctrl_c_stops_the_sweep_with_130_naming_the_run(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(SCENARIO)
    with FakeHTTPServer(FakeOpenAI(), chunk_delay_s=1.0) as url:  # each answer takes about 8 s
        proc = subprocess.Popen(KVTUI + ["sweep", str(path), "--target", url, "--rates", "1,2", "--detectors", "none",
                                         "--no-terminal-plot"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("[1/2] 1 req/s: 6 requests"):
                break
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        stdout, rest = proc.communicate(timeout=300)
    assert proc.returncode == 130, "".join(lines) + rest
    assert "interrupted by SIGINT during the 1 req/s run" in rest
    assert "[2/2]" not in "".join(lines) + rest  # no run after the stopped one


def test_plot_without_matplotlib_says_what_to_install_before_any_run(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(SCENARIO)
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "matplotlib.py").write_text("raise ImportError('hidden for this test')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(KVTUI + ["sweep", str(path), "--target", "http://127.0.0.1:9", "--rates", "1",
                                  "--plot", str(tmp_path / "s.svg")], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["error: --plot needs matplotlib: pip install 'kvtui[plot]'"]


def test_goodput_and_achieved_share_the_span_of_the_sends():
    """Eight requests sent over 9.8 s, the last answer at 11.0 s, six within the SLO: achieved is 7 / 9.8 s;
    the summary's goodput (6 over the run's 11.0 s) would show 0.545, the sweep's is over the sends' span:
    achieved x 6 / 8, below achieved as it must be; all eight good, it equals achieved."""
    from types import SimpleNamespace

    from kvtui.events import LoadFidelity
    from kvtui.remote.sweep import point

    dist = SimpleNamespace(p50=0.1, p99=0.2)
    summary = SimpleNamespace(time_to_first_token_seconds=dist, time_per_output_token_seconds=dist,
                              goodput_requests_per_s=6 / 11.0, duration_s=11.0, requests_finished=8,
                              requests_completed=8, output_tokens_per_s=40.0)
    fidelity = LoadFidelity(t=11.0, requests_sent=8, requested_rate_per_s=7 / 9.8, achieved_rate_per_s=7 / 9.8)
    p = point(1.0, summary, [], False, fidelity)
    assert (p.sent, p.good) == (8, 6) and p.achieved == pytest.approx(0.7142857)
    assert p.goodput == pytest.approx(0.7142857 * 6 / 8) and p.goodput < p.achieved
    every = point(1.0, SimpleNamespace(**{**vars(summary), "goodput_requests_per_s": 8 / 11.0}), [], False, fidelity)
    assert every.good == 8 and every.goodput == pytest.approx(every.achieved)
    # a run of one request has no span: the summary's goodput
    one = point(1.0, summary, [], False, fidelity.model_copy(update={"requests_sent": 1, "achieved_rate_per_s": None}))
    assert one.goodput == pytest.approx(6 / 11.0)


def test_workers_reach_each_run_as_a_ray_session_that_retimes_the_seeded_plan():
    """--workers N --ray ADDRESS: each rate's run is a RayTargetSession (no Ray started to build it) whose
    driver plan is the sweep's re-timed plan, for the workers to rebuild from the seed."""
    from kvtui.cli.sweep import sweep_session
    from kvtui.cli.target import TargetRun
    from kvtui.models import build_tiny_tokenizer
    from kvtui.remote.session import TargetSession
    from kvtui.remote.workers import RayTargetSession, seeded_plan
    from kvtui.scenario import plan_requests

    spec, tok = parse_scenario(SCENARIO), build_tiny_tokenizer()
    plan = retimed(plan_requests(spec, tok), 4.0, spec.seed)
    def target(**more):
        return TargetRun(url="http://127.0.0.1:9", api="auto", served_model=None, max_concurrency=8, timeout_s=60.0,
                         tolerance=0.5, logprobs=True, **more)

    run = target(workers=2, ray_address="10.0.0.1:6379")
    session = sweep_session(spec, run, tok, plan, 4.0, None, ("canary",))
    assert isinstance(session, RayTargetSession)
    assert (session.workers, session.address, session.rate) == (2, "10.0.0.1:6379", 4.0)
    assert [(p.request_id, p.arrival_s) for p in session.pending] == [(p.request_id, p.arrival_s) for p in plan]
    assert [p.arrival_s for p in seeded_plan(spec, tok, 4.0)] == [p.arrival_s for p in plan]  # a worker's plan
    assert sorted(session.shard.values()) == [0, 0, 0, 1, 1, 1]
    assert type(sweep_session(spec, target(), tok, plan, 4.0, None, ("canary",))) is TargetSession


def test_ray_without_workers_is_refused_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from kvtui.cli.app import app

    path = tmp_path / "sweep.yaml"
    path.write_text(SCENARIO)
    out = CliRunner().invoke(app, ["sweep", str(path), "--target", "http://127.0.0.1:9", "--rates", "1", "--ray",
                                   "10.0.0.1:6379"])
    assert out.exit_code == 2 and "--ray names the cluster of --workers N; add --workers" in out.output
