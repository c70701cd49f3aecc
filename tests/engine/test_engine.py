"""Engine behaviour with real values: step reports, chunked prefill, slot reuse, rejection, stops."""

import pytest
import torch
from helpers import make_engine, oracle_model, solo, uncached_greedy

import kvtui.engine.output as engine_module  # the output side draws the tokens
from kvtui.config import EngineConfig
from kvtui.engine import SamplingParams, StepInterrupted


def make(loaded, **kw):
    return make_engine(loaded.model, EngineConfig(num_slots=2, max_len=64), tokenizer=loaded.tokenizer, **kw)


def test_first_step_report_counts(tiny):
    engine = make(tiny["tiny-llama"], layout="padded")
    engine.submit("a", [1, 2, 3], SamplingParams(max_new_tokens=4))
    engine.submit("b", [4, 5, 6, 7, 8], SamplingParams(max_new_tokens=4))
    r = engine.step()
    assert (r.step, r.rows, r.prefill_tokens, r.decode_tokens) == (0, 2, 8, 0)
    assert (r.query_positions, r.padded_positions) == (10, 2)
    assert r.padding_ratio == pytest.approx(0.2)
    # key side: a's 3 queries see 3 of 5 key columns (2 cache pads each)
    assert (r.key_positions, r.key_padded_positions) == (8 * 5, 3 * 2)
    assert (r.num_running, r.slots_used, r.num_slots, r.occupancy) == (2, 2, 2, 1.0)
    assert (r.kv_tokens, r.kv_capacity_tokens) == (8, 128)
    assert [(x.request_id, x.slot, x.cache_len, x.phase) for x in r.running] == [("a", 0, 3, "prefill"),
                                                                                 ("b", 1, 5, "prefill")]
    assert all(x.token_id is not None for x in r.running)
    r2 = engine.step()
    assert (r2.prefill_tokens, r2.decode_tokens, r2.padded_positions) == (0, 2, 0)
    assert [x.cache_len for x in r2.running] == [4, 6]


def test_chunked_prefill_within_token_budget(tiny):
    loaded = tiny["tiny-llama"]
    prompt = list(range(10, 60))  # 50 tokens, budget 16 per step -> 16, 16, 16, 2
    engine = make(loaded, max_tokens_per_step=16)
    long = engine.submit("long", prompt, SamplingParams(max_new_tokens=5))
    reports = engine.run_until_done()
    assert [r.prefill_tokens for r in reports[:4]] == [16, 16, 16, 2]
    assert [r.running[0].token_id is None for r in reports[:4]] == [True, True, True, False]
    assert long.generated_ids == solo(loaded, prompt, SamplingParams(max_new_tokens=5))


def test_finished_request_frees_slot_at_once_and_next_reuses_it(tiny):
    loaded = tiny["tiny-gpt2"]
    engine = make(loaded, num_slots=1)
    engine.submit("first", [1, 2, 3, 4, 5, 6], SamplingParams(max_new_tokens=2))
    second = engine.submit("second", [9, 8], SamplingParams(max_new_tokens=3))
    r0 = engine.step()
    assert r0.num_waiting == 1 and r0.slots_used == 1
    r1 = engine.step()
    assert [f.request_id for f in r1.finished] == ["first"] and r1.slots_used == 0
    r2 = engine.step()
    assert r2.running[0].request_id == "second" and r2.running[0].slot == 0 and r2.running[0].cache_len == 2
    engine.run_until_done()
    assert engine.pool.times_used == [2]
    assert second.generated_ids == solo(loaded, [9, 8], SamplingParams(max_new_tokens=3))
    assert engine.requests == {}  # finished requests are forgotten once reported


