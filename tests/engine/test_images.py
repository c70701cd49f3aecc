"""Images: answers equal a solo pipeline built from transformers' own Dinov2Model, the same projector and
`generate(inputs_embeds=...)` on separate instances; batched equals solo with shared pictures in slots and
paged, padded and packed; the encoder cache encodes each picture once and shares it; the image faults are
caught with victim and source named, and silent when removed."""

from __future__ import annotations

import pytest
import torch
from helpers import make_engine

from kvtui.config import EngineConfig
from kvtui.engine import Engine, SamplingParams
from kvtui.engine.inputs import ImagePart, RequestInput
from kvtui.faults import FAULTS
from kvtui.model_kinds import ModelKind
from kvtui.models import build_tiny, load_model
from kvtui.models.dinov2 import build_tiny_dinov2, image_hash, image_tensor
from kvtui.models.projector import CANARY_WORDS, SeededProjector, canary_image, prompt_with_image
from kvtui.run.outcome import inert
from kvtui.scenario import parse_scenario
from kvtui.session import Session

PIL = pytest.importorskip("PIL", reason="Pillow decodes the pictures: pip install Pillow")
MAX_LEN = 96


@pytest.fixture(scope="module")
def vision():
    return load_model("tiny-vision", progress=False)


@pytest.fixture(scope="module")
def oracle():
    """SEPARATE instances: tiny-llama on transformers' eager attention, a tiny Dinov2Model and the seeded
    projector, built from the same seeds as tiny-vision's."""
    lm, _ = build_tiny("tiny-llama")
    lm.set_attn_implementation("eager")
    encoder = build_tiny_dinov2()
    projector = SeededProjector(7, in_dim=encoder.config.hidden_size, out_dim=lm.config.hidden_size, tokens=1,
                                row_norm=1.0)
    return lm.eval(), encoder, projector


def _request(tokenizer, k: int, text: str = "Repeat the word in the picture: <image>") -> RequestInput:
    picture = canary_image(CANARY_WORDS[k], 0, k)
    ids, positions = prompt_with_image(tokenizer, text, 1)
    return RequestInput(tuple(ids), images=(ImagePart(positions[0], 1, image_hash(picture), image_tensor(picture)),))


@torch.inference_mode()
def _oracle_answer(oracle, inp: RequestInput, n: int) -> list[int]:
    lm, encoder, projector = oracle
    image = inp.images[0]
    rows = projector(encoder(pixel_values=image.pixels[None]).last_hidden_state)[0]  # [1, hidden]
    embeds = lm.get_input_embeddings()(torch.tensor([list(inp.prompt_ids)]))[0].clone()
    embeds[image.start] = rows[0]
    out = lm.generate(inputs_embeds=embeds[None], attention_mask=torch.ones(1, embeds.shape[0], dtype=torch.long),
                      max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0].tolist()[-n:]


def _engine(vision, config: EngineConfig) -> Engine:
    return make_engine(vision.model, config, image_encoder=vision.image_encoder)


def _solo(vision, inp: RequestInput, n: int) -> list[int]:
    engine = _engine(vision, EngineConfig(num_slots=1, max_len=MAX_LEN, max_batch_size=1))
    state = engine.submit("solo", inp, SamplingParams(max_new_tokens=n))
    engine.run_until_done()
    return list(state.generated_ids)


def test_image_answers_equal_transformers_pipeline_on_separate_instances(vision, oracle):
    for k in range(3):
        inp = _request(vision.tokenizer, k)
        assert _solo(vision, inp, 6) == _oracle_answer(oracle, inp, 6), CANARY_WORDS[k]
    # a different picture behind the same text gives a different answer: the rows are read
    assert _solo(vision, _request(vision.tokenizer, 0), 6) != _solo(vision, _request(vision.tokenizer, 1), 6)


