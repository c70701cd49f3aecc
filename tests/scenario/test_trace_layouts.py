"""Trace layouts (Mooncake JSONL, BurstGPT CSV, Azure CSV): each sample file parsed with its real values,
hash-id blocks as shared token-id prefixes, the theoretical prefix-hit rate by hand, bad lines named by file,
line and column (exit 2 from the command line)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_scenario_plan import FakeTokenizer

from kvtui.scenario import load_scenario, parse_scenario, plan_requests
from kvtui.scenario.errors import Problem, ScenarioError
from kvtui.scenario.plan import planned_arrivals
from kvtui.scenario.trace import azure_seconds, hit_table, read_trace, theoretical_hits

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT / "scenarios" / "traces"
TOK = FakeTokenizer()


def test_mooncake_sample_rows_and_arrivals():
    rows = read_trace("mooncake_sample.jsonl", TRACES, "mooncake")
    assert len(rows) == 30
    assert (rows[0].timestamp, rows[0].prompt_tokens, rows[0].output_tokens, rows[0].hash_ids) == (0.0, 123, 9,
                                                                                                   (0, 1, 5, 6))
    assert (rows[1].timestamp, rows[1].hash_ids) == (0.12, (2, 3, 4, 7))  # 120 ms
    s = load_scenario(ROOT / "scenarios" / "trace_mooncake.yaml")  # time_scale 0.5
    arrivals = planned_arrivals(s)
    assert [a.at_s for a in arrivals[:3]] == [0.0, 0.06, 0.06]
    assert arrivals[2].hash_ids == (0, 1, 5, 8, 9) and arrivals[2].prompt_tokens == 160


def test_burstgpt_sample_rows_leave_out_failed_requests():
    rows = read_trace("burstgpt_sample.csv", TRACES, "burstgpt")
    assert len(rows) == 29  # 30 rows, one with 0 response tokens (a failure in BurstGPT) left out
    assert [(r.timestamp, r.prompt_tokens, r.output_tokens) for r in rows[:3]] == [(2.0, 39, 9), (3.0, 26, 15),
                                                                                    (3.0, 33, 16)]
    assert all(r.hash_ids is None for r in rows)


def test_azure_sample_rows_and_timestamps():
    rows = read_trace("azure_sample.csv", TRACES, "azure")
    assert len(rows) == 30
    assert (rows[0].prompt_tokens, rows[0].output_tokens, rows[1].prompt_tokens) == (37, 8, 38)
    # 2023-11-16 18:15:47.0283960 UTC = 1700158547.028396 s; the next row 0.138656 s later
    assert rows[0].timestamp == pytest.approx(1700158547.028396, abs=1e-6)
    assert rows[1].timestamp - rows[0].timestamp == pytest.approx(0.138656, abs=1e-6)
    assert azure_seconds("x", "2023-11-16 18:15:46") == 1700158546.0


def test_shared_hash_ids_share_their_blocks_of_token_ids(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 130, "output_length": 4, "hash_ids": [1, 2, 3]}\n'
                     '{"timestamp": 5, "input_length": 130, "output_length": 4, "hash_ids": [1, 2, 4]}\n'
                     '{"timestamp": 9, "input_length": 130, "output_length": 4, "hash_ids": [7]}\n')
    s = parse_scenario("name: t\narrivals: {process: trace, file: t.jsonl, format: mooncake, hash_block_size: 16}\n"
                       "prompts: {kind: trace_passphrase}\n", base_dir=tmp_path)
    a, b, c = plan_requests(s, TOK)
    assert len(a.prompt_ids) == len(b.prompt_ids) == 130
    assert a.prompt_ids[:32] == b.prompt_ids[:32]  # blocks of hash ids 1 and 2
    assert a.prompt_ids[32:48] != b.prompt_ids[32:48]  # 3 vs 4
    assert a.prompt_ids[:16] != c.prompt_ids[:16]
    # the canary: each prompt ends with its own passphrase, and the passphrases differ
    for p in (a, b, c):
        assert bytes(t - 3 for t in p.prompt_ids[-60:]).decode().find(p.passphrase) >= 0
    assert len({a.passphrase, b.passphrase, c.passphrase}) == 3
    # the same seed and hash id give the same block in another scenario
    again = plan_requests(s, TOK)
    assert again[1].prompt_ids == b.prompt_ids


def test_sample_prompts_share_the_prefixes_the_trace_says():
    reqs = plan_requests(load_scenario(ROOT / "scenarios" / "trace_mooncake.yaml"), TOK)
    rows = read_trace("mooncake_sample.jsonl", TRACES, "mooncake")
    # the trace's lengths; a prompt shorter than its passphrase's ending (the fake tokenizer: a token a byte) is
    # that ending alone
    tails = [len(TOK.encode(f" The passphrase is {p.passphrase}. Reply with only the passphrase.")) for p in reqs]
    assert [len(p.prompt_ids) for p in reqs] == [max(r.prompt_tokens, t) for r, t in zip(rows, tails)]
    assert sum(r.prompt_tokens > t for r, t in zip(rows, tails)) >= 10
    assert [p.facts.hash_ids for p in reqs] == [r.hash_ids for r in rows]
    same = differ = 0
    for i, a in enumerate(reqs):
        for b in reqs[i + 1:]:
            bodies = min(len(a.prompt_ids) - tails[reqs.index(a)], len(b.prompt_ids) - tails[reqs.index(b)])
            k = 0
            while k < min(len(a.facts.hash_ids), len(b.facts.hash_ids)) and a.facts.hash_ids[k] == b.facts.hash_ids[k]:
                k += 1
            n = min(32 * k, bodies)
            if n >= 32:  # their shared leading blocks (as far as both bodies reach) are the same token ids
                assert a.prompt_ids[:n] == b.prompt_ids[:n]
                same += 1
            if k == 0 and bodies >= 32:
                assert a.prompt_ids[:32] != b.prompt_ids[:32]
                differ += 1
    assert same >= 20 and differ >= 20


def test_theoretical_hit_rate_of_a_three_row_trace():
    # blocks of 16: [1,2] 32 tokens, nothing seen; [1,2,3] 48 tokens, 1 and 2 seen: 32; [1,4] 20 tokens, 1 seen:
    # 16 (the block's tokens, within its prompt). 48 of 100 prompt tokens.
    hits = theoretical_hits([((1, 2), 32), ((1, 2, 3), 48), ((1, 4), 20)], 16)
    assert (hits.hit_tokens, hits.prompt_tokens, hits.rate) == (48, 100, 0.48)
    # a hash id seen only after an unseen one does not count (a block's key chains its prefix)
    assert theoretical_hits([((1, 2), 32), ((9, 2), 32)], 16).hit_tokens == 0
    # the last block counts only the prompt's tokens in it
    assert theoretical_hits([((1,), 16), ((1,), 10)], 16).hit_tokens == 10


def test_hit_table_per_tenant():
    rows = hit_table([("t0", (1, 2), 32, 32, 0), ("t1", (1, 2), 32, 32, 0), ("t0", (1, 2), 32, 32, 32)], 16)
    got = {r.who: (r.theoretical.hit_tokens, r.theoretical.prompt_tokens, r.cached_tokens, r.prompt_tokens)
           for r in rows}
    assert got == {"all": (64, 96, 32, 96), "t0": (32, 64, 32, 64), "t1": (0, 32, 0, 32)}


@pytest.mark.parametrize("layout, text, where", [
    ("mooncake", '{"timestamp": 0, "input_length": 5, "output_length": 2}\n{"timestamp": 1, "input_length": 5}\n',
     "line 2, column output_length: missing"),
    ("mooncake", '{"timestamp": 0, "input_length": "abc", "output_length": 2}\n',
     "line 1, column input_length: 'abc' is not a whole number"),
    ("mooncake", '{"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": [1, "x"]}\n',
     "line 1, column hash_ids: 'x' is not a whole number"),
    ("mooncake", '{"timestamp": 0, "input_length": 5,\n', "line 1, column 36: not JSON"),
    ("burstgpt", "Timestamp,Model,Request tokens,Total tokens,Log Type\n1,ChatGPT,4,6,API log\n",
     "line 1, column Response tokens: missing from the header"),
    ("burstgpt", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,ChatGPT,4,2,6,API log\n"
     "soon,ChatGPT,4,2,6,API log\n", "line 3, column Timestamp: 'soon' is not a number"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,12,4\n"
     "2023-11-16 18:15:47.1,twelve,4\n", "line 3, column ContextTokens: 'twelve' is not a whole number"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,12,4\n", "line 2, column TIMESTAMP: 'yesterday'"),
])
def test_bad_lines_name_file_line_and_column(tmp_path, layout, text, where):
    (tmp_path / "bad.txt").write_text(text)
    with pytest.raises(Problem) as e:
        read_trace("bad.txt", tmp_path, layout)
    assert f"bad.txt {where}" in e.value.problem
    (tmp_path / "s.yaml").write_text(f"name: s\narrivals: {{process: trace, file: bad.txt, format: {layout}}}\n")
    with pytest.raises(ScenarioError) as err:
        load_scenario(tmp_path / "s.yaml")
    assert len(err.value.errors) == 1 and f"bad.txt {where}" in err.value.errors[0]


def test_a_bad_trace_line_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 0, "input_length": "abc", "output_length": 2}\n')
    (tmp_path / "s.yaml").write_text("name: s\narrivals: {process: trace, file: bad.jsonl, format: mooncake}\n")
    out = subprocess.run([sys.executable, "-m", "kvtui.cli", "validate", str(tmp_path / "s.yaml")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "bad.jsonl line 1, column input_length" in lines[0], out.stderr


def test_sessions_plan_later_turns_after_the_first():
    s = parse_scenario("name: s\nseed: 1\nmax_requests: 2\nsessions: {turns: 3, think_time_s: {distribution: "
                       "uniform, min_s: 0.5, max_s: 1.5}}\n")
    local = plan_requests(s, TOK)
    assert [p.request_id for p in local] == ["r000", "r001"] and all(p.turn is None for p in local)
    reqs = plan_requests(s, TOK, sessions=True)
    assert [p.request_id for p in reqs] == ["r000", "r001", "r000-t1", "r000-t2", "r001-t1", "r001-t2"]
    later = reqs[2]
    assert (later.turn.session, later.turn.turn, later.turn.turns) == ("r000", 1, 3)
    assert 0.5 <= later.turn.think_s <= 1.5 and later.passphrase == reqs[0].passphrase
    assert later.text == "What was the passphrase? Reply with only the passphrase."
    assert later.sampling.seed != reqs[0].sampling.seed