def test_too_long_request_rejected_or_capped_without_touching_others(tiny):
    loaded = tiny["tiny-llama"]
    for mode in ("reject", "cap"):
        engine = make(loaded, max_len=16, on_too_long=mode)
        ok = engine.submit("ok", [1, 2, 3], SamplingParams(max_new_tokens=4))
        big = engine.submit("big", list(range(10)), SamplingParams(max_new_tokens=10))
        huge = engine.submit("huge", list(range(20)), SamplingParams(max_new_tokens=1))
        engine.run_until_done()
        assert huge.finish_reason.value == "rejected" and "does not fit" in huge.finish_detail
        if mode == "reject":
            assert big.finish_reason.value == "rejected" and "max_len=16" in big.finish_detail
            assert big.generated_ids == []
        else:
            assert big.sampling.max_new_tokens == 6 and len(big.generated_ids) == 6
            assert big.finish_reason.value == "length"
        assert ok.generated_ids == solo(loaded, [1, 2, 3], SamplingParams(max_new_tokens=4))


def test_waiting_queue_limit_rejects_with_reason(tiny):
    engine = make(tiny["tiny-llama"], num_slots=1, max_waiting=1)
    states = [engine.submit(f"r{i}", [1, 2], SamplingParams(max_new_tokens=2)) for i in range(3)]
    assert states[2].finish_reason.value == "rejected" and "queue full" in states[2].finish_detail
    engine.run_until_done()
    assert [s.finish_reason.value for s in states[:2]] == ["length", "length"]


def test_stop_on_eos_and_stop_string(tiny):
    loaded = tiny["tiny-llama"]
    prompt = [3, 1, 4, 1, 5]
    free = solo(loaded, prompt, SamplingParams(max_new_tokens=8))
    eos = free[3]
    cut = free.index(eos) + 1
    engine = make_engine(loaded.model, num_slots=1, max_len=64, eos_token_ids=(eos,))
    state = engine.submit("r", prompt, SamplingParams(max_new_tokens=8))
    engine.run_until_done()
    assert state.generated_ids == free[:cut] and state.finish_reason.value == "stop"
    ignoring = make_engine(loaded.model, num_slots=1, max_len=64, eos_token_ids=(eos,))
    state = ignoring.submit("r", prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))
    ignoring.run_until_done()
    assert state.generated_ids == free and state.finish_reason.value == "length"
    # stop string: the first whole character of the free text (tiny-llama's tokens are bytes, so the first
    # few may be parts of one character); the request stops at the token that completes it
    texts = [loaded.tokenizer.decode(free[:n], skip_special_tokens=True) for n in range(1, len(free) + 1)]
    cut = next((n for n, text in enumerate(texts, 1) if text and text[-1] != "\ufffd"), None)
    assert cut is not None, texts
    stop = texts[cut - 1][-1]
    assert cut == 1 or stop not in texts[cut - 2]
    stopper = make(loaded)
    state = stopper.submit("s", prompt, SamplingParams(max_new_tokens=8, stop=(stop,)))
    stopper.run_until_done()
    assert (state.finish_reason.value, state.generated_ids, state.stop_str) == ("stop", free[:cut], stop)
    assert state.text_end == len(texts[cut - 1]) - 1  # the returned text ends before the stop string


def _finished(reports) -> dict:
    return {f.request_id: f for r in reports for f in r.finished}


@pytest.mark.parametrize("bad", [-1, 259, 999_999, 2**63, 2**70])
def test_a_token_id_outside_the_vocabulary_is_rejected_at_submit_and_the_rest_run(tiny, bad):
    """An id the embedding has no row for used to reach the batched forward and raise there (IndexError,
    or an int64 overflow from 2**63 on), taking every request of the step down with it."""
    loaded = tiny["tiny-llama"]
    engine = make(loaded)
    engine.submit("ok", [5, 17, 42], SamplingParams(max_new_tokens=6))
    engine.submit("oov", [1, bad, 2], SamplingParams(max_new_tokens=6))
    finished = _finished(engine.run_until_done())
    assert engine.vocab_size == loaded.model.config.vocab_size == 259
    oov = finished["oov"]
    assert (oov.finish_reason, oov.code, oov.output_ids) == ("rejected", "out_of_vocabulary", ())
    assert oov.detail.startswith(f"Token id {bad} is out of vocabulary")
    assert list(finished["ok"].output_ids) == uncached_greedy(oracle_model("tiny-llama", "eager"), [5, 17, 42], 6)
    assert (finished["ok"].finish_reason, finished["ok"].code) == ("length", "")


