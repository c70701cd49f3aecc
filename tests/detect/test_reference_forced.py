"""The reference check goes on past a numeric flip: the clean engine runs the request again teacher-forced on
the batched tokens (Engine.submit's `forced`), and every later position where its own choice differs from
the batched token is judged the same way; the first that is not numeric is counted (kvtui/detect/reference.py).

The forced run itself is checked against transformers' own teacher-forced logits on a separate instance."""

from __future__ import annotations

import pytest
import torch
from helpers import make_engine

from kvtui.detect.reference import PendingCheck, ReferenceDetector, _first_difference
from kvtui.engine import SamplingParams
from kvtui.scenario import parse_scenario
from kvtui.session import Session
from kvtui.summary import evidence_text

PROMPT = (5, 6, 7, 8, 9, 10)
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


def run(loaded, prompts, sampling=GREEDY, forced=None, slots=3):
    """The RequestStates of `prompts` run together in a fresh engine (forced: one token tuple per prompt)."""
    engine = make_engine(loaded.model, num_slots=slots, max_batch_size=slots, max_len=64)
    states = [engine.submit(f"r{i}", list(p), sampling, forced=None if forced is None else forced[i])
              for i, p in enumerate(prompts)]
    engine.run_until_done()
    return states


# -- the forced engine run ---------------------------------------------------------------------------------

def test_a_forced_run_chooses_what_transformers_teacher_forced_logits_choose(tiny):
    """At every forced position the engine's own greedy choice is the argmax of transformers' logits for the
    prompt plus the forced prefix (model(input_ids) on a separate instance), in a batch of three."""
    from kvtui.models import load_model

    loaded = tiny["tiny-llama"]
    other = load_model("tiny-llama", progress=False).model  # a separate instance of the same weights
    prompts = [PROMPT, (11, 12, 13), (20, 21, 22, 23, 24, 25, 26, 27)]
    forced = [tuple((7 * i + 3 * j) % 200 + 1 for j in range(8)) for i in range(3)]  # any tokens, not its own
    states = run(loaded, prompts, forced=forced)
    for prompt, tokens, state in zip(prompts, forced, states):
        assert state.generated_ids == list(tokens) and len(state.chosen_ids) == len(tokens)
        with torch.no_grad():
            logits = other(torch.tensor([list(prompt) + list(tokens)])).logits[0]
        expected = logits[len(prompt) - 1: len(prompt) - 1 + len(tokens)].argmax(-1).tolist()
        assert state.chosen_ids == expected
        assert state.chosen_ids != list(tokens)  # it followed the forced tokens, not its own


def test_a_forced_sampled_run_draws_one_uniform_per_token_and_emits_the_forced_one(tiny):
    """Sampled: the same generator as the free run, so where the forced tokens are the free run's own
    tokens its choices and draws are the free run's exactly."""
    loaded = tiny["tiny-llama"]
    sampling = SamplingParams(temperature=1.0, seed=3, max_new_tokens=8, ignore_eos=True)
    [free] = run(loaded, [PROMPT], sampling)
    [forced] = run(loaded, [PROMPT], sampling, forced=[tuple(free.generated_ids)])
    assert forced.chosen_ids == forced.generated_ids == free.generated_ids
    assert [d.u for d in forced.draws] == [d.u for d in free.draws]


def test_a_forced_token_the_requests_own_rules_mask_stops_the_run_there(tiny):
    """bad_words masks the token: the forced run stops before it (nothing noted at that position)."""
    loaded = tiny["tiny-llama"]
    sampling = SamplingParams(max_new_tokens=8, ignore_eos=True, bad_words_ids=((42,),))
    [state] = run(loaded, [PROMPT], sampling, forced=[(1, 2, 3, 42, 5, 6)])
    assert state.generated_ids == [1, 2, 3] and len(state.chosen_ids) == len(state.top2_gaps) == 3
    assert "masked" in state.finish_detail and state.finish_reason.value == "stop"


def test_forced_tokens_are_refused_with_parallel_sampling(tiny):
    engine = make_engine(tiny["tiny-llama"].model, num_slots=2, max_len=64)
    with pytest.raises(ValueError, match="forced"):
        engine.submit("x", [1, 2], SamplingParams(n=2, temperature=1.0), forced=(1,))


# -- checks built by hand: a numeric flip, then damage -------------------------------------------------------

def greedy_continuation(loaded, prefix: list[int], n: int) -> list[int]:
    [state] = run(loaded, [tuple(prefix)], SamplingParams(max_new_tokens=n, ignore_eos=True), slots=1)
    return state.generated_ids


def flipped_output(loaded, damage_at: int | None):
    """(solo tokens, an output that flips token 1 to another token and goes on as the clean model does from
    there, where token `damage_at` is replaced by another one when given and it goes on from that too)."""
    solo = greedy_continuation(loaded, list(PROMPT), 8)
    output = [solo[0], another(solo[1])]
    output += greedy_continuation(loaded, list(PROMPT) + output, 6)
    if damage_at is not None:
        output = output[:damage_at] + [another(output[damage_at])]
        output += greedy_continuation(loaded, list(PROMPT) + output, 8 - len(output))
    return solo, tuple(output)


def another(token: int) -> int:
    return token - 1 if token > 0 else token + 1


def check(output, gaps):
    return PendingCheck("victim", PROMPT, output, tuple(gaps), GREEDY, steps=tuple(range(len(output))),
                        cobatched=(("other",),) * len(output))


