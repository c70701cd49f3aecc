"""Structured output on tiny-llama: constrained requests (JSON schema, JSON object, regex, choice,
EBNF) batched with plain ones equal transformers' own generate with xgrammar's Hugging Face logits
processor on a separate model instance (greedy), and their solo runs (sampled) whose every token a
fresh xgrammar matcher accepts; the stale_bitmask fault restricts plain requests to another's grammar."""

import json
import random

import pytest
import torch
from helpers import make_engine, oracle_model, solo

from kvtui.config import EngineConfig
from kvtui.engine import SamplingParams
from kvtui.engine.parallel import child_sampling
from kvtui.engine.request import StructuredOutputs

xgr = pytest.importorskip("xgrammar", reason="pip install xgrammar==0.2.8 apache-tvm-ffi (see docs/serve.md)")
from xgrammar.contrib.hf import LogitsProcessor  # noqa: E402

SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
                     "required": ["n", "ok"]})
SPECS = {
    "regex": StructuredOutputs(regex=r"(cat|dog|bird)-[0-9]{2,4}"),
    "choice": StructuredOutputs(choice=("red", "green", "blue sky")),
    "json": StructuredOutputs(json=SCHEMA),
    "json_object": StructuredOutputs(json_object=True),
    "grammar": StructuredOutputs(grammar='root ::= "(" [a-c]+ ")"'),
}
MAX_LEN = 128


def prompts(count, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randint(3, 20))] for _ in range(count)]


def engine(loaded, kv="slots", layout="padded", **kw):
    pool = dict(kv="paged", block_size=4, num_blocks=kw.pop("num_blocks", 80)) if kv == "paged" else dict(num_slots=8)
    return make_engine(loaded.model, EngineConfig(max_len=MAX_LEN, layout=layout, **pool, **kw),
                       eos_token_ids=loaded.eos_token_ids, tokenizer=loaded.tokenizer, clock="virtual")


def run(eng, submissions, reports=None):
    """(step, id, prompt, params) -> {id: finished report}; each step's report appended to `reports`."""
    pending, finished, steps = sorted(submissions, key=lambda s: s[0]), {}, 0
    while pending or eng.has_unfinished():
        while pending and pending[0][0] <= steps:
            _, request_id, prompt, params = pending.pop(0)
            eng.submit(request_id, prompt, params)
        report = eng.step()
        if reports is not None:
            reports.append(report)
        finished.update({f.request_id: f for f in report.finished})
        steps += 1
        assert steps < 2000
    return finished


def compiled(loaded, spec):
    info = xgr.TokenizerInfo.from_huggingface(loaded.tokenizer, vocab_size=loaded.model.get_input_embeddings().num_embeddings)
    compiler = xgr.GrammarCompiler(info)
    if spec.kind == "choice":
        from kvtui.engine.grammar import choice_grammar

        return compiler.compile_grammar(choice_grammar(spec.choice))
    return {"regex": lambda: compiler.compile_regex(spec.regex), "json": lambda: compiler.compile_json_schema(spec.json),
            "json_object": lambda: compiler.compile_json_schema('{"type": "object"}'),  # OpenAI: an object
            "grammar": lambda: compiler.compile_grammar(spec.grammar)}[spec.kind]()


@torch.inference_mode()
def hf_generate(model, prompt, n, eos, grammar=None):
    """transformers' generate, greedy, on a separate instance; with xgrammar's own HF logits processor."""
    processors = [LogitsProcessor(grammar)] if grammar is not None else []
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, logits_processor=processors,
                         eos_token_id=list(eos), pad_token_id=0)
    return out[0, len(prompt):].tolist()


def accepted_by_fresh_matcher(loaded, spec, tokens) -> tuple[bool, bool]:
    """(every token accepted, terminated at the end) by a new xgrammar matcher: the library's own check."""
    matcher = xgr.GrammarMatcher(compiled(loaded, spec))
    ok = all(matcher.accept_token(t) for t in tokens)
    return ok, matcher.is_terminated()


@pytest.mark.parametrize("kv,layout", [("slots", "padded"), ("slots", "packed"), ("paged", "padded"),
                                       ("paged", "packed")])
