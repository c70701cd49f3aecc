"""Penalties, logit_bias, min_tokens and bad_words, per request, against oracles kvtui did not write:
transformers' own logits processors in a solo `generate` on a separate model instance (greedy), the
OpenAI docs' formula for presence / frequency penalties (no HF processor exists), and, for seeded
sampled requests, the same request run alone. Batched runs mix requests with and without the
parameters, with fewer slots than requests, so rows leave and join the batch while others decode."""

import random
from collections import Counter

import pytest
import torch
from helpers import assert_matches_oracle, make_engine, oracle_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from kvtui.engine import SamplingParams
from kvtui.engine.row_state import History, Penalties, RowState


class OutputOnly:
    """Run a transformers processor on the generated tokens alone: vLLM matches bad words against the
    output, transformers against prompt + output (they differ only where a prompt ends a word's prefix)."""

    def __init__(self, processor, prompt_len: int) -> None:
        self.processor, self.prompt_len = processor, prompt_len

    def __call__(self, input_ids, scores):
        return self.processor(input_ids[:, self.prompt_len:], scores)


def hf_processors(params: SamplingParams, prompt_len: int, eos: int | None) -> LogitsProcessorList:
    """transformers' processors for `params`, in the order vLLM's V1 sampler applies them: bad words,
    min_tokens, logit bias, repetition penalty."""
    out = []
    if params.bad_words_ids:
        out.append(OutputOnly(NoBadWordsLogitsProcessor([list(s) for s in params.bad_words_ids], eos_token_id=None),
                              prompt_len))
    if params.min_tokens and eos is not None and not params.ignore_eos:
        out.append(MinNewTokensLengthLogitsProcessor(prompt_len, params.min_tokens, eos))
    if params.logit_bias:
        out.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in params.logit_bias]))
    if params.repetition_penalty != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    return LogitsProcessorList(out)


