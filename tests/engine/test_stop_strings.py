"""Stop strings as vLLM checks them, under min_tokens, with include_stop_str_in_output, n > 1 and
streaming. The oracle is not kvtui's code: the tokens come from greedy decoding on a separate tiny-llama
instance (a full forward per token, no kvtui code path), and where a request stops and what text it
returns come from `vllm_stop` below, a line-by-line transcription of vLLM's V1 rule
(vllm/v1/engine/detokenizer.py: BaseIncrementalDetokenizer.update and check_stop_strings). tiny-llama's
tokens are single bytes, so its texts hold split and invalid UTF-8 characters."""

from __future__ import annotations

import openai
import pytest
from helpers import make_engine, oracle_model, uncached_greedy

from kvtui.engine import SamplingParams
from kvtui.serve.detok import TextStream
from kvtui.serve.server import ServeOptions, ServeServer

MIN_TOKENS, MAX_TOKENS = 12, 30
PROMPTS = ["Once upon a time", "The quick brown fox", "abc", "Hello there", "kvtui", "A long story"]


def held(text: str) -> str:
    """What vLLM's incremental detokenizer has emitted: a trailing U+FFFD (bytes of a character not yet
    complete) is held back until a later token completes it."""
    return text.rstrip("\ufffd")


def vllm_stop(tokenizer, ids: list[int], stop: list[str], min_tokens: int, include: bool) -> tuple[int, str, str]:
    """(tokens the request keeps, its returned text, finish reason) for greedy tokens `ids` under vLLM's rule.

    Per token: the output text grows by what the token decodes to; while the output holds at most
    min_tokens tokens the stop-check offset follows the text's end (nothing is checked); past that,
    check_stop_strings searches each stop string (in list order) from `1 - new_char_count - len(stop)`
    (a negative index: the newly decoded characters plus len(stop) - 1 before them) and truncates the
    text before it, or after it with include_stop_str_in_output."""
    output_text = ""
    for k in range(1, len(ids) + 1):
        stop_check_offset = len(output_text)
        output_text = held(tokenizer.decode(ids[:k], skip_special_tokens=True))
        if min_tokens and k <= min_tokens:
            stop_check_offset = len(output_text)
        if not (stop and k > min_tokens):
            continue
        new_char_count = len(output_text) - stop_check_offset
        if not new_char_count:
            continue
        for stop_str in stop:
            stop_index = output_text.find(stop_str, 1 - new_char_count - len(stop_str))
            if stop_index == -1:
                continue
            if include:
                stop_index += len(stop_str)
                if stop_index >= len(output_text):
                    return k, output_text, "stop"
            return k, output_text[:stop_index], "stop"
    return len(ids), tokenizer.decode(ids, skip_special_tokens=True), "length"


@pytest.fixture(scope="module")
def greedy(tiny):
    """Each prompt's MAX_TOKENS greedy tokens from a separate tiny-llama instance: {prompt: (prompt ids,
    output ids, text after each token)}."""
    tok, model = tiny["tiny-llama"].tokenizer, oracle_model("tiny-llama", "eager")
    out = {}
    for prompt in PROMPTS:
        ids = uncached_greedy(model, tok.encode(prompt), MAX_TOKENS)
        out[prompt] = tok.encode(prompt), ids, [tok.decode(ids[:k], skip_special_tokens=True) for k in range(1, 31)]
    return out


def whole_chars(text: str) -> list[str]:
    return [c for c in dict.fromkeys(text) if c != "\ufffd" and c.isprintable() and c.strip()]


def cases(greedy) -> dict[str, tuple[str, str]]:
    """Stop strings for the three ways min_tokens matters, each as (prompt, stop string):
    - "again": a character of the first 3 tokens' text that occurs again past token MIN_TOKENS;
    - "early only": a character of the first 3 tokens' text that never occurs again;
    - "straddles": the last character of the first MIN_TOKENS tokens' text and the first one the next
      token adds (found by the overlap window)."""
    found = {}
    for prompt, (_, _, texts) in greedy.items():
        early, rest = held(texts[2]), held(texts[-1])[len(held(texts[MIN_TOKENS - 1])):]
        for c in whole_chars(early):
            found.setdefault("again" if c in rest else "early only", (prompt, c))
        before, after = held(texts[MIN_TOKENS - 1]), held(texts[MIN_TOKENS])
        pair = before[-1:] + after[len(before):len(before) + 1]
        if len(pair) == 2 and "\ufffd" not in pair:
            found.setdefault("straddles", (prompt, pair))
    assert set(found) == {"again", "early only", "straddles"}, found
    return found