def test_greedy_constrained_requests_equal_transformers_generate_with_xgrammar(tiny, kv, layout):
    loaded = tiny["tiny-llama"]
    oracle = oracle_model("tiny-llama", "eager")
    ps = prompts(len(SPECS) + 2)
    subs = [(i % 3, kind, ps[i], SamplingParams(max_new_tokens=40, structured=spec))
            for i, (kind, spec) in enumerate(SPECS.items())]
    subs += [(1, "plain-a", ps[-2], SamplingParams(max_new_tokens=12)), (2, "plain-b", ps[-1], SamplingParams(max_new_tokens=12))]
    finished = run(engine(loaded, kv, layout), subs)
    eos = loaded.eos_token_ids
    for _, name, prompt, params in subs:
        grammar = compiled(loaded, params.structured) if params.structured else None
        ours = list(finished[name].output_ids)
        assert ours == hf_generate(oracle, prompt, params.max_new_tokens, eos, grammar), name
        if params.structured is not None:
            ok, done = accepted_by_fresh_matcher(loaded, params.structured, ours)
            assert ok and done == (finished[name].finish_reason == "stop"), name
    assert finished["choice"].finish_reason == "stop"
    text = loaded.tokenizer.decode(finished["choice"].output_ids, skip_special_tokens=True)
    assert text in ("red", "green", "blue sky")


def test_sampled_constrained_requests_equal_their_solo_runs_and_stay_in_their_grammar(tiny):
    loaded = tiny["tiny-llama"]
    ps = prompts(6, seed=4)
    specs = [None, SPECS["json"], StructuredOutputs(regex="[a-z]{10,40}"), None, SPECS["grammar"], SPECS["json_object"]]
    subs = [(i % 2, f"s{i}", ps[i], SamplingParams(temperature=1.0, seed=100 + i, max_new_tokens=40,
                                                   ignore_eos=specs[i] is None, structured=specs[i]))
            for i in range(6)]
    tight = engine(loaded, "paged", num_blocks=33, max_batch_size=6, watermark=0.0)
    finished = run(tight, subs)
    assert tight.kv.num_preemptions > 0  # a constrained request resumes its grammar after a recompute
    solo_engine_outputs = {}
    for _, name, prompt, params in subs:
        alone = run(engine(loaded), [(0, "x", prompt, params)])["x"]
        solo_engine_outputs[name] = list(alone.output_ids)
        assert list(finished[name].output_ids) == solo_engine_outputs[name], name
        if params.structured is not None:
            ok, done = accepted_by_fresh_matcher(loaded, params.structured, list(finished[name].output_ids))
            assert ok and done == (finished[name].finish_reason == "stop"), name


def test_parallel_sampling_with_a_grammar_keeps_each_sequence_its_own(tiny):
    loaded = tiny["tiny-llama"]
    params = SamplingParams(temperature=1.0, seed=8, max_new_tokens=30, n=3, structured=SPECS["regex"])
    prompt = prompts(1, seed=9)[0]
    finished = run(engine(loaded, "paged"), [(0, "r", prompt, params)])
    for i in range(3):
        alone = run(engine(loaded), [(0, "x", prompt, child_sampling(params, i))])["x"]
        assert finished[f"{i}_r"].output_ids == alone.output_ids
        assert accepted_by_fresh_matcher(loaded, params.structured, list(alone.output_ids))[0]