@pytest.mark.parametrize("kv,layout", [("slots", "padded"), ("slots", "packed"), ("paged", "padded"),
                                       ("paged", "packed")])
def test_batched_image_requests_with_shared_pictures_equal_solo(vision, kv, layout):
    pictures = [0, 1, 0, 2, 1, 0, 3]  # repeats: encoder-cache hits, and prefix-cache hits with paged KV
    inputs = [_request(vision.tokenizer, k) for k in pictures]
    lengths = [3, 7, 5, 2, 6, 4, 5]
    config = EngineConfig(kv=kv, num_slots=3, max_len=MAX_LEN, layout=layout, block_size=4, prefix_caching=kv == "paged",
                          max_batch_size=3, max_tokens_per_step=24)
    engine = _engine(vision, config)
    states, step = {}, 0
    while len(states) < len(inputs) or engine.has_unfinished():
        if step < len(inputs):  # one arrival a step: requests join while others decode and leave
            states[step] = engine.submit(f"r{step}", inputs[step], SamplingParams(max_new_tokens=lengths[step]))
        engine.step()
        step += 1
    for i, inp in enumerate(inputs):
        assert list(states[i].generated_ids) == _solo(vision, inp, lengths[i]), f"r{i}"
    stats = engine.encoder.cache.stats
    assert (stats.misses, stats.hits) == (4, 3)  # each of the 4 pictures encoded once
    assert len(engine.encoder.cache.entries) == 4 and engine.encoder.cache.by_request == {}


def test_encoder_cache_report_counts_entries_hits_and_bytes(vision):
    engine = _engine(vision, EngineConfig(num_slots=2, max_len=MAX_LEN))
    for i, k in enumerate([0, 0, 1]):
        engine.submit(f"r{i}", _request(vision.tokenizer, k), SamplingParams(max_new_tokens=2))
    first = engine.step()
    hidden = vision.model.config.hidden_size
    assert (first.encoder_entries, first.encoder_referenced, first.encoder_hits, first.encoder_misses) == (1, 1, 1, 1)
    assert first.encoder_bytes == hidden * 4  # one row of float32
    reports = engine.run_until_done()
    assert (reports[-1].encoder_entries, reports[-1].encoder_referenced, reports[-1].encoder_misses) == (2, 0, 2)


def test_images_are_refused_alone_by_a_text_model_and_bad_pixels_by_an_image_model(tiny, vision):
    text_engine = make_engine(tiny["tiny-llama"].model, num_slots=2, max_len=MAX_LEN)
    refused = text_engine.submit("img", _request(vision.tokenizer, 0))
    fine = text_engine.submit("txt", [5, 6, 7], SamplingParams(max_new_tokens=2))
    text_engine.run_until_done()
    assert refused.finish_reason.value == "rejected" and "without an image encoder" in refused.finish_detail
    assert len(fine.generated_ids) == 2
    engine = _engine(vision, EngineConfig(num_slots=2, max_len=MAX_LEN))
    good = _request(vision.tokenizer, 0)
    bad = RequestInput(good.prompt_ids, images=(ImagePart(good.images[0].start, 1, "x", torch.zeros(3, 32, 32)),))
    state = engine.submit("bad", bad)
    engine.run_until_done()
    assert state.finish_reason.value == "rejected" and "(3, 224, 224)" in state.finish_detail


IMAGE_FAULTS = [name for name, f in FAULTS.items() if f.models == (ModelKind.IMAGE_TEXT,)]
LOAD = """name: image-truth-table
seed: 0
max_requests: 8
model: tiny-vision
engine: {{{pool}, max_len: 128, layout: {layout}, faults: [{faults}]}}
arrivals: {{process: constant, rate_per_s: 2.0}}
prompts: {{kind: image_passphrase, pictures: 4, uuids: {uuids}}}
output_tokens: 8
sampling: {{ignore_eos: true}}
"""