def expected(tok, greedy, prompt: str, stop: str, include: bool, min_tokens: int = MIN_TOKENS):
    return vllm_stop(tok, greedy[prompt][1], [stop], min_tokens, include)


def test_the_cases_are_the_ones_min_tokens_changes(tiny, greedy):
    """The oracle's answers: a stop string in the first min_tokens tokens' text neither ends the request nor
    cuts its text (without min_tokens it would, at its first occurrence); one that straddles the
    boundary ends it at token MIN_TOKENS + 1, cut one character into that text."""
    tok = tiny["tiny-llama"].tokenizer
    found = cases(greedy)
    for name in ("again", "early only"):
        prompt, stop = found[name]
        texts = greedy[prompt][2]
        assert stop in texts[2] and expected(tok, greedy, prompt, stop, False, min_tokens=0)[0] <= 3, name
        kept, text, reason = expected(tok, greedy, prompt, stop, include=False)
        assert kept > MIN_TOKENS and text.startswith(held(texts[MIN_TOKENS - 1])), name
    assert expected(tok, greedy, *found["early only"], include=False)[0::2] == (MAX_TOKENS, "length")
    assert expected(tok, greedy, *found["again"], include=False)[2] == "stop"
    prompt, pair = found["straddles"]
    assert expected(tok, greedy, prompt, pair, include=False)[:2] == \
        (MIN_TOKENS + 1, held(greedy[prompt][2][MIN_TOKENS - 1])[:-1])


def engine_run(loaded, prompt_ids, params: SamplingParams):
    engine = make_engine(loaded.model, num_slots=4, max_len=128, max_batch_size=4, tokenizer=loaded.tokenizer)
    state = engine.submit("r", prompt_ids, params)
    engine.run_until_done()
    return engine, state


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("case", ["again", "early only", "straddles"])
def test_engine_stops_where_vllm_does_under_min_tokens(tiny, greedy, case, include):
    loaded = tiny["tiny-llama"]
    prompt, stop = cases(greedy)[case]
    prompt_ids, ids, _ = greedy[prompt]
    kept, text, reason = expected(loaded.tokenizer, greedy, prompt, stop, include)
    _, state = engine_run(loaded, prompt_ids, SamplingParams(max_new_tokens=MAX_TOKENS, min_tokens=MIN_TOKENS,
                                                             stop=(stop,), include_stop_str_in_output=include))
    returned = loaded.tokenizer.decode(state.generated_ids, skip_special_tokens=True)[:state.text_end]
    assert (state.generated_ids, returned, state.finish_reason.value) == (ids[:kept], text, reason)


def test_the_first_stop_string_in_the_list_wins_within_one_check(tiny, greedy):
    """Two stop strings completed by the same token: vLLM takes the first in the request's list, not the
    earlier in the text."""
    loaded = tiny["tiny-llama"]
    prompt, pair = cases(greedy)["straddles"]
    prompt_ids, ids, _ = greedy[prompt]
    stops = [pair[1], pair]  # both complete at token MIN_TOKENS + 1; the pair starts a character earlier
    for order in (stops, stops[::-1]):
        kept, text, _ = vllm_stop(loaded.tokenizer, ids, order, MIN_TOKENS, False)
        _, state = engine_run(loaded, prompt_ids, SamplingParams(max_new_tokens=MAX_TOKENS, min_tokens=MIN_TOKENS,
                                                                 stop=tuple(order)))
        assert (len(state.generated_ids), state.stop_str) == (kept, order[0])
        assert loaded.tokenizer.decode(state.generated_ids, skip_special_tokens=True)[:state.text_end] == text
    assert vllm_stop(loaded.tokenizer, ids, stops, MIN_TOKENS, False)[1] != \
        vllm_stop(loaded.tokenizer, ids, stops[::-1], MIN_TOKENS, False)[1]


