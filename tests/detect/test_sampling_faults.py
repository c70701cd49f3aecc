"""The per-row sampling faults (row_state_misalign, shared_rng, penalty_shared_history): their victims
and sources, the constraint detector's reports, and silence with isolation intact on random scenarios
mixing penalties, bias, bans, min_tokens and sampling (tiny-llama)."""

import pytest
from helpers import make_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_faults import CONTAMINATION, SAMPLING_FAULTS, run, scenario

from kvtui.detect.constraint import disallowed
from kvtui.events import Contamination
from kvtui.scenario import parse_scenario, plan_requests


def planned_params(tiny, spec):
    return {p.request_id: p.sampling for p in plan_requests(spec, tiny["tiny-llama"].tokenizer)}


@pytest.mark.parametrize("layout,kv", [("padded", "slots"), ("packed", "paged")])
def test_row_state_misalign_victims_emit_their_own_banned_tokens_picked_by_an_earlier_rows_state(tiny, layout, kv):
    spec = scenario(layout, faults=["row_state_misalign"], kv=kv)
    params = planned_params(tiny, spec)
    session = run(tiny, spec)
    reports = [e for e in session.contamination if e.detector == "constraint"]
    assert len(reports) >= 2
    for e in reports:
        victim, source = params[e.victim], params[e.source]
        assert e.kind == "cross_request" and e.source < e.victim  # a row behind a departed one
        assert e.evidence.rule == "logit_bias" and dict(victim.logit_bias)[e.evidence.token_id] == -100
        assert dict(source.logit_bias).get(e.evidence.token_id, 0) != -100  # the source's own state allows it
        assert e.evidence.sampled_with == e.source
    # every victim of the constraint detector is a reference victim too: its tokens really changed
    assert {e.victim for e in reports} <= {e.victim for e in session.contamination if e.detector == "reference"}


def test_row_state_misalign_off_the_same_load_is_clean(tiny):
    session = run(tiny, scenario("padded", faults=["row_state_misalign"], drop_faults=True))
    assert [e for e in session.contamination if e.kind in CONTAMINATION] == []


@pytest.mark.parametrize("fault,victim_kind", [("shared_rng", "sampled"), ("penalty_shared_history", "penalized")])
def test_the_victims_are_the_requests_that_carry_the_state(tiny, fault, victim_kind):
    """shared_rng damages only sampled requests (greedy ones draw nothing), penalty_shared_history only
    penalized ones; each is cross_request: alone, with the same fault, the request gives its clean tokens
    (reference), and the engine's tags name who reached it (sampling_provenance)."""
    spec = scenario("padded", faults=[fault])
    params = planned_params(tiny, spec)
    session = run(tiny, spec)
    reports = [e for e in session.contamination if e.counts]
    carriers = {r for r, p in params.items() if (not p.greedy if victim_kind == "sampled"
                                                 else p.repetition_penalty != 1.0 or p.presence_penalty)}
    assert reports and {e.victim for e in reports} <= carriers
    assert all(e.kind == "cross_request" and e.detector in ("reference", "sampling_provenance") for e in reports)
    assert len({e.victim for e in reports if e.detector == "reference"}) >= 3


class _Entry:
    def __init__(self, request_id, token_id, sampled_with=None):
        self.request_id, self.token_id, self.sampled_with = request_id, token_id, sampled_with


class _Step:
    def __init__(self, step, *entries):
        self.step, self.running = step, entries


def test_constraint_rules_and_attribution_without_the_engines_tag():
    """Each rule from the request's own params; without the engine's tag the only co-running request
    whose own params allow the token is the source."""
    from kvtui.detect.constraint import ConstraintDetector
    from kvtui.engine import SamplingParams

    d = ConstraintDetector(eos_token_ids=(2,))
    d.on_arrive("a", SamplingParams(max_new_tokens=8, bad_words_ids=((5, 6), (9,)), min_tokens=3))
    d.on_arrive("b", SamplingParams(max_new_tokens=8, logit_bias=((6, -100.0),)))
    d.on_arrive("c", SamplingParams(max_new_tokens=8))
    assert d.on_step(_Step(0, _Entry("a", 5), _Entry("b", 7), _Entry("c", 1)), 0.0) == []
    found = d.on_step(_Step(1, _Entry("a", 6), _Entry("b", 4), _Entry("c", 1)), 0.1)
    assert [(e.victim, e.source, e.kind, e.evidence.rule, e.evidence.token_index) for e in found] == [
        ("a", "c", "cross_request", "bad_words", 1)]  # b bans 6 itself: only c's state allows it
    found = d.on_step(_Step(2, _Entry("b", 6, sampled_with="b")), 0.2)
    assert [(e.victim, e.source, e.kind, e.evidence.rule) for e in found] == [("b", None, "corruption", "logit_bias")]
    assert disallowed(SamplingParams(max_new_tokens=8, min_tokens=3), [1, 1], 2, frozenset({2})) == "min_tokens"
    assert disallowed(SamplingParams(max_new_tokens=8, min_tokens=3, ignore_eos=True), [1], 2, frozenset({2})) == ""
    assert disallowed(SamplingParams(max_new_tokens=8, min_tokens=3), [1, 1, 1], 2, frozenset({2})) == ""
    assert isinstance(found[0], Contamination)


