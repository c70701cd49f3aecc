"""The scenario language for paged KV: engine fields, tenants and cache salts, the shared-prefix prompt
kinds (system_prompt, multi_turn), and one clear line for each mistake."""

from __future__ import annotations

import re

import pytest
from test_scenario_plan import TOK

from kvtui.config import EngineConfig
from kvtui.scenario import ScenarioError, parse_scenario, plan_requests

OK = "max_requests: 4\nmodel: tiny-llama\n"


def plan(text: str):
    return plan_requests(parse_scenario(text), TOK)


def test_engine_section_maps_to_the_engine_config():
    s = parse_scenario(OK + "engine: {kv: paged, block_size: 8, num_blocks: 300, prefix_caching: true, watermark: 0.05,"
                            " max_len: 128}")
    assert s.engine_config() == EngineConfig(kv="paged", block_size=8, num_blocks=300, prefix_caching=True,
                                             watermark=0.05, max_len=128)
    assert parse_scenario(OK).engine_config().kv == "slots"  # slots stay the default


@pytest.mark.parametrize("engine,path,fragments", [
    ("{prefix_caching: true}", "engine.prefix_caching", ["needs paged KV", "kv: paged"]),
    ("{num_blocks: 40}", "engine.num_blocks", ["needs paged KV"]),
    ("{kv: paged, num_blocks: 3}", "engine.num_blocks", ["cannot hold one request of max_len 512", "needs 33 blocks"]),
    ("{kv: paged, num_blocks: 40, kv_budget_bytes: 100000}", "engine", ["both num_blocks and kv_budget_bytes"]),
    ("{kv: paged, block_size: 65}", "engine.block_size", ["<= 64"]),
    ("{kv: paged, faults: [stale_slot]}", "engine.faults", ["acts with kv: slots only"]),
    ("{faults: [block_refcount]}", "engine.faults", ["acts with kv: paged only", "set engine.kv: paged"]),
    ("{kv: paged, faults: [unsalted_prefix]}", "engine.faults", ["prefix cache", "engine.prefix_caching: true"]),
])
def test_one_clear_line_per_mistake(engine, path, fragments):
    with pytest.raises(ScenarioError) as info:
        parse_scenario(OK + f"engine: {engine}\n", source="s.yaml")
    assert len(info.value.errors) == 1
    line = info.value.errors[0]
    assert re.match(rf"^s\.yaml:\d+: {re.escape(path)}: .+; .+$", line), line
    for fragment in fragments:
        assert fragment in line, line


def test_a_timeline_fault_switch_is_checked_against_the_kv_mode():
    with pytest.raises(ScenarioError) as info:
        parse_scenario(OK + "timeline: [{at_s: 1, set: {fault: prefix_key_no_parent}}]\n", source="s.yaml")
    assert "timeline.0.set.fault: fault prefix_key_no_parent acts with kv: paged only" in info.value.errors[0]


def test_tenants_and_salts():
    one = plan(OK + "prompts: {kind: synthetic, prompt_tokens: 4}")
    assert {(p.tenant, p.cache_salt) for p in one} == {(None, None)}  # one tenant: no tenant, no salt
    text = "max_requests: 30\nprompts: {kind: synthetic, prompt_tokens: 4}\ntenants: {count: 3}\n"
    many = plan(text)
    assert {p.tenant for p in many} == {"t0", "t1", "t2"}
    salts = {p.tenant: p.cache_salt for p in many}
    assert all(p.cache_salt == salts[p.tenant] for p in many) and len(set(salts.values())) == 3
    assert all(salt.startswith(f"{tenant}:") and len(salt) > 20 for tenant, salt in salts.items())
    assert plan(text) == many  # fixed by the seed
    assert [p.prompt_ids for p in many] == [p.prompt_ids for p in plan(text.replace("count: 3", "count: 1"))]
    unsalted = plan(text.replace("count: 3}", "count: 3, cache_salt: none}"))
    assert {p.cache_salt for p in unsalted} == {None} and [p.tenant for p in unsalted] == [p.tenant for p in many]
    turns = plan(text.replace("count: 3}", "count: 3, assign: round_robin}"))
    assert [p.tenant for p in turns[:6]] == ["t0", "t1", "t2", "t0", "t1", "t2"]


def test_scripted_requests_name_their_tenant():
    planned = plan("arrivals: {process: scripted, requests: [{at_s: 0, prompt: hi, tenant: alice}, "
                   "{at_s: 1, prompt: yo}]}\ntenants: {count: 2, assign: round_robin}\n")
    assert [p.tenant for p in planned] == ["alice", "t1"]
    assert planned[0].cache_salt.startswith("alice:")


def test_system_prompt_kind_shares_prefixes():
    planned = plan("max_requests: 12\nprompts: {kind: system_prompt, count: 3, system_tokens: 20, "
                   "instruction_tokens: 5, user_tokens: 7}\n")
    systems = {tuple(p.prompt_ids[:20]) for p in planned}
    assert len(systems) == 3 and all(len(p.prompt_ids) == 32 for p in planned)
    assert {tuple(p.prompt_ids[20:25]) for p in planned} == {tuple(planned[0].prompt_ids[20:25])}  # instruction
    assert len({tuple(p.prompt_ids[25:]) for p in planned}) == 12  # each request's own part
    by_system = {}
    for p in planned:
        by_system.setdefault(p.facts.system_prompt, set()).add(tuple(p.prompt_ids[:20]))
    assert sorted(by_system) == [0, 1, 2] and all(len(heads) == 1 for heads in by_system.values())


def test_multi_turn_each_turn_extends_the_previous_one():
    planned = plan("max_requests: 10\nprompts: {kind: multi_turn, sessions: 2, turns: 3, system_tokens: 6, "
                   "user_tokens: 4, reply_tokens: 3}\ntenants: {count: 4}\n")
    by_session: dict = {}
    for p in planned:
        by_session.setdefault(p.facts.session, []).append(p)
    assert sorted(by_session) == [0, 1, 2, 3]  # 2 side by side, 3 turns each, then new sessions
    for turns in by_session.values():
        assert [p.facts.turn for p in turns] == list(range(len(turns)))
        assert len(turns[0].prompt_ids) == 6 + 4
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.prompt_ids[: len(prev.prompt_ids)] == prev.prompt_ids
            assert len(nxt.prompt_ids) == len(prev.prompt_ids) + 3 + 4
        assert len({p.tenant for p in turns}) == 1  # a session belongs to one tenant
    first_turns = [turns[0].prompt_ids[:6] for turns in by_session.values()]
    assert all(ids == first_turns[0] for ids in first_turns)  # one system prompt for every session


@pytest.mark.parametrize("args,fragment", [
    (["--fault", "unsalted_prefix"], "--fault unsalted_prefix: acts with kv: paged only, not slots"),
    (["--prefix-caching"], "--prefix-caching needs paged KV; set engine.kv: paged"),
])
def test_cli_refuses_paged_options_on_a_slot_scenario_in_one_line(tmp_path, args, fragment):
    from typer.testing import CliRunner

    from kvtui.cli import app

    path = tmp_path / "slots.yaml"
    path.write_text(OK + "output_tokens: 2\n")
    result = CliRunner().invoke(app, ["run", str(path), "--headless", "-q", *args])
    assert result.exit_code == 2
    assert fragment in result.output and "Traceback" not in result.output
