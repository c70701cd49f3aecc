"""verdict (kvtui/run/outcome.py): the scenario's `expect` against what a finished run found, read through
the RunOutcome protocol alike for a local run and a run against a server."""

from __future__ import annotations

from fake_openai import FakeOpenAI

from kvtui.models import build_tiny_tokenizer
from kvtui.remote.session import TargetOptions, TargetSession
from kvtui.run.outcome import verdict
from kvtui.scenario import parse_scenario
from kvtui.session import Session

SCENARIO = """name: verdict-test
seed: 3
max_requests: 3
model: tiny-llama
engine: {slots: 3, max_len: 128}
arrivals: {process: burst, size: 16, every_s: 100}
prompts: {kind: passphrase}
output_tokens: 4
sampling: {ignore_eos: true}
expect: {contamination: detected}
"""


def test_a_local_run_that_found_nothing_says_whether_a_fault_was_on(tiny):
    spec = parse_scenario(SCENARIO)
    clean = Session(spec, tiny["tiny-llama"], clock="virtual", detectors=("slot_taint",))
    clean.run()
    assert clean.faults_known and clean.fault_history == [] and clean.contamination == []
    assert verdict(spec, clean) == (True, "expected contamination to be detected but no fault was on, yet no "
                                          "detector fired")
    assert verdict(spec, clean, expect_override="none") == (False, "")


def test_the_verdict_counts_findings_as_the_summary_does(tiny):
    """A leak seen by two detectors in each of its victims: the line counts one finding per victim, as the
    summary's "contamination findings" row does, then the detectors' reports (it said "12 events" beside a
    table saying 4)."""
    spec = parse_scenario(SCENARIO)
    leaky = Session(spec, tiny["tiny-llama"], clock="virtual", detectors=("slot_taint", "attention_flow"),
                    faults=("shared_cache",))
    summary = leaky.run()
    victims = {e.victim for e in leaky.contamination if e.counts}
    reports = sum(e.counts for e in leaky.contamination)
    assert len(victims) >= 1 and reports > len(victims)  # more reports than findings: the case to count right
    failed, line = verdict(spec, leaky, expect_override="none")
    assert failed and line.startswith(f"unexpected contamination: {len(victims)} finding")
    assert f"({reports} detector reports)" in line
    assert sum(summary.findings_by_kind.values()) == len(victims)  # the table's "contamination findings"


def test_a_target_run_says_nothing_of_faults_it_cannot_know():
    spec = parse_scenario(SCENARIO)
    session = TargetSession(spec, build_tiny_tokenizer(), TargetOptions(url="http://fake",
                                                                        transport=FakeOpenAI().transport()),
                            detectors=("canary",))
    session.run()
    assert not session.faults_known and session.contamination == []
    assert verdict(spec, session) == (True, "expected contamination to be detected, yet no detector fired")
