"""A server's prefix cache, seen from kvtui: reference runs and audits sent past it and checked against
what the server reports; its counters per label in the summary and the dashboard; the timing side-channel
audit against a server (`kvtui audit --timing --target`), here against `kvtui serve` with tenants."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest
from fake_openai import FakeOpenAI
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from kvtui.events import Finish, ReferenceStatus, ServerSample
from kvtui.metrics import Metrics
from kvtui.models import build_tiny_tokenizer
from kvtui.remote.server_probe import parse_info, parse_metrics
from kvtui.remote.session import TargetOptions, TargetSession
from kvtui.scenario import parse_scenario

TOK = build_tiny_tokenizer()
SALT = re.compile(r"^[0-9a-f]{32}$")


def scenario(n: int = 4):
    return parse_scenario(f"name: cache-test\nseed: 3\nmax_requests: {n}\nmodel: tiny-llama\n"
                          "arrivals: {process: burst, size: 16, every_s: 100}\nprompts: {kind: passphrase}\n"
                          "output_tokens: 8\n")


def run(fake: FakeOpenAI, n: int = 4) -> TargetSession:
    session = TargetSession(scenario(n), TOK, TargetOptions(url="http://fake", transport=fake.transport()),
                            detectors=("reference",))
    session.run()
    return session


def summary_text(session: TargetSession) -> str:
    from kvtui.summary import print_summary

    console = Console(width=200, record=True)
    print_summary(session.summary, session.header(), console)
    return console.export_text()


# -- reference runs past the cache ---------------------------------------------------------------------
def test_every_reference_carries_a_fresh_salt_and_is_verified_uncached():
    fake = FakeOpenAI(prefix_cache="honours_salt")
    session = run(fake)
    load, references = fake.requests[:4], fake.requests[4:]
    assert len(references) == 4
    assert all("cache_salt" not in body for body in load)  # the load is sent as a client would
    salts = [body["cache_salt"] for body in references]
    assert all(SALT.match(s) for s in salts) and len(set(salts)) == 4
    s = session.summary
    assert (s.reference_checked, s.reference_cached, s.reference_uncached_verified) == (4, 0, 4)
    assert s.prompt_tokens_cached == 0  # the load's own four prompts were new to the cache
    assert "4 checked (the server reported 0 cached prompt tokens for each)" in summary_text(session)


def test_a_reference_the_server_still_served_from_its_cache_is_not_counted():
    fake = FakeOpenAI(prefix_cache="ignores_salt")
    session = run(fake)
    s = session.summary
    assert (s.reference_checked, s.reference_cached, s.reference_uncached_verified) == (0, 4, 0)
    assert "4 not counted: the server took part of their prompts from its prefix cache" in summary_text(session)


def test_llama_cpp_references_go_with_cache_prompt_false_and_no_salt():
    fake = FakeOpenAI(prefix_cache="honours_salt", owned_by="llamacpp")
    session = run(fake, n=2)
    references = fake.requests[2:]
    assert [b.get("cache_prompt") for b in references] == [False, False]
    assert all("cache_salt" not in b for b in references)
    assert session.header().engine["server"] == "llama.cpp"
    assert session.summary.reference_uncached_verified == 2


def test_a_server_that_reports_nothing_is_checked_but_not_verified():
    session = run(FakeOpenAI())
    s = session.summary
    assert (s.reference_checked, s.reference_cached, s.reference_uncached_verified) == (4, 0, 0)
    assert s.prompt_tokens_cached is None


def test_every_audit_request_goes_past_the_cache_and_a_cached_one_is_not_compared():
    from kvtui.remote.audit import run_target_audit

    fake = FakeOpenAI(prefix_cache="honours_salt")
    audit = run_target_audit(scenario(4), TOK, TargetOptions(url="http://fake", transport=fake.transport()))
    salts = [body.get("cache_salt") for body in fake.requests]
    assert len(salts) == 12 and all(s and SALT.match(s) for s in salts) and len(set(salts)) == 12
    assert (audit.compared, audit.cached, audit.events) == (4, 0, [])
    leaky = FakeOpenAI(prefix_cache="ignores_salt")  # the kept prompts come back from the first run's cache
    audit = run_target_audit(scenario(4), TOK, TargetOptions(url="http://fake", transport=leaky.transport()))
    assert (audit.compared, audit.cached) == (0, 4)


# -- the server's metrics --------------------------------------------------------------------------------
VLLM = """\
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 5.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 2.0
vllm:request_success_total{engine="1",finished_reason="stop",model_name="m"} 1.0
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 400.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 128.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",enable_prefix_caching="True",engine="0"} 1.0
"""


def test_labelled_families_are_read_per_label_and_info_families_apart():
    metrics = parse_metrics(VLLM)
    assert metrics == {"vllm:request_success_total": 8.0,
                       'vllm:request_success_total{finished_reason="stop"}': 6.0,
                       'vllm:request_success_total{finished_reason="length"}': 2.0,
                       "vllm:prefix_cache_queries_total": 400.0, "vllm:prefix_cache_hits_total": 128.0}
    assert parse_info(VLLM) == {"vllm:cache_config_info": {"block_size": "128", "enable_prefix_caching": "True",
                                                           "engine": "0"}}


def sample(t: float, queries: float, hits: float) -> ServerSample:
    return ServerSample(t=t, metrics={"vllm:prefix_cache_queries_total": queries, "vllm:prefix_cache_hits_total": hits})


def test_the_summary_takes_the_servers_prefix_counters_over_the_load_only():
    m = Metrics()
    for event in (sample(0.0, 1000, 300), sample(1.0, 1400, 428),
                  Finish(t=1.0, request_id="r0", finish_reason="stop", prompt_tokens=400, cached_tokens=128),
                  sample(1.5, 1600, 556),  # the load's end
                  ReferenceStatus(t=1.5, checked=0, skipped=0, pending=1, cached=0, uncached_verified=0),
                  sample(2.0, 2000, 556)):  # the references' queries are not the load's
        m.add_event(event)
    s = m.summary()
    assert (s.prefix_cache_queries, s.prefix_cache_hits, s.prompt_tokens_cached) == (600, 256, 128)


def test_the_target_dashboard_shows_the_servers_prefix_cache():
    from kvtui.tui.server_panels import _prefix
    from kvtui.tui.server_track import ServerTrack

    track = ServerTrack("http://x")
    assert _prefix(track.view({}))[0].startswith("not exposed")
    for event in (sample(0.0, 1000, 300), sample(1.0, 1400, 428),
                  Finish(t=1.0, request_id="r0", finish_reason="stop", prompt_tokens=400, cached_tokens=128)):
        track.apply(event)
    view = track.view({})
    assert (view.prefix_queries, view.prefix_hits, view.cached_tokens, view.prompt_tokens) == (400, 128, 128, 400)
    assert _prefix(view)[0] == "hits 32.0% (128 of 400 tok)  cached 128 of 400 prompt tok (usage)"


# -- kvtui serve with tenants ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_paged():
    """`kvtui serve --kv paged --prefix-caching` in this process, on a free port, with tiny-llama."""
    from kvtui.serve.server import ServeOptions, ServeServer

    with ServeServer(ServeOptions(model="tiny-llama", port=0, kv="paged", prefix_caching=True, threads=1,
                                  detectors=())) as server:
        yield server


PROMPT = list(range(5, 39))  # 34 tokens: two full blocks of 16


def completion(url: str, **extra) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0, **extra},
                   timeout=60)
    return r.json() if r.status_code == 200 else {"status": r.status_code, **r.json()}


def cached(url: str, **extra) -> int:
    return completion(url, **extra)["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cache_salt_reaches_the_block_keys(tiny_paged):
    url = tiny_paged.url
    assert [cached(url, cache_salt="tenant-a"), cached(url, cache_salt="tenant-a"),
            cached(url, cache_salt="tenant-b"), cached(url), cached(url)] == [0, 32, 0, 0, 32]
    bad = completion(url, cache_salt="")
    assert bad["status"] == 400 and bad["error"]["param"] == "cache_salt"
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert parse_info(metrics)["vllm:cache_config_info"] == {"block_size": "16", "enable_prefix_caching": "True"}
    assert parse_metrics(metrics)["vllm:prefix_cache_hits_total"] >= 64


def test_streamed_usage_reports_cached_tokens(tiny_paged):
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "cache_salt": "stream-tenant"}
    found = []
    for _ in range(2):
        with httpx.stream("POST", f"{tiny_paged.url}/v1/completions", json=body, timeout=60) as r:
            usage = [line for line in r.iter_lines() if '"usage"' in line]
        found.append(re.search(r'"cached_tokens":(\d+)', usage[-1]).group(1))
    assert found == ["0", "32"]


def test_serve_refuses_prefix_caching_without_paged_kv():
    out = subprocess.run([sys.executable, "-m", "kvtui.cli", "serve", "--model", "tiny-llama", "--prefix-caching"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--prefix-caching needs paged KV: add --kv paged" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def audit_timing(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtui.cli", "audit", "scenarios/passphrase.yaml", "--timing",
                           "--target", url, "--model", "tiny-llama", "--probes", "8", *args],
                          capture_output=True, text=True, timeout=600)


def test_timing_audit_of_kvtui_serve_with_salts_holds(tiny_paged):
    out = audit_timing(tiny_paged.url)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {line.split("│")[1].strip(): line for line in out.stdout.splitlines() if line.count("│") >= 6}
    assert "0 of 8 (0 cached tokens)" in rows["different salts"]
    assert "8 of 8 (128 cached tokens)" in rows["same salt (control)"]  # one block of 16 per probe
    assert "8 of 8 (128 cached tokens)" in rows["no salt"]
    assert "probes of 16 tokens a block (vllm:cache_config_info)" in out.stderr
    assert "tenants kept apart with different salts" in out.stdout


def test_timing_audit_catches_unsalted_tenants():
    """The same server without salts on the clients' side (--cache-salt none), and with the fault that
    drops the salt from the block keys: one tenant reads the other's blocks, exit 1."""
    from kvtui.serve.server import ServeOptions, ServeServer

    with ServeServer(ServeOptions(model="tiny-llama", port=0, kv="paged", prefix_caching=True, threads=1,
                                  detectors=(), faults=("unsalted_prefix",))) as faulty:
        out = audit_timing(faulty.url)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "with different salts, one tenant can tell another's" in " ".join(out.stderr.split())
    rows = {line.split("│")[1].strip(): line for line in out.stdout.splitlines() if line.count("│") >= 6}
    assert "8 of 8 (128 cached tokens)" in rows["different salts"]


