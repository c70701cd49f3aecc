"""The engine runs Whisper: the encoder at admission, the encoder cache, cross-attention per row.

Oracle: transformers' own `generate` on a separate model instance, one clip at a time, greedy, fp32;
every batched transcript must equal it token for token (its `sequences` past the two decoder-prompt
tokens, end-of-text included), in both KV modes and layouts, with requests joining and leaving.
Fast tests use tiny-whisper; the `whisper` test runs Whisper tiny.en over the 8 shipped clips.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import make_engine

from kvtui.config import EngineConfig
from kvtui.engine.encoder_cache import AudioInput, CrossEntry, EncoderCache, audio_hash, audio_input
from kvtui.engine.engine import Engine
from kvtui.engine.inputs import RequestInput
from kvtui.engine.request import SamplingParams
from kvtui.models import whisper as wh

CLIPS = sorted((Path(__file__).resolve().parents[2] / "scenarios" / "audio").glob("*.wav"))
TINY_PROMPT = [257, 260]  # <|startoftranscript|>, <|notimestamps|>


@pytest.fixture(scope="module")
def clips_audio():
    fe = wh.build_feature_extractor()
    return [audio_input(wh.read_wav(c), fe, c.name) for c in CLIPS]


@pytest.fixture(scope="module")
def tiny_reference(clips_audio):
    """generate's tokens per (clip index, max_new_tokens), from a separate tiny-whisper instance."""
    model, _ = wh.build_tiny_whisper()
    cache: dict = {}

    def tokens(i: int, n: int) -> list[int]:
        if (i, n) not in cache:
            out = model.generate(clips_audio[i].features[None], max_new_tokens=n, return_dict_in_generate=True)
            cache[(i, n)] = out.sequences[0, 2:].tolist()
        return cache[(i, n)]

    return tokens


def _tiny_engine(entries: int | None = None, **overrides) -> Engine:
    model, _ = wh.build_tiny_whisper()
    cfg = dict(max_len=64, num_slots=3, max_batch_size=3, max_tokens_per_step=64)
    return make_engine(model, EngineConfig(**(cfg | overrides)), eos_token_ids=[256], clock="virtual",
                       encoder_cache_entries=entries)


def _run(engine: Engine, arrivals: list[tuple[int, str, int, int]], audio: list[AudioInput]):
    """Submit (step, request id, clip index, max_new_tokens) at their steps; step until done.
    Returns ({request id: output ids}, [step events])."""
    out, events, pending = {}, [], sorted(arrivals)
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= engine.step_index:
            _, rid, clip, n = pending.pop(0)
            engine.submit(rid, RequestInput(tuple(TINY_PROMPT), audio=audio[clip]), SamplingParams(max_new_tokens=n))
        events.append(engine.step())
        out |= {f.request_id: list(f.output_ids) for f in events[-1].finished}
    return out, events


# staggered: requests join while others decode and leave mid-run; clip 0 comes twice (a cache hit)
ARRIVALS = [(0, "a", 0, 12), (0, "b", 1, 30), (0, "c", 2, 20), (3, "d", 3, 8), (5, "e", 0, 25),
            (9, "f", 4, 40), (14, "g", 5, 10), (20, "h", 6, 16), (21, "i", 7, 33)]


@pytest.mark.parametrize("kv,layout,caching", [("slots", "padded", False), ("slots", "packed", False),
                                               ("paged", "padded", True), ("paged", "packed", False)])
def test_batched_transcripts_equal_solo_generate(clips_audio, tiny_reference, kv, layout, caching):
    engine = _tiny_engine(6, kv=kv, layout=layout, prefix_caching=caching, block_size=4)
    out, events = _run(engine, ARRIVALS, clips_audio)
    for _, rid, clip, n in ARRIVALS:
        assert out[rid] == tiny_reference(clip, n), rid
    assert max(len(e.running) for e in events) == 3  # three requests share steps
    last = events[-1]
    # 8 distinct clips computed once each; "e" (clip 0 again) hit the entry "a" left cached
    assert (last.encoder_misses, last.encoder_hits) == (8, 1)
    assert last.encoder_referenced == 0 and last.encoder_entries == last.encoder_capacity == 6
    assert last.encoder_bytes == 6 * 2 * 2 * 4 * 1500 * 16 * 4  # entries x K,V x layers x heads x S x D x fp32


def test_one_encoder_forward_per_admission_step(clips_audio, monkeypatch):
    engine = _tiny_engine()
    calls = []
    encode = engine.runner.encode
    monkeypatch.setattr(engine.runner, "encode", lambda feats: calls.append(feats.shape[0]) or encode(feats))
    for rid, clip in (("a", 0), ("b", 1), ("c", 1)):  # b and c: same audio, computed once
        engine.submit(rid, RequestInput(tuple(TINY_PROMPT), audio=clips_audio[clip]), SamplingParams(max_new_tokens=4))
    engine.step()
    assert calls == [2]
    entries = engine.encoder.cache
    assert entries.entry_of("b") is entries.entry_of("c") and entries.entry_of("b").refs == 2
    engine.run_until_done()
    assert calls == [2] and entries.entry_of("b") is None


