"""The server panels of a `--target` run against each server's own metric names: KV usage, running and waiting,
prefix hit rate and speculative acceptance, each with a history, from fake /metrics texts of vLLM, SGLang and
llama.cpp as their servers write them (two samples, the counters moved between them; llama.cpp's names as the
vendored llama-server gives them, plus the KV gauge older ones had)."""

from __future__ import annotations

import pytest
from rich.console import Console

from kvtui.events import ServerSample
from kvtui.remote.server_probe import KV_USAGE, RUNNING, WAITING, first_of, parse_metrics
from kvtui.tui.server_panels import stats
from kvtui.tui.server_track import ServerTrack
from kvtui.tui.snapshot import ContaminationView, Latency

VLLM = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {kv}
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {queries}
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {hits}
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {drafted}
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {accepted}
"""
SGLANG = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{model_name="m"}} {running}
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{model_name="m"}} {waiting}
# TYPE sglang:token_usage gauge
sglang:token_usage{{model_name="m"}} {kv}
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{{model_name="m"}} {rate}
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{{model_name="m"}} {length}
"""
LLAMACPP = """\
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total {computed}
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total {cached}
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total 0
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total 0
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio {kv}
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing {running}
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred {waiting}
"""
SAMPLES = {
    "vLLM": (VLLM, dict(running=2, waiting=5, kv=0.25, queries=1000, hits=100, drafted=400, accepted=100),
             dict(running=4, waiting=1, kv=0.5, queries=1400, hits=400, drafted=600, accepted=250)),
    "SGLang": (SGLANG, dict(running=1, waiting=0, kv=0.1, rate=0.2, length=1.5),
               dict(running=3, waiting=2, kv=0.3, rate=0.6, length=2.25)),
    "llama.cpp": (LLAMACPP, dict(running=1, waiting=3, kv=0.125, computed=500, cached=0),
                  dict(running=2, waiting=0, kv=0.75, computed=800, cached=100)),  # 100 of 400 since the first
}


def sample(t: float, text: str) -> ServerSample:
    """A sample as kvtui's probe of /metrics makes it (kvtui/remote/server_probe.py)."""
    metrics = parse_metrics(text)
    return ServerSample(t=t, metrics=metrics, running=first_of(metrics, RUNNING), waiting=first_of(metrics, WAITING),
                        kv_usage=first_of(metrics, KV_USAGE))


def track(kind: str) -> ServerTrack:
    text, first, second = SAMPLES[kind]
    tracked = ServerTrack("http://fake")
    tracked.apply(sample(0.0, text.format(**first)))
    tracked.apply(sample(0.5, text.format(**second)))
    return tracked


@pytest.mark.parametrize("kind,kv,running,waiting,hit,spec", [
    ("vLLM", 0.5, 4, 1, 300 / 400, (150 / 200, "accepted")),  # counters: since the run's first sample
    ("SGLang", 0.3, 3, 2, 0.6, (2.25, "tokens/step")),
    ("llama.cpp", 0.75, 2, 0, 100 / 400, None),  # its spec counters exist, nothing drafted
])
def test_each_servers_names_give_the_monitors_figures_and_their_history(kind, kv, running, waiting, hit, spec):
    view = track(kind).view({})
    assert (view.kind, view.kv_usage, view.running, view.waiting) == (kind, kv, running, waiting)
    assert view.hit_rate == pytest.approx(hit) if hit is not None else view.hit_rate is None
    assert view.spec == (pytest.approx(spec[0]), spec[1]) if spec is not None else view.spec is None
    text, first, _ = SAMPLES[kind]
    assert view.running_history == (first["running"], running) and view.waiting_history == (first["waiting"], waiting)
    assert view.kv_history == (first["kv"], kv)


class Snap:
    """The few snapshot fields the server stats panel reads."""

    def __init__(self, view, contamination=()):
        self.server, self.contamination = view, contamination
        self.running, self.waiting, self.finished = 2, 1, 7
        self.ttft = self.tpot = Latency(0.1, 0.2)


@pytest.mark.parametrize("width", [48, 78])
def test_the_stats_panel_names_each_figure_or_says_it_is_not_exposed_beside_the_latest_finding(width):
    finding = ContaminationView(1.0, None, "canary", "cross_request", "r004", "r001", "says 'X'")
    lines = {}
    for kind in SAMPLES:
        console = Console(width=width, color_system=None, record=True)
        console.print(stats(Snap(track(kind).view({}), (finding,)), width, 10))
        lines[kind] = console.export_text().splitlines()
        assert len(lines[kind]) == 9 and all(len(line) <= width for line in lines[kind])
    vllm, sglang, llama = (dict((line[:9].strip(), line[9:]) for line in lines[k]) for k in SAMPLES)
    assert vllm["KV usage"].startswith("  50.0%") and vllm["server"].startswith("running 4  waiting 1")
    assert vllm["prefix"].startswith("hits 75.0% (300 of 400 tok)") and vllm["spec"].startswith("75.0% accepted")
    assert sglang["prefix"].startswith("hits 60.0% (sglang:cache_hit_rate)") and sglang["spec"].startswith("2.25 tok")
    assert llama["KV usage"].startswith("  75.0%") and llama["spec"].startswith("nothing drafted")
    assert llama["prefix"].startswith("hits 25.0% (llamacpp:prompt_tokens_cach")
    assert vllm["finding"].startswith("r004 ← r001 (canary")