def test_timing_audit_without_client_salts_fails_on_a_shared_cache(tiny_paged):
    out = audit_timing(tiny_paged.url, "--cache-salt", "none")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "with no salt, one tenant can tell another's" in " ".join(out.stderr.split())


def test_timing_verdict_needs_the_control():
    from kvtui.remote.timing import TargetTimingRow, verdict

    def row(config: str, hits: int | None, auc: float = 0.5) -> TargetTimingRow:
        return TargetTimingRow(config, 8, 8, 0.1, 0.1, auc, hits is not None, hits, None if hits is None else 16 * hits)

    clean = [row("different", 0), row("same", 8), row("none", 8)]
    assert verdict(clean, "per_tenant") == verdict(clean, "per_tenant").__class__(False, "different", False)
    assert verdict(clean, "none").leak
    off = [row("different", 0), row("same", 0), row("none", 0)]
    assert verdict(off, "per_tenant").inconclusive and not verdict(off, "per_tenant").leak
    unreported = [row("different", None, auc=0.95), row("same", None, auc=1.0), row("none", None, auc=1.0)]
    assert verdict(unreported, "per_tenant").leak  # timing alone tells them apart


def test_serve_takes_a_paged_fault_with_the_tenant_flags_and_refuses_it_without():
    from kvtui.serve.server import ServeOptions, ServeServer

    def load(**options):
        server = ServeServer(ServeOptions(model="tiny-llama", port=0, threads=1, detectors=(),
                                          faults=("unsalted_prefix",), **options))
        server.load()
        return server

    assert load(kv="paged", prefix_caching=True).scenario.engine.kv == "paged"
    with pytest.raises(ValueError, match=r"^--fault unsalted_prefix: acts with kv: paged only, not slots, so it "
                                         r"would never fire"):
        load()