def test_audio_problems_are_rejections(clips_audio, tiny):
    engine = _tiny_engine()
    missing = engine.submit("m", TINY_PROMPT)
    bad = engine.submit("b", RequestInput(tuple(TINY_PROMPT), audio=AudioInput(torch.zeros(80, 100), "x")))
    good = engine.submit("g", RequestInput(tuple(TINY_PROMPT), audio=clips_audio[0]), SamplingParams(max_new_tokens=3))
    assert (missing.finish_code, bad.finish_code) == ("unsupported_input", "unsupported_input")  # not "empty"
    assert "needs audio" in missing.finish_detail and "(80, 3000)" in bad.finish_detail
    engine.run_until_done()
    assert good.finish_reason.value == "length" and len(good.generated_ids) == 3
    llama = make_engine(tiny["tiny-llama"].model, max_len=64, num_slots=2)
    r = llama.submit("x", RequestInput((1, 2, 3), audio=clips_audio[0]))
    assert r.finish_reason.value == "rejected" and r.finish_detail.startswith("audio given to a decoder-only model")
    assert r.finish_code == "unsupported_input"


def test_decoder_only_steps_carry_no_encoder_fields(tiny):
    assert _tiny_engine().encoder.cache.capacity == 16  # the default: ENCODER_CACHE_ENTRIES
    llama = make_engine(tiny["tiny-llama"].model, max_len=64, num_slots=2)
    llama.submit("x", [1, 2, 3], SamplingParams(max_new_tokens=2))
    event = llama.run_until_done()[-1]
    assert event.encoder_entries is None and "encoder_entries" not in event.to_dict()


def test_cross_faults_refused_on_decoder_only(tiny):
    llama = make_engine(tiny["tiny-llama"].model, max_len=64, num_slots=2)
    with pytest.raises(ValueError, match="'stale_cross_kv' does not act on decoder-only models"):
        llama.set_faults({"stale_cross_kv"})
    with pytest.raises(ValueError, match="'racy_threads' does not act on encoder-decoder"):
        _tiny_engine().set_faults({"racy_threads"})


def _entry(key: str, owner: str) -> CrossEntry:
    return CrossEntry(key, key, owner, (torch.zeros(2, 3, 4),), (torch.zeros(2, 3, 4),))


def test_encoder_cache_refcounts_and_evicts_least_recently_used():
    cache = EncoderCache(capacity=2)
    cache.insert("r1", _entry("A", "r1"))
    cache.insert("r2", _entry("B", "r2"))
    assert cache.acquire("r3", "A").refs == 2 and cache.acquire("r4", "C") is None
    cache.release("r1")
    cache.release("r3")
    cache.insert("r5", _entry("C", "r5"))  # full: A (unreferenced) goes; B is held by r2
    assert list(cache.entries) == ["B", "C"] and cache.stats.evictions == 1
    cache.insert("r6", _entry("D", "r6"))  # nothing unreferenced: kept past capacity, evicted once free
    assert list(cache.entries) == ["B", "C", "D"]
    cache.release("r2")
    assert list(cache.entries) == ["C", "D"]
    assert cache.report() == dict(encoder_entries=2, encoder_capacity=2, encoder_referenced=2, encoder_bytes=2 * 2 * 96,
                                  encoder_hits=1, encoder_misses=1)


def test_audio_hash_is_the_content():
    a = torch.linspace(-1, 1, 1600).numpy()
    assert audio_hash(a, 16000) == audio_hash(a.copy(), 16000) != audio_hash(a[::-1].copy(), 16000)
    assert audio_hash(a, 16000) != audio_hash(a, 8000)


@pytest.mark.whisper
@pytest.mark.parametrize("kv", ["slots", "paged"])
def test_whisper_tiny_en_batched_equals_generate_on_every_clip(whisper_en, kv):
    from kvtui.models import load_model

    reference = load_model("whisper-tiny.en", progress=False).model  # a separate instance
    engine = make_engine(load_model("whisper-tiny.en", progress=False).model, max_len=448, num_slots=3,
                         max_batch_size=3, kv=kv, max_tokens_per_step=256, eos_token_ids=whisper_en.eos_token_ids,
                         clock="virtual")
    audio = [audio_input(wh.read_wav(c), whisper_en.feature_extractor, c.name) for c in CLIPS]
    prompt = whisper_en.tokenizer.convert_tokens_to_ids(["<|startoftranscript|>", "<|notimestamps|>"])
    for i, a in enumerate(audio):
        engine.submit(CLIPS[i].stem, RequestInput(tuple(prompt), audio=a), SamplingParams(max_new_tokens=40))
    out = {f.request_id: list(f.output_ids) for e in engine.run_until_done() for f in e.finished}
    for clip, a in zip(CLIPS, audio):
        solo = reference.generate(a.features[None], max_new_tokens=40, return_dict_in_generate=True).sequences
        assert out[clip.stem] == solo[0, 2:].tolist(), clip.name
        words = whisper_en.tokenizer.decode(out[clip.stem], skip_special_tokens=True).lower()
        assert clip.stem.split("-")[-1] in words  # the number comes back as digits in all 8 clips


def test_encoder_fields_are_recorded(clips_audio):
    engine = _tiny_engine()
    engine.submit("a", RequestInput(tuple(TINY_PROMPT), audio=clips_audio[0]), SamplingParams(max_new_tokens=2))
    engine.submit("b", RequestInput(tuple(TINY_PROMPT), audio=clips_audio[0]), SamplingParams(max_new_tokens=2))
    record = engine.step().to_dict()
    assert {k: record[k] for k in ("encoder_entries", "encoder_referenced", "encoder_hits", "encoder_misses")} == dict(
        encoder_entries=1, encoder_referenced=1, encoder_hits=1, encoder_misses=1)
    assert record["encoder_hit_log"] == [dict(request_id="b", audio_hash=clips_audio[0].content_hash[:12],
                                              entry_audio_hash=clips_audio[0].content_hash[:12], computed_for="a")]