def test_rejections_carry_their_code(tiny):
    engine = make(tiny["tiny-llama"], num_slots=1, max_waiting=0, max_len=16)
    codes = {name: engine.submit(name, prompt, SamplingParams(max_new_tokens=n)).finish_code
             for name, prompt, n in (("runs", [1, 2], 2), ("empty", [], 2), ("long", [1] * 16, 2),
                                     ("long_output", [1, 2], 20), ("queued", [3, 4], 2))}
    assert codes == {"runs": "", "empty": "empty", "long": "too_long", "long_output": "too_long",
                     "queued": "queue_full"}


class _FailingDecode:
    """The tokenizer, with its decode raising from the `fail_at`-th call on (a detokenizer bug)."""

    def __init__(self, tokenizer, fail_at: int) -> None:
        self.tokenizer, self.calls, self.fail_at = tokenizer, 0, fail_at

    def decode(self, ids, **kwargs):
        self.calls += 1
        if self.calls >= self.fail_at:
            raise RuntimeError("injected decode failure")
        return self.tokenizer.decode(ids, **kwargs)


@pytest.mark.parametrize("where", ["sampling", "stop_check"])
def test_a_request_whose_own_step_raises_ends_alone_and_the_batch_goes_on(tiny, monkeypatch, where):
    """An exception while one request samples or checks its stop strings finishes that request with
    `error` (code internal_error) and frees its slot; the others' tokens stay their solo tokens."""
    loaded = tiny["tiny-llama"]
    engine = make(loaded)
    if where == "sampling":  # its third draw raises; greedy ignores top_k, so top_k=13 marks the request
        real, draws = engine_module.draw_token, []

        def sample(logits, params, generator):
            if params.top_k == 13:
                draws.append(1)
                if len(draws) == 3:
                    raise RuntimeError("injected sampling failure")
            return real(logits, params, generator)

        monkeypatch.setattr(engine_module, "draw_token", sample)
        bad_params = SamplingParams(max_new_tokens=8, top_k=13)
    else:  # only the bad request has stop strings, so only it decodes; the third decode raises
        engine.output.tokenizer = _FailingDecode(loaded.tokenizer, fail_at=3)
        bad_params = SamplingParams(max_new_tokens=8, stop=("never in this text",))
    engine.submit("good", [5, 17, 42], SamplingParams(max_new_tokens=8))
    engine.submit("bad", [9, 8, 7], bad_params)
    finished = _finished(engine.run_until_done())
    oracle = oracle_model("tiny-llama", "eager")
    bad = finished["bad"]
    assert (bad.finish_reason, bad.code) == ("error", "internal_error")
    assert "injected" in bad.detail and bad.detail.startswith("sampling failed: RuntimeError")
    assert list(bad.output_ids) == uncached_greedy(oracle, [9, 8, 7], 2)  # the two tokens before the failure
    assert list(finished["good"].output_ids) == uncached_greedy(oracle, [5, 17, 42], 8)
    assert engine.pool.num_free == engine.pool.num_slots and not engine.has_unfinished()


def test_an_interrupt_stops_the_step_in_progress_at_the_next_layer(tiny):
    """Engine.interrupt (kvtui serve's stop) ends a forward between two layers instead of after the whole
    step; the requests are then aborted, and the engine serves a new request exactly as before."""
    loaded = tiny["tiny-llama"]
    engine = make(loaded)
    ran: list = []
    layers = engine.runner.cache.layers
    for i, layer in enumerate(layers):  # each layer's K/V write, where the forward checks for a stop
        def update(*args, _update=layer.update, i=i, **kwargs):
            ran.append(i)
            out = _update(*args, **kwargs)
            if i == 0:
                engine.interrupt()  # a stop arrives while layer 0 runs
            return out
        layer.update = update
    assert engine.runner.forward_path == "fused"
    fused = engine.runner.fused
    fused.logits = lambda hidden: ran.append("head") or type(fused).logits(fused, hidden)
    try:
        engine.submit("a", [5, 17, 42], SamplingParams(max_new_tokens=4))
        with pytest.raises(StepInterrupted, match="layer 1"):
            engine.step()
    finally:
        for layer in layers:
            del layer.update
        del fused.logits
    assert ran == [0, 1]  # layer 1 began, its attention never ran, nor did the rest of the model (the head)
    engine.abort("a")
    assert [(f.request_id, f.finish_reason) for f in engine.step().finished] == [("a", "abort")]
    engine.submit("b", [9, 8, 7], SamplingParams(max_new_tokens=5))
    finished = _finished(engine.run_until_done())
    assert list(finished["b"].output_ids) == uncached_greedy(oracle_model("tiny-llama", "eager"), [9, 8, 7], 5)
    assert engine.pool.num_free == engine.pool.num_slots