def test_parallel_sampled_sequences_each_stop_by_the_rule(tiny):
    """n = 4 sampled sequences with stop strings and min_tokens: each sequence's own tokens, put through
    vLLM's rule, stop exactly where the engine stopped it, with the same text; and in some sequence a stop
    string occurs in the first min_tokens tokens' text (so the rule was tested where it matters)."""
    loaded = tiny["tiny-llama"]
    tok = loaded.tokenizer
    stops = tuple("aeiouAEIOU()[]{}<>;:,.!?-_=+*&^%$#@~`'\"/\\|0123456789")
    params = SamplingParams(max_new_tokens=MAX_TOKENS, min_tokens=MIN_TOKENS, stop=stops, n=4, temperature=1.0,
                            seed=5)
    engine = make_engine(loaded.model, num_slots=4, max_len=128, max_batch_size=4, tokenizer=tok)
    engine.submit("r", tok.encode("Once upon a time"), params)
    states = [engine.requests[i] for i in engine.sequence_ids("r")]
    engine.run_until_done()
    early = 0
    for state in states:
        ids = state.generated_ids
        kept, text, reason = vllm_stop(tok, ids, list(stops), MIN_TOKENS, False)
        returned = tok.decode(ids, skip_special_tokens=True)[:state.text_end]
        assert (kept, text, reason) == (len(ids), returned, state.finish_reason.value)
        early += any(s in tok.decode(ids[:MIN_TOKENS], skip_special_tokens=True) for s in stops)
    assert len({tuple(s.generated_ids) for s in states}) == 4 and early >= 1


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("case", ["again", "early only", "straddles"])
def test_streamed_text_follows_the_same_rule_token_by_token(tiny, greedy, case, include):
    """TextStream (the server's incremental text) fed the oracle's tokens: the text it sends before the
    request ends already holds the first min_tokens tokens' text (less the characters it holds for a
    stop string still to come), and the whole stream is the returned text."""
    tok = tiny["tiny-llama"].tokenizer
    prompt, stop = cases(greedy)[case]
    _, ids, texts = greedy[prompt]
    kept, text, _ = expected(tok, greedy, prompt, stop, include)
    stream = TextStream(tok, (stop,), include, MIN_TOKENS)
    sent = "".join(stream.add(t) for t in ids[:kept])
    hold = 0 if include else len(stop) - 1
    assert text.startswith(sent) and len(sent) >= len(held(texts[MIN_TOKENS - 1])) - hold
    assert sent + stream.finish(text) == text


# -- the server, through the openai client --------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    options = ServeOptions(model="tiny-llama", port=0, slots=4, max_len=512, detectors=("canary",))
    with ServeServer(options) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.mark.parametrize("include", [False, True])
def test_served_answers_streamed_or_whole_and_n_choices_follow_the_rule(tiny, greedy, server, include):
    tok = tiny["tiny-llama"].tokenizer
    for case, (prompt, stop) in cases(greedy).items():
        kept, text, reason = expected(tok, greedy, prompt, stop, include)
        extra = {"ignore_eos": True, "min_tokens": MIN_TOKENS, "include_stop_str_in_output": include}
        args = dict(model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stop=[stop], n=2,
                    extra_body=extra)
        whole = server.completions.create(**args)
        assert [(c.text, c.finish_reason) for c in whole.choices] == [(text, reason)] * 2, case
        assert whole.usage.completion_tokens == 2 * kept, case
        chunks = [c for chunk in server.completions.create(**args, stream=True) for c in chunk.choices]
        for index in (0, 1):
            mine = [c for c in chunks if c.index == index]
            before_end = "".join(c.text for c in mine if c.finish_reason is None)
            assert "".join(c.text for c in mine) == text and mine[-1].finish_reason == reason, case
            hold = 0 if include else len(stop) - 1
            assert len(before_end) >= len(held(greedy[prompt][2][MIN_TOKENS - 1])) - hold, case