def _image_load(name: str, layout: str, kv: str, on: bool):
    # mm_hash_missing acts in the prefix cache; the others where no prefix hit hides the image positions
    pool = ("kv: paged, block_size: 4, max_batch_size: 2, prefix_caching: true" if name == "mm_hash_missing"
            else "kv: paged, block_size: 4, max_batch_size: 2" if kv == "paged" else "slots: 2")
    return parse_scenario(LOAD.format(pool=pool, layout=layout, faults=name if on else "",
                                      uuids="reused" if name == "mm_uuid_trusted" else "none"))


@pytest.mark.parametrize("name,layout,kv", [(n, layout, kv) for n in IMAGE_FAULTS for layout in FAULTS[n].layouts
                                            for kv in FAULTS[n].kv])
def test_image_faults_are_caught_with_victim_and_source_and_silent_when_removed(vision, name, layout, kv):
    session = Session(_image_load(name, layout, kv, True), vision, clock="virtual")
    session.run()
    reports = [e for e in session.contamination if e.counts]
    assert set(FAULTS[name].caught_by) - {"canary"} <= {e.detector for e in reports}, session.contamination
    ran = {f"r{i:03d}" for i in range(8)}
    named = [e for e in reports if e.source is not None]
    assert named and all(e.victim in ran and set(e.source.split(",")) <= ran - {e.victim} for e in named)
    assert session.summary.fault_acts[name] > 0
    clean = Session(_image_load(name, layout, kv, False), vision, clock="virtual")
    clean.run()
    assert [e for e in clean.contamination if e.counts] == [] and clean.summary.fault_acts is None


def test_mm_hash_missing_with_no_picture_in_a_reused_block_acted_0_times_and_says_so(vision):
    """32-token blocks: the prompts' shared text fills cached blocks and is reused, but no reused block holds
    an image position, so the fault has nothing to act on: no fault.acted event, no finding, and the inert
    line rather than a detector miss."""
    spec = parse_scenario(LOAD.format(pool="kv: paged, block_size: 32, max_batch_size: 2, prefix_caching: true",
                                      layout="padded", faults="mm_hash_missing", uuids="none")
                          + "expect: {contamination: detected}\n")
    seen: list = []
    session = Session(spec, vision, clock="virtual", listeners=(seen.append,))
    session.run()
    assert session.summary.prefix_cache_hits > 0 and session.summary.fault_acts == {"mm_hash_missing": 0}
    assert [e for e in seen if e.type == "fault.acted"] == [] and [e for e in session.contamination if e.counts] == []
    assert inert(spec, session) == ["mm_hash_missing acted 0 times: no cached block held an image position of "
                                    "another picture when a request looked it up"]


@pytest.mark.smollm
def test_dinov2_smollm2_answers_each_picture_with_its_word_as_the_transformers_pipeline_does():
    from kvtui.models import ModelLoadError
    from kvtui.models.dinov2 import dinov2_onnx_path, load_dinov2

    try:
        dinov2_onnx_path()
    except ModelLoadError as e:
        pytest.skip(str(e))

    loaded = load_model("dinov2-smollm2", progress=False)
    lm = load_model("default", progress=False).model  # a separate instance, transformers' sdpa attention
    lm.set_attn_implementation("sdpa")
    oracle = (lm, load_dinov2(progress=False), loaded.image_encoder.projector)
    engine = make_engine(loaded.model, num_slots=4, max_len=128, image_encoder=loaded.image_encoder)
    inputs = [_request(loaded.tokenizer, k) for k in range(4)]
    states = [engine.submit(f"r{k}", inp, SamplingParams(max_new_tokens=6)) for k, inp in enumerate(inputs)]
    engine.run_until_done()
    for k, (inp, state) in enumerate(zip(inputs, states)):
        assert list(state.generated_ids) == _oracle_answer(oracle, inp, 6)
        assert CANARY_WORDS[k] in loaded.tokenizer.decode(state.generated_ids).lower()
