"""The KV offload tier (engine.kv_offload_blocks): evicted full blocks go to a bounded LRU host tier and
come back on a later prefix hit, bit for bit, with answers equal to transformers' own greedy run on a
separate model instance; its three faults are caught with victim and source on held-out loads; the
same loads without a fault stay silent; bad settings are one clear error."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import oracle_model, run_batched, uncached_greedy
from test_faults import CONTAMINATION, run

from kvtui.config import EngineConfig
from kvtui.engine import SamplingParams
from kvtui.engine.block_manager import BlockManager, BlockOrigin
from kvtui.engine.kv_pool import PagedKVPool
from kvtui.engine.offload import HostTier, TierEntry, block_bytes_digest, restore, store
from kvtui.events import Finish, StepEvent
from kvtui.scenario import ScenarioError, parse_scenario

TIER_FAULTS = ("tier_key_drops_partition", "tier_layout_mismatch", "tier_partial_load")


def _origin(writer: str = "r0") -> BlockOrigin:
    return BlockOrigin(writer, None, None, b"k" * 32, 4)


def test_host_tier_drops_the_least_recently_used_entry_past_capacity():
    tier = HostTier(2)
    entries = {k: TierEntry(_origin(), torch.zeros(1), [], "") for k in (b"a", b"b", b"c")}
    tier.put(b"a", entries[b"a"])
    tier.put(b"b", entries[b"b"])
    assert tier.get(b"a") is entries[b"a"]  # a is now the most recently used
    tier.put(b"c", entries[b"c"])
    assert list(tier.entries) == [b"a", b"c"] and tier.get(b"b") is None
    assert (tier.stores, tier.evictions, len(tier)) == (3, 1, 2)
    with pytest.raises(ValueError, match="capacity"):
        HostTier(0)


def test_block_manager_stores_an_evicted_block_and_restores_it_on_the_next_hit():
    """Torch-free bookkeeping: a cached block evicted by an allocation is queued for the tier under its
    tier key; the same prompt later gets it back in a new block, counted as a hit, cached again."""
    manager = BlockManager(4, 4, caching=True, watermark=0.0)  # 3 usable blocks of 4 tokens
    manager.tier = HostTier(8)
    prompt = list(range(9))  # two full blocks and one token
    keys = [b"t0" * 16, b"t1" * 16]
    assert manager.admit("a", prompt, tier_keys=keys).hit_tokens == 0
    manager.commit("a", prompt, 9, prompt_len=9, tier_keys=keys)
    manager.free("a")
    manager.admit("b", list(range(100, 111)), tier_keys=[b"x" * 32, b"y" * 32])  # takes all 3 blocks
    stores, loads = manager.take_tier_ops()
    assert [(key, origin.writer) for _, key, origin, _ in stores] == [(keys[1], "a"), (keys[0], "a")]
    for block, key, origin, _ in stores:
        manager.tier.put(key, TierEntry(origin, torch.zeros(1), [0] * 4, str(block)))
    manager.free("b")
    admission = manager.admit("c", prompt, tier_keys=keys)
    assert admission.hit_tokens == 8 and [r.tier for r in admission.reused] == [True, True]
    assert [r.origin.writer for r in admission.reused] == ["a", "a"] and all(r.verified for r in admission.reused)
    _, loads = manager.take_tier_ops()
    assert [block for block, _ in loads] == [r.block_id for r in admission.reused]
    assert manager.tier.hits == 2 and manager.tier_hit_tokens == 8 and manager.hits == 0  # the pool itself missed
    assert manager.tier_query_tokens == 9 + 11 + 9


def _pool(blocks: int = 3) -> PagedKVPool:
    pool = PagedKVPool(num_layers=2, num_kv_heads=2, head_dim=3, num_blocks=blocks, block_size=4, max_len=8,
                       dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    for keys, values in zip(pool.keys, pool.values):
        keys.copy_(torch.randn(keys.shape, generator=gen))
        values.copy_(torch.randn(values.shape, generator=gen))
    pool.writer[1] = torch.tensor([5, 5, 6, 6])
    return pool


def test_store_and_restore_give_back_the_same_bytes_and_tags():
    pool = _pool()
    entry = store(pool, 1, _origin())
    assert entry.data.shape == (2, 2, 4, 2, 3)  # [layers, K/V, tokens, heads, dim]: token-major
    assert torch.equal(entry.data[0, 1].transpose(0, 1), pool.values[0][1])
    restore(pool, entry, 2, frozenset())
    for keys, values in zip(pool.keys, pool.values):
        assert torch.equal(keys[2], keys[1]) and torch.equal(values[2], values[1])
    assert pool.writer[2].tolist() == [5, 5, 6, 6]
    assert block_bytes_digest(pool, 2) == entry.digest


def test_layout_mismatch_restores_well_formed_wrong_bytes():
    pool = _pool()
    entry = store(pool, 1, _origin())
    restore(pool, entry, 2, frozenset({"tier_layout_mismatch"}))
    assert pool.keys[0][2].shape == pool.keys[0][1].shape
    assert not torch.equal(pool.keys[0][2], pool.keys[0][1])
    assert sorted(pool.keys[0][2].flatten().tolist()) == sorted(pool.keys[0][1].flatten().tolist())  # same numbers
    assert block_bytes_digest(pool, 2) != entry.digest


def _tier_load(n: int = 10):
    """Three system prompts of 32 tokens in turn, a pool of 7 usable 8-token blocks: cached prompt blocks
    are evicted before the next request of the same prompt comes, which finds them in the tier."""
    rng = random.Random(11)
    systems = [[rng.randrange(250) for _ in range(32)] for _ in range(3)]
    prompts = [systems[i % 3] + [rng.randrange(250) for _ in range(rng.randint(2, 6))] for i in range(n)]
    return prompts, [SamplingParams(max_new_tokens=6) for _ in range(n)], list(range(0, 3 * n, 3))


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_restored_blocks_give_transformers_greedy_answers(tiny, layout):
    """The oracle: transformers' own forward, no cache, on a separate instance of tiny-llama."""
    prompts, params, arrivals = _tier_load()
    config = EngineConfig(kv="paged", block_size=8, num_blocks=8, max_len=48, prefix_caching=True, watermark=0.0,
                          max_batch_size=1, layout=layout, kv_offload_blocks=12)
    engine, outputs, reports = run_batched(tiny["tiny-llama"], prompts, params, arrivals, config)
    hits, stores = sum(r.kv_offload_hits for r in reports), sum(r.kv_offload_stores for r in reports)
    assert hits >= 8 * 4 * 6 and stores * 8 >= hits  # from the 4th request on, each gets its 4 prompt blocks back
    assert sum(r.kv_offload_queries for r in reports) == sum(map(len, prompts))  # the pool never hit
    assert max(r.kv_offload_blocks for r in reports) <= 12
    assert {r.kv_offload_bytes for r in reports} >= {12 * engine.pool.bytes_per_block}
    assert sum(r.prefix_cache_hits for r in reports) == 0  # every hit came from the tier, none from the pool
    oracle = oracle_model("tiny-llama", "eager")
    for prompt, output in zip(prompts, outputs):
        assert output == uncached_greedy(oracle, prompt, 6)