def test_damage_that_begins_after_a_numeric_flip_is_counted(tiny):
    """Token 1 is a near tie (the batched run's top-2 gap there is 0: numeric); token 5 is another token with a
    wide gap. Before, the check ended at token 1 with a numeric label; now token 5 is counted."""
    loaded = tiny["tiny-llama"]
    solo, output = flipped_output(loaded, damage_at=5)
    assert _first_difference(list(output), solo) == 1
    gaps = [1.0] * 8
    gaps[1] = 0.0
    ref = ReferenceDetector(loaded, loaded.tokenizer)
    ref.on_finish(check(output, gaps))
    [report] = ref.drain(0.0)
    ev = report.evidence
    assert report.kind == "cross_request" and report.counts and report.source == "other"
    assert (ev.token_index, ev.first_divergence, ev.numeric_flips) == (5, 1, 1)
    assert ev.batched_token == output[5] and another(ev.solo_token) == output[5]
    assert "after 1 numeric flips from token 1" in evidence_text(report)


def test_a_request_with_only_numeric_flips_gives_no_counted_report(tiny):
    """The same flip at token 1 and a second near tie at token 5 (gap 0 there too): one numeric report for the
    request, naming both flips, nothing counted."""
    loaded = tiny["tiny-llama"]
    _, output = flipped_output(loaded, damage_at=5)
    gaps = [1.0] * 8
    gaps[1] = gaps[5] = 0.0
    ref = ReferenceDetector(loaded, loaded.tokenizer)
    ref.on_finish(check(output, gaps))
    [report] = ref.drain(0.0)
    assert report.kind == "numeric" and not report.counts
    assert (report.evidence.token_index, report.evidence.first_divergence, report.evidence.numeric_flips) == (1, 1, 2)


def test_the_forced_reference_is_cached_per_output(tiny):
    """The free and the forced reference both come from the cache the second time; only the replay that
    attributes the divergence runs again."""
    loaded = tiny["tiny-llama"]
    _, output = flipped_output(loaded, damage_at=5)
    gaps = [1.0] * 8
    gaps[1] = 0.0
    ref = ReferenceDetector(loaded, loaded.tokenizer)
    runs = []
    original = ref._run
    ref._run = lambda items, faults, should_stop=None: runs.append(items) or original(items, faults, should_stop)
    for _ in range(2):
        ref.on_finish(check(output, gaps))
        [report] = ref.drain(0.0)
        assert report.evidence.token_index == 5
    assert [k[-1] for k in ref._cache if k[-1] is not None] == [output]
    assert len(runs) == 4 and runs[1][0][2] == runs[2][0][2] == runs[3][0][2] == output  # free, forced, replay x 2


# -- whole runs on tiny-llama: every first divergence made to look numeric ----------------------------------

def scenario(fault: str, layout: str = "padded"):
    return parse_scenario(f"""
name: forced
seed: 3
max_requests: 6
model: tiny-llama
engine: {{slots: 3, max_len: 128, layout: {layout}, faults: [{fault}]}}
arrivals: {{process: constant, rate_per_s: 50.0}}
prompts: {{kind: synthetic, prompt_tokens: {{dist: uniform, min: 3, max: 30}}}}
output_tokens: 10
sampling: {{temperature: 0.0, ignore_eos: true}}
""")


@pytest.fixture
def first_flips_numeric(monkeypatch):
    """Each check's first divergence judged numeric, whatever its gap (a fault's first divergence made to look
    like a near tie): only the teacher-forced continuation can count it."""
    judge = ReferenceDetector._judge

    def numeric_first(self, check, index, reference):
        verdict = judge(self, check, index, reference)
        first = _first_difference(list(check.output_ids), reference[0])
        return verdict._replace(numeric=True) if index == first else verdict

    monkeypatch.setattr(ReferenceDetector, "_judge", numeric_first)


def reports(loaded, spec):
    session = Session(spec, loaded, clock="virtual", detectors=("reference",))
    session.run()
    return session.contamination


@pytest.mark.parametrize("fault,kind", [("causal_offset", "corruption"), ("shared_position_offset", "cross_request")])
def test_a_fault_whose_first_divergence_looks_numeric_is_still_caught(tiny, first_flips_numeric, fault, kind):
    events = reports(tiny["tiny-llama"], scenario(fault))
    counted = [e for e in events if e.counts]
    assert counted, [(e.kind, evidence_text(e)) for e in events]
    for e in counted:
        ev = e.evidence
        assert e.kind == kind and ev.numeric_flips >= 1 and ev.first_divergence < ev.token_index


def test_a_clean_run_gives_nothing_to_continue(tiny, first_flips_numeric):
    assert reports(tiny["tiny-llama"], scenario("")) == []


def test_a_token_its_grammar_forced_is_no_nonfinite_logit(tiny):
    """A structured-output row whose grammar allows one token records a top-2 gap of +inf (the runner-up
    is masked): that is no non-finite logit, so a later near tie still counts as numeric. A NaN gap (the
    forward's logits were not finite) still makes every later divergence real. Seen in bfloat16 sweeps
    with a regex: 'DORACM-157' vs 'DORACM-13' was counted cross_request because the '-' was forced."""
    from kvtui.detect.tolerance import Tolerance

    detector = ReferenceDetector(tiny["tiny-llama"], None, tolerance=Tolerance(0.5, "built-in"))
    greedy = SamplingParams(max_new_tokens=2)
    forced_then_tie = PendingCheck("r", (1, 2), (5, 7), (float("inf"), 0.2), greedy)
    assert detector._judge(forced_then_tie, 1, ([5, 8], [float("inf"), 0.25], [])).numeric
    broken = PendingCheck("r", (1, 2), (5, 7), (float("nan"), 0.2), greedy)
    assert not detector._judge(broken, 1, ([5, 8], [float("inf"), 0.25], [])).numeric