def test_the_offload_tier_serves_an_evicted_prefix_back_to_its_own_tenant_only():
    """`--kv-offload-blocks`: a pool of 5 blocks is overrun by other prompts, the first prompt's two full
    blocks go to the tier and come back for its own salt (32 cached tokens, the external counters say
    so), never for another salt."""
    from kvtui.serve.server import ServeOptions, ServeServer

    others = [list(range(100 + 40 * i, 134 + 40 * i)) for i in range(3)]
    with ServeServer(ServeOptions(model="tiny-llama", port=0, kv="paged", prefix_caching=True, threads=1, detectors=(),
                                  max_len=64, kv_offload_blocks=16, extra={"num_blocks": 6})) as server:
        url = server.url
        assert cached(url, cache_salt="a") == 0
        for prompt in others:
            assert completion(url, prompt=prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert [cached(url, cache_salt="b"), cached(url, cache_salt="a")] == [0, 32]
        text = httpx.get(f"{url}/metrics", timeout=10).text
    metrics = parse_metrics(text)
    assert metrics["vllm:external_prefix_cache_hits_total"] == 32
    assert metrics["vllm:prefix_cache_hits_total"] == 0  # the pool itself had evicted them
    ours = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert ours["kvtui:kv_offload_stores_total"] >= 2 and ours["kvtui:kv_offload_bytes"] > 0


def test_serve_refuses_an_offload_tier_without_the_prefix_cache():
    out = subprocess.run([sys.executable, "-m", "kvtui.cli", "serve", "--model", "tiny-llama", "--kv", "paged",
                          "--kv-offload-blocks", "8"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--kv-offload-blocks needs the prefix cache" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