@st.composite
def mixed_scenarios(draw):
    entries = []
    for _ in range(draw(st.integers(1, 3))):
        fields = draw(st.fixed_dictionaries({}, optional={
            "repetition_penalty": st.sampled_from([0.7, 1.3, 2.0]),
            "frequency_penalty": st.sampled_from([-1.0, 0.5, 2.0]),
            "presence_penalty": st.sampled_from([-0.5, 1.0]),
            "min_tokens": st.integers(1, 6),
            "temperature": st.sampled_from([0, 0.8]),
            "logit_bias": st.dictionaries(st.integers(0, 255).map(str), st.sampled_from([-100, -5, 3, 100]),
                                          max_size=40)}))
        entries.append({"fraction": 0.3, **fields})
    mix = ", ".join("{" + ", ".join(f"{k}: {v!r}" if k != "logit_bias" else
                                    f"logit_bias: {{{', '.join(f'{chr(34)}{t}{chr(34)}: {b}' for t, b in v.items())}}}"
                                    for k, v in e.items()) + "}" for e in entries)
    layout = draw(st.sampled_from(["padded", "packed"]))
    pool = draw(st.sampled_from(["slots: 3", "kv: paged, block_size: 16, num_blocks: 16"]))
    return parse_scenario(f"""
name: mixed
seed: {draw(st.integers(0, 10_000))}
max_requests: {draw(st.integers(2, 8))}
model: tiny-llama
engine: {{{pool}, max_len: 128, layout: {layout}, max_tokens_per_step: {draw(st.sampled_from([16, 1024]))}}}
arrivals: {{process: poisson, rate_per_s: {draw(st.sampled_from([5.0, 50.0]))}}}
prompts: {{kind: synthetic, prompt_tokens: {{dist: uniform, min: 2, max: 30}}}}
output_tokens: {{dist: uniform, min: 1, max: 12}}
sampling: {{temperature: {draw(st.sampled_from([0, 1.0]))}, mix: [{mix}]}}
""")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mixed_scenarios())
def test_isolation_intact_gives_no_findings_on_mixed_sampling_scenarios(tiny, spec):
    session = run(tiny, spec)
    assert [e for e in session.contamination if e.kind in CONTAMINATION] == []