def test_a_grammar_that_does_not_compile_rejects_that_request_alone(tiny):
    loaded = tiny["tiny-llama"]
    eng = engine(loaded)
    ps = prompts(2)
    finished = run(eng, [(0, "bad", ps[0], SamplingParams(structured=StructuredOutputs(regex="(unclosed"))),
                         (0, "good", ps[1], SamplingParams(max_new_tokens=5, ignore_eos=True))])
    assert (finished["bad"].finish_reason, finished["bad"].code) == ("rejected", "invalid_structured_output")
    assert "regex does not compile" in finished["bad"].detail
    assert list(finished["good"].output_ids) == solo(loaded, ps[1], SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert eng.output.grammar.matchers == {}
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", json_object=True)


def test_without_a_tokenizer_a_constrained_request_is_rejected_not_raised(tiny):
    loaded = tiny["tiny-llama"]
    eng = make_engine(loaded.model, num_slots=2, max_len=MAX_LEN)
    state = eng.submit("c", [5, 6, 7], SamplingParams(structured=SPECS["regex"]))
    assert state.finish_code == "invalid_structured_output" and "tokenizer" in state.finish_detail


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_stale_bitmask_restricts_a_plain_request_to_the_previous_rows_grammar(tiny, layout):
    """A digits-only request leaves bitmask row 1; the plain request that later samples in that row,
    beside a constrained one, gets digits only: victim and source named by the rows' owners."""
    loaded = tiny["tiny-llama"]
    digits = StructuredOutputs(regex="[0-9]{1,60}")
    letters = StructuredOutputs(regex="[a-z]{1,60}")
    ps = prompts(3, seed=2)
    subs = [(0, "letters", ps[0], SamplingParams(max_new_tokens=40, structured=letters)),
            (0, "digits", ps[1], SamplingParams(max_new_tokens=3, structured=digits)),
            (5, "plain", ps[2], SamplingParams(max_new_tokens=10, ignore_eos=True))]
    clean = run(engine(loaded, layout=layout), subs)
    eng, reports = engine(loaded, layout=layout, faults=frozenset({"stale_bitmask"})), []
    faulty = run(eng, subs, reports)
    stale = {(victim, source) for r in reports for victim, source, _ in r.stale_masks}
    assert stale == {("plain", "digits")}  # the step names victim and source
    assert list(clean["plain"].output_ids) == solo(loaded, ps[2], subs[2][3])
    text = loaded.tokenizer.decode(faulty["plain"].output_ids, skip_special_tokens=True)
    assert faulty["plain"].output_ids != clean["plain"].output_ids and text.isdigit(), text
    assert faulty["letters"].output_ids == clean["letters"].output_ids  # constrained rows are filled afresh


@pytest.mark.smollm
def test_smollm2_json_schema_answer_equals_transformers_generate_with_xgrammar(smollm2):
    from kvtui.scenario.prompts import chat_ids, user_chat

    schema = json.dumps({"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}},
                         "required": ["colour"], "additionalProperties": False})
    spec = StructuredOutputs(json=schema)
    ids = chat_ids(smollm2.tokenizer, user_chat("Name a colour, as JSON."))
    plain = chat_ids(smollm2.tokenizer, user_chat("Say hello."))
    finished = run(engine(smollm2), [(0, "json", ids, SamplingParams(max_new_tokens=40, structured=spec)),
                                     (0, "plain", plain, SamplingParams(max_new_tokens=8))])
    oracle = oracle_model("default", "eager")
    assert list(finished["json"].output_ids) == hf_generate(oracle, ids, 40, smollm2.eos_token_ids,
                                                            compiled(smollm2, spec))
    assert finished["json"].finish_reason == "stop"
    answer = json.loads(smollm2.tokenizer.decode(finished["json"].output_ids, skip_special_tokens=True))
    assert set(answer) == {"colour"} and isinstance(answer["colour"], str)
    assert list(finished["plain"].output_ids) == hf_generate(oracle, plain, 8, smollm2.eos_token_ids)


def test_a_constrained_rows_top2_gap_is_taken_among_the_tokens_its_grammar_allows(tiny):
    """The near-tie rule reads the gap the row chose from: with one allowed token (a one-word choice)
    the gap is infinite, with a regex of two digits it is the gap between the two best digits, not the
    model's gap over the whole vocabulary (which the reference detector would misread in bf16)."""
    loaded = tiny["tiny-llama"]
    eng = engine(loaded)
    ps = prompts(2, seed=5)
    finished = run(eng, [(0, "one", ps[0], SamplingParams(max_new_tokens=8, structured=StructuredOutputs(choice=("zq",)))),
                         (0, "digits", ps[1], SamplingParams(max_new_tokens=1, structured=StructuredOutputs(regex="[0-9]")))])
    forced = [g for g in finished["one"].top2_gaps]
    assert forced and all(g == float("inf") for g in forced), forced
    with torch.inference_mode():
        logits = oracle_model("tiny-llama", "eager")(input_ids=torch.tensor([ps[1]])).logits[0, -1]
    digits = sorted((logits[loaded.tokenizer.convert_tokens_to_ids(str(d))].item() for d in range(10)), reverse=True)
    assert finished["digits"].top2_gaps[0] == pytest.approx(digits[0] - digits[1], abs=1e-4)
    assert finished["digits"].top2_gaps[0] != pytest.approx((logits.topk(2).values[0] - logits.topk(2).values[1]).item())


def test_validate_and_run_refuse_a_scenario_constraint_that_does_not_compile(tmp_path):
    """Every constrained request would be rejected and the run would still exit 0: refused up front,
    one line naming the file and field, exit 2 (it used to pass validate and reject 10 requests)."""
    from typer.testing import CliRunner

    from kvtui.cli import app

    scenario = tmp_path / "bad.yaml"
    scenario.write_text('max_requests: 4\nmodel: tiny-llama\nprompts: {kind: synthetic}\n'
                        'sampling: {structured: {fraction: 0.5, regex: "[0-9"}}\n')
    for args in (["validate", str(scenario)], ["run", str(scenario), "--headless", "-q"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, result.output
        assert result.stderr.splitlines() == [
            f"error: {scenario}: sampling.structured: regex does not compile: Regex parsing error at position 5: "
            "Unclosed '['; fix the constraint or remove it"]