@torch.inference_mode()
def hf_generate(model, prompt: list[int], params: SamplingParams, eos: int | None) -> tuple[list[int], list[float]]:
    """Greedy tokens of transformers' `generate` with its own processors, and the top-2 gap of the
    processed scores at each token (for near ties)."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=params.max_new_tokens, min_new_tokens=None, do_sample=False,
                         logits_processor=hf_processors(params, len(prompt), eos),
                         eos_token_id=None if params.ignore_eos else eos, pad_token_id=0,
                         return_dict_in_generate=True, output_scores=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    gaps = [float(torch.topk(s[0].float(), 2).values.diff().abs()) for s in out.scores]
    return tokens, gaps


def run_engine(loaded, prompts, params, *, eos=(), slots=3, layout="padded", stagger=2, faults=()):
    """All requests through one engine: request i arrives at step i * stagger // 2 (several at once
    early), fewer slots than requests. Returns the RequestStates."""
    engine = make_engine(loaded.model, num_slots=slots, max_len=96, max_batch_size=slots, layout=layout,
                         faults=frozenset(faults), eos_token_ids=eos)
    states, step, order = {}, 0, list(range(len(prompts)))
    while order or engine.has_unfinished():
        while order and order[0] * stagger // 2 <= step:
            i = order.pop(0)
            states[i] = engine.submit(f"r{i}", prompts[i], params[i])
        engine.step()
        step += 1
        assert step < 2000
    return [states[i] for i in range(len(prompts))]


def solo_engine(loaded, prompt, params, eos=()):
    return run_engine(loaded, [prompt], [params], eos=eos, slots=1)[0].generated_ids


PROMPTS = [[random.Random(i).randrange(3, 250) for _ in range(random.Random(100 + i).randrange(4, 30))]
           for i in range(8)]


def mixed_params(eos: int) -> list[SamplingParams]:
    """One request per kind, and plain ones between them."""
    n = 14
    return [
        SamplingParams(max_new_tokens=n, repetition_penalty=1.8),
        SamplingParams(max_new_tokens=n),
        SamplingParams(max_new_tokens=n, repetition_penalty=0.6, ignore_eos=True),
        SamplingParams(max_new_tokens=n, logit_bias=((eos, -100.0), (17, 4.0), (90, 2.5))),
        SamplingParams(max_new_tokens=n, min_tokens=9),
        SamplingParams(max_new_tokens=n, bad_words_ids=((eos,), (139, 14), (165,))),
        SamplingParams(max_new_tokens=n, ignore_eos=True),
        SamplingParams(max_new_tokens=n, repetition_penalty=1.3, logit_bias=((33, 3.0),), min_tokens=4,
                       bad_words_ids=((200,),)),
    ]


def pick_eos(model) -> int:
    """An EOS the plain requests hit early: the most common token in the first greedy tokens of the prompts,
    so min_tokens, a -100 bias and a ban on it change answers."""
    firsts = Counter()
    for prompt in PROMPTS:
        firsts.update(hf_generate(model, prompt, SamplingParams(max_new_tokens=6, ignore_eos=True), None)[0])
    return firsts.most_common(1)[0][0]


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_batched_engine_equals_transformers_processors_token_for_token(tiny, layout):
    loaded = tiny["tiny-llama"]
    oracle = oracle_model("tiny-llama", "eager")
    eos = pick_eos(oracle)
    params = mixed_params(eos)
    states = run_engine(loaded, PROMPTS, params, eos=(eos,), layout=layout)
    changed = 0
    for i, (prompt, p, state) in enumerate(zip(PROMPTS, params, states)):
        theirs, gaps = hf_generate(oracle, prompt, p, eos)
        assert_matches_oracle(state.generated_ids, theirs, gaps, f"r{i} {p}")
        plain, _ = hf_generate(oracle, prompt, SamplingParams(max_new_tokens=p.max_new_tokens,
                                                              ignore_eos=p.ignore_eos), eos)
        changed += p.processes_logits and plain != theirs
    assert changed == sum(p.processes_logits for p in params)  # every parameter changed its answer


def test_min_tokens_holds_back_eos_and_stop_strings_then_lets_them_stop(tiny):
    loaded = tiny["tiny-llama"]
    eos = pick_eos(oracle_model("tiny-llama", "eager"))
    plain = run_engine(loaded, PROMPTS, [SamplingParams(max_new_tokens=14)] * len(PROMPTS), eos=(eos,))
    early = [i for i, s in enumerate(plain) if len(s.generated_ids) < 6]
    assert early, "no plain request stopped early on the chosen EOS"
    held = run_engine(loaded, PROMPTS, [SamplingParams(max_new_tokens=14, min_tokens=6)] * len(PROMPTS), eos=(eos,))
    for i in early:
        assert eos not in held[i].generated_ids[:6] and len(held[i].generated_ids) >= 6


OPENAI_PENALTY_DOC = "https://platform.openai.com/docs/advanced-usage/frequency-and-presence-penalties"


def openai_penalized(logits: torch.Tensor, counts: Counter, frequency: float, presence: float) -> torch.Tensor:
    """The formula of the OpenAI docs (OPENAI_PENALTY_DOC), written out per token:
    mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence."""
    out = logits.clone()
    for j in range(len(out)):
        c = counts.get(j, 0)
        out[j] = out[j] - c * frequency - float(c > 0) * presence
    return out


@pytest.mark.parametrize("frequency,presence", [(0.5, 0.0), (0.0, 1.2), (2.0, -2.0), (-1.0, 0.7)])
def test_presence_and_frequency_penalties_follow_the_openai_formula(frequency, presence):
    logits = torch.tensor([3.0, -1.0, 0.0, 2.5, 7.0, -4.0])
    counts = Counter({0: 2, 3: 1, 5: 4})
    params = SamplingParams(frequency_penalty=frequency, presence_penalty=presence)
    row = RowState("r", params, None, frozenset({1, 4}), frozenset(), (Penalties(),))
    ours = row.process(logits, History(frozenset({1, 4}), counts))  # prompt tokens are not penalized
    assert torch.equal(ours, openai_penalized(logits, counts, frequency, presence))


@torch.inference_mode()
def openai_greedy(model, prompt, params: SamplingParams) -> list[int]:
    """Greedy tokens with the OpenAI formula applied to a full-sequence forward of a separate instance."""
    ids, counts = list(prompt), Counter()
    for _ in range(params.max_new_tokens):
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
        token = int(openai_penalized(logits, counts, params.frequency_penalty, params.presence_penalty).argmax())
        ids.append(token)
        counts[token] += 1
    return ids[len(prompt):]


def test_batched_presence_frequency_penalties_equal_the_openai_formula_per_request(tiny):
    loaded = tiny["tiny-llama"]
    oracle = oracle_model("tiny-llama", "sdpa")
    params = [SamplingParams(max_new_tokens=12, frequency_penalty=1.5) if i % 3 == 0 else
              SamplingParams(max_new_tokens=12, presence_penalty=2.0, frequency_penalty=0.3) if i % 3 == 1 else
              SamplingParams(max_new_tokens=12) for i in range(len(PROMPTS))]
    states = run_engine(loaded, PROMPTS, params)
    for i, (prompt, p, state) in enumerate(zip(PROMPTS, params, states)):
        assert state.generated_ids == openai_greedy(oracle, prompt, p), f"r{i}"
    penalized = [s.generated_ids for s, p in zip(states, params) if p.processes_logits]
    assert any(len(set(ids)) > len(set(solo_engine(loaded, PROMPTS[i], SamplingParams(max_new_tokens=12))))
               for i, ids in enumerate(penalized))


def test_seeded_sampled_requests_with_penalties_equal_their_solo_run_under_load(tiny):
    loaded = tiny["tiny-llama"]
    params = [SamplingParams(max_new_tokens=12, temperature=1.0, top_k=40, seed=100 + i,
                             repetition_penalty=1.5 if i % 2 else 1.0, presence_penalty=0.8 if i % 3 == 0 else 0.0,
                             logit_bias=((i + 20, 5.0),) if i % 4 == 1 else (), min_tokens=3 * (i % 2),
                             bad_words_ids=((i + 30,),) if i % 4 == 2 else ()) for i in range(len(PROMPTS))]
    states = run_engine(loaded, PROMPTS, params, eos=(2,), slots=3, layout="packed")
    for i, (prompt, p, state) in enumerate(zip(PROMPTS, params, states)):
        assert state.generated_ids == solo_engine(loaded, prompt, p, eos=(2,)), f"r{i}"


@pytest.mark.parametrize("bad", [dict(frequency_penalty=2.5), dict(presence_penalty=-2.01),
                                 dict(repetition_penalty=0.0), dict(repetition_penalty=float("nan")),
                                 dict(logit_bias=((3, 100.5),)), dict(min_tokens=40), dict(min_tokens=-1)])
def test_out_of_range_parameters_are_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(max_new_tokens=32, **bad)


def test_a_logit_bias_outside_the_vocabulary_rejects_that_request_alone(tiny):
    loaded = tiny["tiny-llama"]
    engine = make_engine(loaded.model, num_slots=2, max_len=64)
    bad = engine.submit("bad", [5, 6], SamplingParams(max_new_tokens=4, logit_bias=((10**6, 1.0),)))
    good = engine.submit("good", [5, 6], SamplingParams(max_new_tokens=4))
    engine.run_until_done()
    assert (bad.finish_reason.value, bad.finish_code) == ("rejected", "invalid_logit_bias")
    assert len(good.generated_ids) == 4


@pytest.mark.smollm
def test_smollm2_batched_penalties_and_bad_words_equal_transformers_generate(smollm2):
    from kvtui.engine.sampling import resolve_bad_words

    tok = smollm2.tokenizer
    prompts = [tok.encode(t) for t in ("The cat sat on the mat and the cat", "List three colours: red, green,",
                                       "Once upon a time there was a king who", "1, 2, 3, 4, 5,")]
    eos = sorted(smollm2.eos_token_ids)
    params = [SamplingParams(max_new_tokens=12, repetition_penalty=1.4),
              resolve_bad_words(SamplingParams(max_new_tokens=12, bad_words=("blue", "cat")), tok),
              SamplingParams(max_new_tokens=12, logit_bias=((tok.encode(" queen")[0], 6.0),), min_tokens=5),
              SamplingParams(max_new_tokens=12)]
    states = run_engine(smollm2, prompts, params, eos=tuple(smollm2.eos_token_ids), slots=2)
    oracle = oracle_model("default", "sdpa")
    for i, (prompt, p, state) in enumerate(zip(prompts, params, states)):
        theirs, gaps = hf_generate(oracle, prompt, p, eos)
        assert_matches_oracle(state.generated_ids, theirs, gaps, f"r{i}")
    assert params[1].bad_words_ids and all(s not in tok.decode(states[1].generated_ids) for s in ("blue", " cat"))


def test_a_request_id_used_again_gets_its_own_new_row_state(tiny):
    """The reference detector's engine names its requests reference-0, reference-1, ... on every check: a
    new request under a finished one's id must not inherit the finished one's bias and counts."""
    loaded = tiny["tiny-llama"]
    prompt = PROMPTS[0]
    plain = solo_engine(loaded, prompt, SamplingParams(max_new_tokens=6))
    engine = make_engine(loaded.model, num_slots=1, max_len=64)
    first = engine.submit("x", prompt, SamplingParams(max_new_tokens=6, logit_bias=tuple((t, -100.0) for t in plain)))
    engine.run_until_done()
    again = engine.submit("x", prompt, SamplingParams(max_new_tokens=6))
    engine.run_until_done()
    assert not set(first.generated_ids) & set(plain)
    assert again.generated_ids == plain


def test_a_bad_words_id_outside_the_vocabulary_rejects_that_request_alone(tiny):
    loaded = tiny["tiny-llama"]
    engine = make_engine(loaded.model, num_slots=2, max_len=64)
    bad = engine.submit("bad", [5, 6], SamplingParams(max_new_tokens=4, bad_words_ids=((7, 10**6),)))
    good = engine.submit("good", [5, 6], SamplingParams(max_new_tokens=4, bad_words_ids=((7,),)))
    engine.run_until_done()
    assert (bad.finish_reason.value, bad.finish_code) == ("rejected", "invalid_bad_words")
    assert "bad_words" in bad.finish_detail and len(good.generated_ids) == 4 and 7 not in good.generated_ids


@st.composite
def processor_workloads(draw):
    n = draw(st.integers(2, 7))
    prompts = [draw(st.lists(st.integers(3, 250), min_size=1, max_size=40)) for _ in range(n)]
    params = []
    for _ in range(n):
        fields = draw(st.fixed_dictionaries({}, optional={
            "repetition_penalty": st.sampled_from([0.5, 1.2, 2.5]),
            "logit_bias": st.lists(st.tuples(st.integers(0, 258), st.sampled_from([-100.0, -3.0, 2.0, 9.0])),
                                   max_size=30, unique_by=lambda x: x[0]).map(lambda b: tuple(sorted(b))),
            "bad_words_ids": st.lists(st.lists(st.integers(3, 258), min_size=1, max_size=2).map(tuple),
                                      max_size=6).map(tuple),
            "min_tokens": st.integers(0, 10)}))
        params.append(SamplingParams(max_new_tokens=10, **fields))
    config = dict(slots=draw(st.integers(1, 4)), layout=draw(st.sampled_from(["padded", "packed"])),
                  stagger=draw(st.integers(0, 4)), kv=draw(st.sampled_from(["slots", "paged"])),
                  budget=draw(st.sampled_from([8, 1024])))
    return prompts, params, config


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(processor_workloads())
def test_random_mixes_equal_transformers_processors_under_load(tiny, workload):
    """Random parameters per request, several engine layouts (chunked prefill, paged KV with a small
    pool): each request equals transformers' `generate` with its own processors, run solo."""
    prompts, params, c = workload
    loaded = tiny["tiny-llama"]
    oracle = oracle_model("tiny-llama", "eager")
    eos = pick_eos(oracle)
    engine = make_engine(loaded.model, num_slots=c["slots"], max_len=64, max_batch_size=4, layout=c["layout"],
                         max_tokens_per_step=c["budget"], kv=c["kv"], num_blocks=12 if c["kv"] == "paged" else None,
                         block_size=8, eos_token_ids=(eos,))
    states, step, order = {}, 0, list(range(len(prompts)))
    while order or engine.has_unfinished():
        while order and order[0] * c["stagger"] // 2 <= step:
            i = order.pop(0)
            states[i] = engine.submit(f"r{i}", prompts[i], params[i])
        engine.step()
        step += 1
        assert step < 3000
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        theirs, gaps = hf_generate(oracle, prompt, p, eos)
        assert_matches_oracle(states[i].generated_ids, theirs, gaps, f"r{i} {p} {c}")


def test_bad_words_match_the_output_alone_as_vllm_does(tiny):
    """A bad word whose prefix is the prompt's last token does not ban its last token at the first
    output token (vLLM matches against the output; transformers' own processor would, over the prompt)."""
    loaded = tiny["tiny-llama"]
    prompt = PROMPTS[1]
    plain = solo_engine(loaded, prompt, SamplingParams(max_new_tokens=4))
    across = solo_engine(loaded, prompt, SamplingParams(max_new_tokens=4, bad_words_ids=((prompt[-1], plain[0]),)))
    single = solo_engine(loaded, prompt, SamplingParams(max_new_tokens=4, bad_words_ids=((plain[0],),)))
    assert across[0] == plain[0] and single[0] != plain[0]