def test_a_target_run_sends_each_requests_penalties_by_their_api_names(tiny):
    from kvtui.remote.openai import request_body

    spec = parse_scenario("""
name: t
max_requests: 12
model: tiny-llama
prompts: {kind: synthetic, prompt_tokens: 5}
sampling: {mix: [{fraction: 0.5, frequency_penalty: 0.5, repetition_penalty: 1.2, logit_bias: {"7": -100},
                  min_tokens: 2, bad_words: [" x"]}]}
""")
    bodies = [request_body(p, "completions", None, logprobs=False)[1] for p in plan_requests(spec, tiny["tiny-llama"].tokenizer)]
    with_mix = [b for b in bodies if "frequency_penalty" in b]
    assert 1 <= len(with_mix) < len(bodies)
    assert all({k: b[k] for k in ("frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "bad_words")}
               == {"frequency_penalty": 0.5, "repetition_penalty": 1.2, "logit_bias": {"7": -100.0}, "min_tokens": 2,
                   "bad_words": [" x"]} for b in with_mix)
    plain = [b for b in bodies if b not in with_mix]
    assert not any(k in b for b in plain for k in ("presence_penalty", "logit_bias", "min_tokens", "bad_words",
                                                  "repetition_penalty"))


@pytest.mark.parametrize("layout,kv", [("padded", "slots"), ("packed", "paged")])
def test_bf16_with_isolation_intact_labels_the_greedy_sampling_loads_divergences_numeric(tiny, layout, kv):
    """The sampling load made greedy (penalized rows, rows banning half the vocabulary, plain rows): in
    bfloat16 every divergence from the solo run sits at a near tie of the processed logits. (Sampled
    bfloat16 rows on tiny-llama can move a draw's logits past the sampled tolerance with no parameter
    set at all, so they are left out here.)"""
    import test_faults

    body = test_faults.SAMPLING_LOAD.format(pool="kv: paged, block_size: 16, num_blocks: 20" if kv == "paged"
                                            else "slots: 4", layout=layout, faults="", bans=test_faults.BANS,
                                            seed=test_faults.SAMPLING_SEED)
    spec = parse_scenario("name: bf16\nmodel: tiny-llama\ndtype: bfloat16\n"
                          + body.replace("temperature: 1.0, ", "temperature: 0, ") + "\n")
    session = run(tiny, spec)
    assert [e for e in session.contamination if e.kind in CONTAMINATION] == []
    assert session.summary.requests_finished == 12


def test_a_logit_bias_id_past_the_models_vocabulary_is_refused_before_the_run_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from kvtui.cli import app

    path = tmp_path / "bias.yaml"
    path.write_text("name: bias\nmodel: tiny-llama\nmax_requests: 2\n"
                    "sampling: {mix: [{fraction: 0.5}, {fraction: 0.5, logit_bias: {\"300\": -100}}]}\n")
    for command in ("validate", "run"):
        done = CliRunner().invoke(app, [command, str(path), "--headless"][:3 if command == "run" else 2])
        assert done.exit_code == 2, done.output
        assert [line for line in done.stderr.splitlines() if line.strip()] == [
            f"error: {path}: sampling.mix.1.logit_bias: token id 300 is outside the model's vocabulary (259 tokens, "
            "ids 0 to 258); use token ids of this model's tokenizer"]


# -- sampling_provenance: the engine's tags on each sampled token name the victim's source ------------
def provenance_run(tiny, requests, faults=(), slots=3):
    """Run `requests` ((id, prompt ids, SamplingParams), all queued before the first step, so they join
    the rows in this order) on a tiny-llama engine; the sampling_provenance reports."""
    from kvtui.detect.sampling import SamplingProvenanceDetector

    engine = make_engine(tiny["tiny-llama"].model, num_slots=slots, max_len=64, max_batch_size=slots,
                         faults=frozenset(faults), clock="virtual")
    for request_id, prompt, params in requests:
        engine.submit(request_id, prompt, params)
    detector, events = SamplingProvenanceDetector(), []
    for report in engine.run_until_done():
        events += detector.on_step(report, report.t)
        for f in report.finished:
            detector.on_finish(f.request_id)
    return events


def _params(**kw):
    from kvtui.engine import SamplingParams

    return SamplingParams(**{"ignore_eos": True, **kw})


def test_row_state_misalign_names_the_departed_rows_state_and_the_one_ahead(tiny):
    """Rows a, b, c; a leaves after 2 tokens: the ids move up to [b, c] but the states are cut at the end
    to [a's, b's], so b samples with the departed a's row state (and draws from a's generator) and c with
    b's (b is greedy and penalized: c's tokens are picked by b's state, counted in b's history)."""
    requests = [("a", [5, 6, 7], _params(max_new_tokens=2, temperature=1.0, seed=1)),
                ("b", [8, 9], _params(max_new_tokens=6, repetition_penalty=2.0)),
                ("c", [10, 11, 12, 13], _params(max_new_tokens=6))]
    events = provenance_run(tiny, requests, faults=["row_state_misalign"])
    assert [(e.victim, e.source, e.kind, e.evidence.via) for e in events] == [
        ("b", "a", "cross_request", ("row_state", "generator")), ("c", "b", "cross_request", ("row_state", "penalty_history"))]
    b, c = events
    assert (b.evidence.token_index, b.evidence.row_state, b.evidence.generator, b.evidence.penalty_history) == (
        2, "a", ("a",), ())  # a's state has no penalties; its generator only a had drawn from
    assert (c.evidence.token_index, c.evidence.row_state, c.evidence.penalty_history, c.evidence.generator) == (
        2, "b", ("b",), ())  # b's history (its prompt, its own 2 tokens) counted for c; greedy: no draw
    assert provenance_run(tiny, requests) == []


def test_row_state_misalign_leaves_a_plain_row_under_a_plain_rows_state_silent(tiny):
    """Plain greedy a and b, sampled c; a leaves: b picks with a's state, which is as plain as its own
    (argmax either way: not reported); c picks with b's greedy state, losing its temperature (reported,
    and it draws nothing: no generator in its tags)."""
    requests = [("a", [5, 6, 7], _params(max_new_tokens=2)), ("b", [8, 9], _params(max_new_tokens=6)),
                ("c", [10, 11, 12, 13], _params(max_new_tokens=6, temperature=1.0, seed=4))]
    events = provenance_run(tiny, requests, faults=["row_state_misalign"])
    assert [(e.victim, e.source, e.evidence.via, e.evidence.token_index, e.evidence.generator) for e in events] == [
        ("c", "b", ("row_state",), 2, ())]


def test_shared_rng_names_the_reseeding_and_drawing_requests_and_leaves_greedy_ones_silent(tiny):
    """Sampled a (seed 1), greedy g, sampled b (seed 2) join in this order: a reseeds the one generator,
    then b does. a's first draw comes from b's seed; b's first draw follows a's; g draws nothing."""
    requests = [("a", [5, 6, 7], _params(max_new_tokens=4, temperature=1.0, seed=1)),
                ("g", [8, 9], _params(max_new_tokens=4)),
                ("b", [10, 11, 12, 13], _params(max_new_tokens=4, temperature=1.0, seed=2))]
    events = provenance_run(tiny, requests, faults=["shared_rng"])
    assert [(e.victim, e.source, e.evidence.via, e.evidence.generator, e.evidence.token_index) for e in events] == [
        ("a", "b", ("generator",), ("b",), 0), ("b", "a", ("generator",), ("b", "a"), 0)]
    assert "g" not in {e.victim for e in events} | {e.source for e in events}
    assert provenance_run(tiny, requests) == []


def test_penalty_shared_history_names_the_rows_whose_tokens_the_penalties_counted(tiny):
    """Penalized p beside plain q and r: p's repetition penalty reads every row's prompt from its first
    token; q and r have no penalties, so nothing of p reaches them. When q leaves, r becomes p's first
    other history."""
    requests = [("p", [5, 6, 7], _params(max_new_tokens=6, repetition_penalty=2.0)),
                ("q", [8, 9], _params(max_new_tokens=2)),
                ("r", [10, 11, 12, 13], _params(max_new_tokens=6, temperature=1.0, seed=3))]
    events = provenance_run(tiny, requests, faults=["penalty_shared_history"])
    assert [(e.victim, e.source, e.evidence.via, e.evidence.token_index) for e in events] == [
        ("p", "q", ("penalty_history",), 0), ("p", "r", ("penalty_history",), 2)]
    assert events[0].evidence.penalty_history == ("p", "q", "r")
    assert events[1].evidence.penalty_history == ("p", "r")  # q's row left; r's prompt and tokens remain
    assert events[1].evidence.generator == ()  # p is greedy
    assert provenance_run(tiny, requests) == []



@pytest.mark.parametrize("fault", SAMPLING_FAULTS)
@pytest.mark.parametrize("layout,kv", [("padded", "slots"), ("packed", "paged")])
def test_every_sampling_fault_finding_names_a_source_that_carries_the_state(tiny, fault, layout, kv):
    """On the truth-table load each reference victim's finding is joined by a sampling_provenance report
    naming another request of the run (victim <- source); the sources fit the fault: under
    row_state_misalign an earlier row's state, under shared_rng only sampled requests on both ends,
    under penalty_shared_history only penalized victims. The same load with the fault off: no report."""
    spec = scenario(layout, faults=[fault], kv=kv)
    params = planned_params(tiny, spec)
    session = run(tiny, spec)
    reports = [e for e in session.contamination if e.detector == "sampling_provenance"]
    assert reports and all(e.kind == "cross_request" and e.source in params and e.source != e.victim for e in reports)
    findings = [f for f in session.metrics.findings if "reference" in f.detectors]
    assert findings and all(f.sources and "sampling_provenance" in f.detectors for f in findings)
    for e in reports:
        victim, source = params[e.victim], params[e.source]
        if fault == "row_state_misalign":
            assert e.evidence.via[0] == "row_state" and e.evidence.row_state == e.source < e.victim
        elif fault == "shared_rng":
            assert e.evidence.via == ("generator",) and not victim.greedy and not source.greedy
            assert e.source in e.evidence.generator
        else:
            assert e.evidence.via == ("penalty_history",) and (victim.repetition_penalty, victim.presence_penalty) == (2.0, 2.0)
            assert e.source in e.evidence.penalty_history and e.victim in e.evidence.penalty_history
    off = run(tiny, scenario(layout, faults=[fault], kv=kv, drop_faults=True))
    assert [e for e in off.contamination if e.kind in CONTAMINATION] == []