def _steps_and_run(tiny, spec):
    steps = []
    session = run(tiny, spec, listeners=(lambda e: steps.append(e) if isinstance(e, StepEvent) else None,))
    return session, steps


# held out: loads the faults were not tuned on (seeds, block sizes, prompt counts, tenants)
HELD_OUT = [(seed, block, prompts, tenants) for seed, block, prompts, tenants in
            ((5, 8, 3, 2), (17, 16, 5, 3), (23, 8, 4, 2), (41, 16, 3, 2))]


def _held_out(seed: int, block: int, prompts: int, tenants: int, fault: str = "") -> str:
    blocks = -(-64 // block) * 2 + 1
    return f"""name: tier-held-out
model: tiny-llama
seed: {seed}
max_requests: 12
engine: {{kv: paged, block_size: {block}, max_len: 64, num_blocks: {blocks}, max_batch_size: 2, prefix_caching: true,
          kv_offload_blocks: 48, layout: {random.Random(seed).choice(["padded", "packed"])}, faults: [{fault}]}}
tenants: {{count: {tenants}}}
arrivals: {{process: poisson, rate_per_s: 3.0}}
prompts: {{kind: system_prompt, count: {prompts}, system_tokens: 32, user_tokens: {{dist: uniform, min: 2, max: 8}}}}
output_tokens: 6
sampling: {{ignore_eos: true}}
"""


@pytest.mark.parametrize("seed,block,prompts,tenants", HELD_OUT)
def test_held_out_tier_loads_are_silent_with_the_tier_intact(tiny, seed, block, prompts, tenants):
    session, steps = _steps_and_run(tiny, parse_scenario(_held_out(seed, block, prompts, tenants)))
    assert sum(s.kv_offload_hits for s in steps) > 0  # the tier was used
    assert [e for e in session.contamination if e.kind in CONTAMINATION] == []


def _leaks(steps) -> set[tuple[str, str]]:
    """(victim, source) of every block a hit handed over wrongly, by the engine's record of each hit: from
    the tier, another salt's block (the writer) or bytes other than those stored (whoever's bytes are
    there); from the pool, a block whose contents are not the reader's (a wrong restore cached again)."""
    out = set()
    for hit in (h for s in steps for h in s.prefix_hits):
        for b in hit.blocks:
            if b.tier and b.intact is False:
                out.add((hit.request_id, b.found_writer or b.writer))
            elif b.writer_salt != hit.salt or b.writer_key != b.reader_key:
                out.add((hit.request_id, b.writer))
    return out


def _wrong_answers(events) -> set[str]:
    """Requests whose greedy answer differs from transformers' own forward (no cache) on a separate
    instance of tiny-llama: the victims a detector must name, found without kvtui's code."""
    oracle = oracle_model("tiny-llama", "eager")
    done = [e for e in events if isinstance(e, Finish)]
    return {e.request_id for e in done if list(e.output_ids) != uncached_greedy(oracle, list(e.prompt_ids),
                                                                                   len(e.output_ids))}


@pytest.mark.parametrize("fault", TIER_FAULTS)
def test_held_out_tier_faults_are_caught_naming_victim_and_source(tiny, fault):
    """On each held-out load, prefix_provenance names exactly the (victim, source) pairs the tier served
    wrongly, and every request whose answer is wrong (by the oracle) is named as a victim, including
    later readers of a wrongly restored block; over the loads the fault acted at least twice."""
    acted = 0
    for load in HELD_OUT:
        events = []
        session = run(tiny, parse_scenario(_held_out(*load, fault)), listeners=(events.append,))
        steps = [e for e in events if isinstance(e, StepEvent)]
        victims = {e.victim for e in session.contamination if e.counts}
        assert _wrong_answers(events) <= victims, load
        provenance = [e for e in session.contamination if e.detector == "prefix_provenance" and e.counts]
        assert {(e.victim, e.source) for e in provenance} == _leaks(steps), load
        assert all(e.source is not None and e.source != e.victim for e in provenance)
        restored = [e.evidence.tier_intact for e in provenance if e.evidence.tier_intact is not None]
        assert set(restored) <= {fault == "tier_key_drops_partition"}  # the right bytes (another salt's), or not
        kind = "cross_tenant" if fault == "tier_key_drops_partition" else "cross_request"  # the former: right answers
        assert {e.kind for e in provenance} <= {kind}
        acted += bool(provenance)
    assert acted >= 2


@pytest.mark.parametrize("text,field", [
    ("engine: {kv: paged, kv_offload_blocks: 8}", "kv_offload_blocks"),
    ("engine: {kv: paged, prefix_caching: true, kv_offload_blocks: -1}", "kv_offload_blocks"),
    ("engine: {kv: paged, prefix_caching: true, faults: [tier_partial_load]}", "faults"),
])
def test_bad_tier_settings_name_the_field_and_the_fix(text, field):
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(f"name: bad\nmodel: tiny-llama\n{text}\n", source="bad.yaml")
    (line,) = caught.value.errors
    assert line.startswith(f"bad.yaml:3: engine.{field}") and "\n" not in line, line


def test_a_recorded_tier_run_replays_its_figures_and_the_dashboard_shows_them(tiny, tmp_path):
    import asyncio

    from test_tui_app import LIVE_DETECTORS

    from kvtui.cli import replay_summary
    from kvtui.record import read_recording
    from kvtui.session import Session
    from kvtui.tui.app import KvtuiApp, screen_text
    from kvtui.tui.replay import ReplaySource

    path = tmp_path / "tier.jsonl"
    session = Session(parse_scenario(_held_out(*HELD_OUT[0])), tiny["tiny-llama"], clock="virtual", record_path=path,
                      detectors=LIVE_DETECTORS + ("prefix_provenance",))
    session.run()
    header, events, summary, truncated = read_recording(path)
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert not truncated and summary.kv_offload_hits == sum(s.kv_offload_hits for s in steps) > 0
    assert summary.kv_offload_stores == sum(s.kv_offload_stores for s in steps) > 0
    assert summary.kv_offload_bytes == steps[-1].kv_offload_bytes > 0
    again = replay_summary(header, events, summary)
    assert (again.kv_offload_hits, again.kv_offload_stores) == (summary.kv_offload_hits, summary.kv_offload_stores)

    async def show():
        source = ReplaySource.from_file(path, start_paused=True)
        app = KvtuiApp(source)
        async with app.run_test(size=(160, 45)) as pilot:
            source.seek_to(steps[-1].t)
            await pilot.pause(0.2)
            text = screen_text(app)
            await pilot.press("q")
        return text

    text = asyncio.run(show())
    held = f"{steps[-1].kv_offload_blocks}/{steps[-1].kv_offload_capacity} held"
    assert f"offload tier: {summary.kv_offload_hits} tokens restored · {summary.kv_offload_stores} blocks stored" in text
    assert held in text


@pytest.mark.parametrize("fault", ["", "tier_key_drops_partition"])
def test_the_tier_key_carries_the_lora_adapter(tiny, fault):
    """One tenant, requests under adapters lora-a and lora-b in turn: the tier gives a block back only to
    the adapter that computed it; keyed by tokens alone it crosses adapters, and prefix_provenance names
    the writer (the content keys differ by the adapter's weights)."""
    text = _held_out(17, 16, 2, 1, fault) + "lora: {adapters: [lora-a, lora-b]}\n"
    session, steps = _steps_and_run(tiny, parse_scenario(text))
    assert sum(s.kv_offload_hits for s in steps) > 0
    provenance = [e for e in session.contamination if e.detector == "prefix_provenance" and e.counts]
    assert {(e.victim, e.source) for e in provenance} == _cross_adapter(steps)
    assert bool(provenance) is bool(fault)
    assert [e for e in session.contamination if e.kind in CONTAMINATION and e not in provenance and not fault] == []


def _cross_adapter(steps) -> set[tuple[str, str]]:
    """(victim, source) of reused blocks whose content key is not the reader's (computed under another adapter):
    from the tier, or from the pool after a wrong restore cached them again under the reader's key."""
    return {(h.request_id, b.writer) for s in steps for h in s.prefix_hits for b in h.blocks
            if b.writer_key != b.reader_key}


def test_validate_refuses_a_tier_larger_than_memory_from_the_models_geometry(tmp_path, monkeypatch):
    """kv_offload_blocks: 10000000 validated (about 7 TB for SmolLM2); validate now checks the tier with the pool
    against the memory available, without loading the model: one line naming the field, the bytes and the fit."""
    from typer.testing import CliRunner

    import kvtui.scenario.schema as schema
    from kvtui.cli.app import app

    monkeypatch.setattr(schema, "available_memory_bytes", lambda: 64 * 2**30)
    path = tmp_path / "huge.yaml"
    path.write_text("name: huge\nmax_requests: 1\n"
                    "engine: {kv: paged, prefix_caching: true, kv_offload_blocks: 10000000}\n")
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2 and result.stdout == ""
    # SmolLM2 in float32: 30 layers x K and V x 3 KV heads x 64 x 4 bytes x 16 tokens = 737,280 bytes a block
    assert result.stderr.splitlines() == [
        f"error: {path}:3: engine.kv_offload_blocks: a KV offload tier of 10000000 blocks needs 6866.5 GiB of host "
        "memory for SmolLM2-135M-Instruct (float32) beside the KV pool's 180.7 MiB, more than the 64.0 GiB of memory "
        "available; lower engine.kv_offload_blocks (at most about 92949 blocks fit)"]


def test_a_tier_larger_than_the_hosts_memory_is_refused_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from kvtui.cli.app import app

    path = tmp_path / "huge.yaml"
    path.write_text("name: huge\nmodel: tiny-llama\nmax_requests: 1\n"
                    "engine: {kv: paged, prefix_caching: true, kv_offload_blocks: 10000000}\n")
    result = CliRunner().invoke(app, ["run", str(path), "--headless"])
    assert result.exit_code == 2, result.output
    assert "lower engine.kv_offload_blocks" in result.output and "host memory" in result.output
