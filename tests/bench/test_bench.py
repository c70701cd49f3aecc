"""The benchmark suite's arithmetic and plumbing (the figures themselves are measured by `kvtui bench`,
never asserted in tests): the cost-model fit, the workload, the per-system figures, a small suite run."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from kvtui.bench import run_suite
from kvtui.bench.peers import Outcome, Workload
from kvtui.calibrate import calibration_path, fit, load_cost_model, measure
from kvtui.engine import StepCostModel


def test_fit_recovers_known_step_costs():
    truth = StepCostModel(base_s=0.03, per_row_s=0.002, per_token_s=0.004, per_key_s=3e-6)
    shapes = [(r, r * q, r * (c + q)) for r in (1, 4, 8) for q in (1, 32) for c in (32, 256)]
    samples = [(s, truth.duration(*s)) for s in shapes]
    model, r2 = fit(samples)
    assert r2 == pytest.approx(1.0)
    for name in ("base_s", "per_row_s", "per_token_s", "per_key_s"):
        assert getattr(model, name) == pytest.approx(getattr(truth, name), rel=1e-6)


def test_fit_never_gives_negative_costs():
    samples = [((1, 1, 10), 0.05), ((2, 2, 20), 0.04), ((4, 4, 40), 0.03)]  # time falls as work grows
    model, _ = fit(samples)
    assert min(model.base_s, model.per_row_s, model.per_token_s, model.per_key_s) >= 0


def test_measure_reports_the_step_shape(tiny):
    (rows, tokens, keys), seconds = measure(tiny["tiny-llama"].model, rows=3, query=5, context=20, repeats=1)
    assert (rows, tokens, keys) == (3, 15, 3 * 25) and seconds > 0


def test_calibration_is_stored_and_loaded_per_model(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTUI_CACHE_DIR", str(tmp_path))
    model, described = load_cost_model("m", "float32", "cpu")
    assert described["source"] == "default" and model == StepCostModel()
    path = calibration_path("m", "float32", "cpu")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"coefficients": {"base_s": 0.5, "per_row_s": 0.0, "per_token_s": 0.1,
                                                 "per_key_s": 0.0}, "r2": 0.9}))
    model, described = load_cost_model("m", "float32", "cpu")
    assert model.duration(2, 3, 100) == pytest.approx(0.8) and described["source"] == "calibrated"
    assert load_cost_model("m", "bfloat16", "cpu")[1]["source"] == "default"


def test_workload_is_seeded_and_figures_follow_arrivals():
    class Tok:
        all_special_ids = [0]

        def __len__(self):
            return 300

    work = Workload.poisson(Tok(), 4, rate_per_s=2.0, seed=1)
    assert work == Workload.poisson(Tok(), 4, rate_per_s=2.0, seed=1) and work.arrivals[0] == 0.0
    assert all(26 <= len(p) <= 188 for p in work.prompts) and all(16 <= n <= 48 for n in work.outputs)
    out = Outcome(tokens=[[1], [2], [3], [4]], first=[a + 0.5 for a in work.arrivals],
                  last=[a + 1.0 for a in work.arrivals])
    figures = out.figures(work, [[1], [2], [9], [4]])
    assert figures["ttft_p50_s"] == pytest.approx(0.5) and figures["e2e_p95_s"] == pytest.approx(1.0)
    assert figures["equal_to_solo"] == 3
    assert figures["tokens_per_s"] == pytest.approx(sum(work.outputs) / (work.arrivals[-1] + 1.0))


def test_a_small_suite_writes_json_and_markdown(tiny, tmp_path):
    output = tmp_path / "bench.json"
    figures = run_suite(tiny["tiny-llama"], name="tiny-llama", parts=["batch"], quick=True, output=output,
                        console=Console(file=open("/dev/null", "w")))
    rows = figures["parts"]["batch"]["rows"]
    assert [r["batch"] for r in rows] == [1, 2, 4, 8, 16, 32] and rows[0]["x_batch_1"] == 1.0
    assert json.loads(output.read_text())["parts"]["batch"]["rows"][3]["batch"] == 8
    assert "| 32 |" in output.with_suffix(".md").read_text()


def test_rounds_merge_to_median_and_spread_and_targets_compare_the_medians():
    from kvtui.bench.peers import _merge_rounds, _targets

    def f(rate, same=16):
        return {"tokens_per_s": rate, "ttft_p50_s": rate / 100, "equal_to_solo": same, "requests": 16}

    merged = _merge_rounds([f(80.0), f(60.0, 15), f(70.0)])
    assert (merged["tokens_per_s"], merged["tokens_per_s_min"], merged["tokens_per_s_max"]) == (70.0, 60.0, 80.0)
    assert merged["ttft_p50_s"] == 0.7 and merged["equal_to_solo"] == 15 and merged["rounds"] == 3
    results = {"kvtui engine": f(90.0), "kvtui serve, default detectors": f(68.0),
               "kvtui serve --detectors none": f(80.0), "kvtui serve, default detectors, 2 threads": f(85.0),
               "vLLM CPU 0.32 (1 thread)": f(80.0), "llama.cpp llama-server (-np 16)": f(60.0)}
    targets = {t["what"]: (round(t["ratio"], 3), t["goal"]) for t in _targets(results, 1)}
    assert targets == {"kvtui engine (no detectors) / vLLM CPU": (1.125, 1.2),
                       "kvtui serve --detectors none / vLLM CPU": (1.0, 1.0),
                       "kvtui serve (default detectors) / vLLM CPU": (0.85, 1.0),
                       "TTFT p50, vLLM CPU / kvtui serve (default detectors)": (1.176, 1.0),
                       "kvtui serve (default detectors), 2 threads / 1 thread": (1.25, 1.05),
                       "kvtui engine / llama-server (Q4_1)": (1.5, 1.2)}


def test_a_busy_process_tree_counts_cpu_and_an_idle_one_is_waited_for_briefly():
    import subprocess
    import sys
    import time

    from kvtui.bench.peers import tree_cpu_seconds, wait_idle

    spin = "import time\nwhile time.process_time() < 1.0: pass\ntime.sleep(60)"
    busy = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {spin!r}])"],
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while tree_cpu_seconds(busy.pid) < 1.0 and time.monotonic() < deadline:  # the grandchild's spin counts
            time.sleep(0.1)
        assert tree_cpu_seconds(busy.pid) >= 1.0
        assert wait_idle([busy.pid], quiet_s=0.3) < 5.0  # it spun its second and sleeps now
    finally:
        import os
        import signal

        os.killpg(busy.pid, signal.SIGKILL)
        busy.wait()


def test_the_penalties_part_times_every_configuration(tiny, tmp_path):
    figures = run_suite(tiny["tiny-llama"], name="tiny-llama", parts=["penalties"], quick=True,
                        output=tmp_path / "bench.json", console=Console(file=open("/dev/null", "w")))
    part = figures["parts"]["penalties"]
    assert list(part["decode_step_s"]) == ["plain", "penalties", "bias_bans_min", "all"]
    assert part["stages_per_row_s"]["plain"] == 0 and all(part["stages_per_row_s"][c] > 0 for c in
                                                          ("penalties", "bias_bans_min", "all"))
    assert part["vocab"] == 259 and "| all |" in (tmp_path / "bench.md").read_text()


def test_the_faults_part_catches_each_fault_in_every_held_out_run_and_is_silent_with_it_off(tiny, tmp_path):
    """cow_missing (tiny-llama, paged, n > 1) and stale_cross_kv (tiny-whisper, reused slots) on the three
    --quick held-out scenarios: caught in each, a victim and its source named in each, no counted report
    on the same scenarios with the fault removed."""
    from kvtui.bench import faults

    result = faults.run(tiny["tiny-llama"], name="tiny-llama", quick=True, console=Console(file=open("/dev/null", "w")),
                        faults=("cow_missing", "stale_cross_kv"))
    rows = result["faults"]
    assert list(rows) == ["cow_missing", "stale_cross_kv"]
    assert [(r["model"], r["runs"], r["caught"], r["named"], r["false_alarms"], r["seeds"]) for r in rows.values()] == [
        ("tiny-llama", 3, 3, 3, 0, [9000, 9002]), ("tiny-whisper", 3, 3, 3, 0, [9000, 9002])]
    assert [(r["acted"], r["missed"], r["inert"]) for r in rows.values()] == [(3, 0, 0), (3, 0, 0)]
    assert rows["cow_missing"]["detectors"] == {"slot_taint": 3, "attention_flow": 3, "reference": 3}
    assert rows["stale_cross_kv"]["detectors"] == {"slot_taint": 3, "canary": 0, "reference": 3}  # random text
    assert all(r["first_step"]["n"] == 3 and 0 <= r["first_step"]["min"] <= r["first_step"]["max"] for r in rows.values())
    table = faults.markdown(result)
    assert len(table) == 4 and table[2].startswith("| cow_missing (tiny-llama) | 3 | 3 | 0 | 0 | slot_taint 3, "
                                                   "attention_flow 3")
    assert table[3].endswith("| 0 (0 of 3 runs) |")


def test_the_faults_part_scenarios_are_held_out_and_differ_on_and_off_only_in_the_fault():
    from kvtui.bench.faults import FAULT_LIST, scenario_text
    from kvtui.scenario import parse_scenario

    for fault in FAULT_LIST:
        on, off = scenario_text(fault, 9001), scenario_text(fault, 9001, on=False)
        assert [a for a, b in zip(on.splitlines(), off.splitlines()) if a != b] == [
            next(line for line in on.splitlines() if "faults:" in line)]
        assert list(parse_scenario(on).engine.faults) == [fault] and list(parse_scenario(off).engine.faults) == []
        assert parse_scenario(on).seed == 9001


def test_the_faults_part_skips_stale_bitmask_naming_the_install_when_xgrammar_is_missing(tiny, monkeypatch):
    import importlib.util

    from kvtui.bench import faults

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "xgrammar" else find_spec(name, *a))
    result = faults.run(tiny["tiny-llama"], name="tiny-llama", quick=True, console=Console(file=open("/dev/null", "w")),
                        faults=("stale_bitmask",))
    assert result["faults"]["stale_bitmask"]["skipped"].startswith("structured output needs xgrammar: pip install")
    assert faults.markdown(result)[2].startswith("| stale_bitmask (tiny-llama) | 0 | skipped: structured output needs")


def test_the_profile_part_times_every_phase_and_names_the_linear_kernel(tiny, tmp_path):
    """`--part profile` on tiny-llama: each batch size with detectors off and on has a step time, the
    forward's operator split counts linear-layer time, the detectors' phases are timed only when on, and
    the Markdown names the linear kernel chosen for this machine and why."""
    output = tmp_path / "bench.json"
    figures = run_suite(tiny["tiny-llama"], name="tiny-llama", parts=["profile"], quick=True, output=output,
                        console=Console(file=open("/dev/null", "w")))
    result = figures["parts"]["profile"]
    assert [(r["batch"], r["detectors"]) for r in result["rows"]] == [(1, False), (8, False), (16, False),
                                                                       (1, True), (8, True), (16, True)]
    assert all(r["step_s"] > 0 and r["forward_ops_s"]["linear"] > 0 for r in result["rows"])
    assert all(r["phases_s"]["attention_flow"] == 0 for r in result["rows"] if not r["detectors"])
    assert all(r["phases_s"]["attention_flow"] > 0 for r in result["rows"] if r["detectors"] and r["batch"] > 1)
    kernel = result["linear_kernel"]
    assert kernel["kernel"] == tiny["tiny-llama"].model._kvtui_fused.kernel
    head = tiny["tiny-llama"].model._kvtui_fused.head.kernel
    assert f"Linear kernel: {kernel['kernel']} (LM head: {head}): " in output.with_suffix(".md").read_text()


def test_the_in_process_engine_run_records_each_steps_positions_and_sampled_rows(tiny):
    from kvtui.bench.peers import run_kvtui

    work = Workload(prompts=[[5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [17, 18, 19, 20]], outputs=[3, 2, 4],
                    arrivals=[0.0, 0.0, 0.0])
    out = run_kvtui(tiny["tiny-llama"].model, work)
    # step 1 prefills all three prompts (16 positions, 3 first tokens); then one decode row per unfinished request
    assert out.steps == [(16, 3), (3, 3), (2, 2), (1, 1)]
    assert sum(sampled for _, sampled in out.steps) == sum(work.outputs) == sum(len(t) for t in out.tokens)


def test_the_floor_replays_each_distinct_step_on_every_linear_layer_and_the_head_keeping_the_best_repeat(tiny,
                                                                                                   monkeypatch):
    from kvtui.bench import peers
    from kvtui.engine.fused import fused_for
    from kvtui.engine.linear import FusedLinear

    model = tiny["tiny-llama"].model
    fused = fused_for(model)
    clock, calls, real_call, real_randn = [0.0], [], FusedLinear.__call__, peers.torch.randn
    reads = [0]  # perf_counter reads: start and end of each repeat, two repeats per shape

    def counting_call(self, x):  # a clock that advances by the rows each linear layer multiplies
        calls.append((id(self), x.shape[0]))
        clock[0] += x.shape[0]
        return real_call(self, x)

    def costly_randn(*args, **kwargs):  # making inputs must not count
        clock[0] += 10_000
        return real_randn(*args, **kwargs)

    class FakeTime:
        @staticmethod
        def perf_counter():
            reads[0] += 1
            if reads[0] in (2, 8):  # the first shape's first repeat and the second's last cost 1000 more
                clock[0] += 1000
            return clock[0]

    monkeypatch.setattr(FusedLinear, "__call__", counting_call)
    monkeypatch.setattr(peers.torch, "randn", costly_randn)
    monkeypatch.setattr(peers, "time", FakeTime)
    floor = peers.linear_floor_s(model, [(5, 2), (1, 1), (0, 0), (5, 2)], repeats=2)
    linears = [lin for layer in fused.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    for rows, sampled in ((5, 2), (1, 1)):  # every layer's own linear layers, twice (two repeats), and the head
        assert sorted(i for i, n in calls if n == rows and i != id(fused.head)) == sorted(2 * [id(lin) for lin in linears])
        assert [i for i, n in calls if n == sampled].count(id(fused.head)) == 2
    assert not any(n == 0 for _, n in calls)  # a step without positions is not replayed
    layers = 4 * len(fused.layers)
    assert floor == 2 * (5 * layers + 2) + (1 * layers + 1)  # each shape's cheaper repeat; (5, 2) counts twice


def test_the_floor_is_measured_like_the_systems_and_stated_against_vllm(tiny, monkeypatch):
    from kvtui.bench import peers

    work = Workload(prompts=[[5, 6, 7]], outputs=[4], arrivals=[0.0])
    outcome = Outcome(tokens=[[1, 2, 3, 4]], first=[1.0], last=[10.0], step_s=8.0, steps=[(3, 1)] * 4)
    monkeypatch.setattr(peers, "run_kvtui", lambda model, w: outcome)
    monkeypatch.setattr(peers, "linear_floor_s", lambda model, steps: 6.0 if steps == outcome.steps else None)
    peaks = {"bandwidth_gb_s": 20.0, "peak_gflop_s": 90.0}
    monkeypatch.setattr(peers, "machine_peaks", lambda: peaks)
    monkeypatch.setattr(peers, "roofline_s", lambda model, steps, p: 2.0 if (steps, p) == (outcome.steps, peaks) else None)
    floor = peers._engine_floor(object(), work, Console(file=open("/dev/null", "w")))
    # the makespan (10 s) with the 8 s of steps replaced by their 6 s floor: 4 tokens / 8 s; by the 2 s roofline: 4 s
    assert floor == {"steps": 4, "engine_step_s": 8.0, "floor_s": 6.0, "floor_tokens_per_s": 0.5, **peaks,
                     "roofline_s": 2.0, "roofline_tokens_per_s": 1.0}
    systems = {"kvtui engine": {"tokens_per_s": 0.4, "ttft_p50_s": 1.0, "ttft_p95_s": 1.0, "e2e_p50_s": 1.0,
                                "e2e_p95_s": 1.0, "equal_to_solo": 1, "requests": 1},
               "vLLM CPU 0.32 (1 thread)": {"tokens_per_s": 0.25, "ttft_p50_s": 1.0, "ttft_p95_s": 1.0,
                                            "e2e_p50_s": 1.0, "e2e_p95_s": 1.0, "equal_to_solo": 1, "requests": 1}}
    line, roof = peers.markdown({"systems": systems, "floor": floor})[-3::2]
    assert line.startswith("Linear-layer floor (kvtui's kernels alone): one more engine run's 4 steps took 8.00 s;")
    assert "alone took 6.00 s (75%)" in line and "0.5 output tokens/s, 2.00x vLLM CPU" in line
    assert roof.startswith("Roofline: this machine measured 20.0 GB/s of memory bandwidth and 90 GFLOP/s")
    assert "take 2.00 s, 1.0 output tokens/s, 4.00x vLLM CPU" in roof
    assert "vLLM" not in peers._floor_lines(floor, {"kvtui engine": systems["kvtui engine"]})[1]
    assert peers.markdown({"systems": systems})[-1].startswith("| vLLM CPU")  # no floor, no line


# -- the peers' forced output lengths ------------------------------------------------------------------------
class _Completions:
    """A streaming /v1/completions on 127.0.0.1 (a thread) that generates at most `cap` tokens of a request's
    max_tokens, then ends with finish_reason "length" if it reached max_tokens, else "stop" (as a server
    that stops at its end-of-sequence token, ignoring ignore_eos, does). `bodies`: what it was sent."""

    def __init__(self, cap: int) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        owner, self.bodies = self, []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                owner.bodies.append(body)
                n = min(cap, body["max_tokens"])
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.end_headers()
                for k in range(n):
                    self.wfile.write(f'data: {json.dumps({"choices": [{"text": f" t{k}"}]})}\n\n'.encode())
                reason = "length" if n == body["max_tokens"] else "stop"
                self.wfile.write(f'data: {json.dumps({"choices": [{"text": "", "finish_reason": reason}]})}\n\n'
                                 "data: [DONE]\n\n".encode())

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def test_a_server_that_stops_before_the_forced_length_is_left_out_in_one_line():
    """tokens/s credits each request its forced length, so a server whose request ended short (finish_reason
    "stop") is left out of the A/B rounds after its first run, with one line; one that honours every length
    runs every round."""
    import io

    from kvtui.bench.peers import _ab_rounds, _stream_all, forced_length_shortfall

    work = Workload(prompts=[[1, 2], [3, 4], [5, 6]], outputs=[2, 5, 8], arrivals=[0.0, 0.0, 0.0])
    honest, short = _Completions(cap=100), _Completions(cap=3)
    try:
        outcome = _stream_all(short.url, work, {})
        assert outcome.finish == ["length", "stop", "stop"] and outcome.tokens == [" t0 t1", " t0 t1 t2", " t0 t1 t2"]
        assert forced_length_shortfall(outcome) == (
            "2 of 3 requests ended before their forced output length (r001 stop, r002 stop), so its tokens/s would "
            "count tokens it never generated")
        assert forced_length_shortfall(_stream_all(honest.url, work, {})) is None
        assert [b["ignore_eos"] for b in short.bodies] == [True] * 3  # the bench asked for the lengths
        out = io.StringIO()
        systems = {"honest": (lambda w: _stream_all(honest.url, w, {}), "text", None),
                   "short": (lambda w: _stream_all(short.url, w, {}), "text", None)}
        per_round = _ab_rounds(systems, [], 2, {"poisson": work}, {"text": [" t0 t1"] * 3, "tokens": []},
                               Console(file=out, width=400))["poisson"]
    finally:
        honest.close()
        short.close()
    assert list(per_round) == ["honest"] and len(per_round["honest"]) == 2
    assert per_round["honest"][0]["equal_to_solo"] == 1  # r000's two tokens are the reference's
    assert len(short.bodies) == 3 + 3  # the check above, then round 1 only
    assert out.getvalue().splitlines() == [
        "  peers: round 1/2, poisson: honest", "  peers: round 1/2, poisson: short",
        "  peers: short left out: 2 of 3 requests ended before their forced output length (r001 stop, r002 stop), "
        "so its tokens/s would count tokens it never generated",
        "  peers: round 2/2, poisson: honest"]


def test_the_shortfall_names_the_first_three_requests_and_a_missing_finish():
    from kvtui.bench.peers import forced_length_shortfall

    outcome = Outcome(finish=[None, "length", "error", "stop", "stop"])
    assert forced_length_shortfall(outcome) == (
        "4 of 5 requests ended before their forced output length (r000 no finish_reason, r002 error, r003 stop ...), "
        "so its tokens/s would count tokens it never generated")
    assert forced_length_shortfall(Outcome()) is None  # in process: no finish reasons, not judged


def test_kvtui_serve_ends_every_forced_request_with_length():
    """The bench's own servers pass the length check: kvtui serve (tiny-llama) honours ignore_eos."""
    from kvtui.bench.peers import _stream_all, forced_length_shortfall
    from kvtui.serve.server import ServeOptions, ServeServer

    work = Workload(prompts=[[5, 6, 7], [8, 9], [10, 11, 12, 13]], outputs=[4, 12, 7], arrivals=[0.0, 0.0, 0.0])
    with ServeServer(ServeOptions(model="tiny-llama", port=0, slots=4, max_len=64, detectors=(), threads=1)) as srv:
        outcome = _stream_all(srv.url, work, {})
    assert outcome.finish == ["length"] * 3 and forced_length_shortfall(outcome) is None