def test_kv_budget_sizes_the_pool(tiny):
    loaded = tiny["tiny-llama"]
    one = make(loaded).pool.bytes_per_slot  # 2 (K,V) x 2 layers x 2 kv heads x 64 tokens x 16 dim x 4 bytes
    assert one == 2 * 2 * 2 * 64 * 16 * 4
    engine = make(loaded, kv_budget_bytes=3 * one + 1)
    assert engine.pool.num_slots == 3 and engine.pool.nbytes == 3 * one
    with pytest.raises(ValueError, match="holds no slot"):
        make(loaded, kv_budget_bytes=one - 1)


def test_abort_frees_slot(tiny):
    engine = make(tiny["tiny-llama"], num_slots=1)
    engine.submit("a", [1, 2, 3], SamplingParams(max_new_tokens=50))
    engine.step()
    engine.abort("a")
    r = engine.step()
    assert [(f.request_id, f.finish_reason) for f in r.finished] == [("a", "abort")]
    assert engine.pool.num_free == 1


def test_a_paused_wall_clock_advanced_to_an_arrival_reaches_it_exactly(tiny):
    """advance_to(t) on a paused wall clock must give now() >= t, or an arrival at t is never due
    (perf_counter's magnitude makes t0 - (t - now) round short by a few 1e-13 s)."""
    engine = make(tiny["tiny-llama"])
    engine.clock = "wall"
    engine.pause_clock()
    for t in (0.924062925044169, 3.000000000001, 12.5, 1234.000000001):
        engine.advance_to(t)
        assert engine.now() >= t


@pytest.mark.parametrize("temperature", [1e-300, 5e-324])
def test_a_tiny_temperature_samples_the_greedy_tokens(tiny, temperature):
    """logits / 1e-300 overflowed to inf and the softmax to NaN: the draw landed on an arbitrary token
    ("ectableectable" from SmolLM2 for any prompt). The limit of a vanishing temperature is the argmax."""
    loaded = tiny["tiny-llama"]
    engine = make(loaded)
    engine.submit("t", [5, 17, 42], SamplingParams(max_new_tokens=8, temperature=temperature, seed=3))
    finished = _finished(engine.run_until_done())
    assert list(finished["t"].output_ids) == uncached_greedy(oracle_model("tiny-llama", "eager"), [5, 17, 42], 8)


def test_logit_facts_flag_exactly_the_rows_holding_a_nan_or_an_infinity():
    """gaps_and_finite's finiteness per row (from the row's sum, rows whose sum overflows scanned) equals
    torch.isfinite(row).all(): rows
    of huge finite values (whose float32 sum overflows) stay finite, one NaN, +inf or -inf anywhere flags
    its row, +inf with -inf too; and the gap is top-1 minus top-2."""
    from kvtui.engine.output import gaps_and_finite

    big = torch.full((49152,), 3.0e38)
    rows = torch.stack([torch.linspace(-5, 5, 49152), big, big.clone(),
                        big.clone(), big.clone(), torch.zeros(49152)])
    rows[2, 7] = float("nan")
    rows[3, 49151] = float("inf")
    rows[4, 0] = float("-inf")
    rows[5, 3], rows[5, 9] = float("inf"), float("-inf")
    facts = gaps_and_finite(dict.fromkeys(range(6)), rows, list(range(6)))
    assert [facts[i][1] for i in range(6)] == torch.isfinite(rows).all(dim=1).tolist() == [True, True, False, False,
                                                                                            False, False]
    assert torch.isinf(rows[1].float().sum())  # what a float32 sum would have said about a finite row
    assert facts[0][0] == pytest.approx(10 / 49151, rel=1e-3)