def test_the_saturation_workload_is_the_poisson_requests_all_sent_at_once(tiny):
    from kvtui.bench.peers import run_kvtui

    tokenizer = tiny["tiny-llama"].tokenizer
    poisson, burst = Workload.poisson(tokenizer, 5, rate_per_s=8.0), Workload.burst(tokenizer, 5, rate_per_s=8.0)
    assert burst.prompts == poisson.prompts and burst.outputs == poisson.outputs
    assert burst.arrivals == [0.0] * 5 and poisson.arrivals[0] == 0.0 and poisson.arrivals[4] > 0.0
    # in process every request is in the first step: it prefills all five prompts (enough slots and budget)
    one_token = Workload(burst.prompts, [1] * 5, burst.arrivals)  # the first step is all this test reads
    out = run_kvtui(tiny["tiny-llama"].model, one_token, max_tokens_per_step=2048)
    assert out.steps[0] == (sum(len(p) for p in burst.prompts), 5)


def test_the_ab_rounds_run_each_system_on_each_workload_in_every_round(monkeypatch):
    from kvtui.bench import peers

    monkeypatch.setattr(peers, "wait_idle", lambda pids: 0.0)
    work = {"poisson": Workload([[5, 6]], [2], [0.5]), "saturation": Workload([[5, 6]], [2], [0.0])}
    calls = []

    def system(label, shortfall_on=None):
        def call(w):
            kind = next(k for k, v in work.items() if v is w)
            calls.append((label, kind))
            finish = ["stop"] if (label, kind, len(calls)) == shortfall_on else ["length"]
            return Outcome(tokens=[[1, 2]], first=[w.arrivals[0] + 1.0], last=[w.arrivals[0] + 2.0], finish=finish)
        return call

    systems = {"A": (system("A"), "tokens", None), "B": (system("B", ("B", "saturation", 8)), "tokens", None)}
    per_round = peers._ab_rounds(systems, [], 2, work, {"tokens": [[1, 2]]}, Console(file=open("/dev/null", "w")))
    assert calls == [("A", "poisson"), ("B", "poisson"), ("A", "saturation"), ("B", "saturation"),
                     ("A", "poisson"), ("B", "poisson"), ("A", "saturation"), ("B", "saturation")]
    # B's last run ended short of its forced length: B is left out of both workloads
    assert list(per_round["poisson"]) == list(per_round["saturation"]) == ["A"]
    assert [f["tokens_per_s"] for f in per_round["poisson"]["A"]] == [1.0, 1.0]  # 2 tokens from 0.5 s to 2.5 s
    assert [f["ttft_p50_s"] for f in per_round["saturation"]["A"]] == [1.0, 1.0]


def test_the_roofline_takes_per_step_the_slower_of_reading_the_weights_and_multiplying(tiny):
    from kvtui.bench.peers import machine_peaks, roofline_s

    # tiny-llama: 2 layers of qkv 64x128, o 64x64, gate_up 64x256, down 128x64 (73728 weights), head 64x259, float32
    slow = {"bandwidth_gb_s": 1e-6, "peak_gflop_s": 1e-6}  # 1000 bytes/s, 1000 flop/s
    # (5, 2): reading 361.2 s, multiplying 2 x (73728 x 5 + 16576 x 2) / 1000 = 803.6 s; (1, 0): reading 294.9 s
    assert roofline_s(tiny["tiny-llama"].model, [(5, 2), (0, 0), (1, 0)], slow) == pytest.approx(803.584 + 294.912)
    peaks = machine_peaks(repeats=1)
    assert 0.1 < peaks["bandwidth_gb_s"] < 10_000 and 0.1 < peaks["peak_gflop_s"] < 1_000_000
