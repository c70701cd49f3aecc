"""The run layer's request shape and intake: one typed, frozen PlannedRequest (kvtui/request.py), the
engine carrying no caller metadata, and kvtui/run/intake.py turning each InputSpec into the RequestInput the
engine needs (checked against the model's own embedding table, transformers' feature extractor and the
clip's samples read with the standard library, not against kvtui's own conversion)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import threading
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtui.config import EngineConfig
from kvtui.engine import Engine, SamplingParams
from kvtui.engine.inputs import PLACEHOLDER_ID, ImagePart, RequestInput
from kvtui.engine.report import FinishedRequestReport
from kvtui.engine.request import RequestState
from kvtui.request import (
    AudioClip,
    Canary,
    EmbedsPrompt,
    GivenInput,
    ImagePrompt,
    PlannedRequest,
    PromptFacts,
    TokenPrompt,
)
from kvtui.run.intake import Admitted, Intake, Refused, load_adapters

ROOT = Path(__file__).resolve().parents[2]
CLIP = ROOT / "scenarios" / "audio" / "amber-lantern-23.wav"


def _planned(request_id: str, spec, **kw) -> PlannedRequest:
    return PlannedRequest(request_id, 0.0, spec, SamplingParams(max_new_tokens=kw.pop("max_new_tokens", 4),
                                                                ignore_eos=True), **kw)


def _intake(loaded, names=()) -> Intake:
    engine = Engine(loaded.model, EngineConfig(num_slots=4, max_len=64, max_batch_size=4),
                    eos_token_ids=loaded.eos_token_ids or (), tokenizer=loaded.tokenizer)
    registry = load_adapters(loaded, names, enforce_eager=False, batch_invariant=False)
    return Intake(engine, registry, getattr(loaded, "feature_extractor", None))


# -- architecture ---------------------------------------------------------------------------------------
def test_the_engine_carries_no_caller_metadata():
    assert "metadata" not in inspect.signature(Engine.submit).parameters
    assert "metadata" not in {f.name for f in dataclasses.fields(RequestState)}
    assert "metadata" not in {f.name for f in dataclasses.fields(FinishedRequestReport)}


def test_a_planned_request_and_its_parts_are_frozen():
    p = _planned("r0", TokenPrompt((5, 6, 7)), canary=Canary("AMBER-LANTERN-23"), text="hi")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.arrival_s = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.input.ids = (1,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.canary.passphrase = "OTHER-WORDS-00"
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.facts.turn = 3
    moved = dataclasses.replace(p, arrival_s=2.5)
    assert (moved.arrival_s, p.arrival_s, moved.prompt_ids, moved.passphrase) == (2.5, 0.0, [5, 6, 7], "AMBER-LANTERN-23")


def test_a_planned_request_takes_only_an_input_spec():
    with pytest.raises(TypeError, match="TokenPrompt"):
        PlannedRequest("r0", 0.0, [1, 2, 3], SamplingParams())
    with pytest.raises(ValueError, match="mask has 2 entries for a prompt of 3 ids"):
        EmbedsPrompt((1, 2, 3), (True, False))


def test_nothing_in_kvtui_reads_or_passes_metadata():
    """No `.metadata` attribute read and no `metadata=` argument anywhere in kvtui/ (the typed fields replaced
    the dict; `importlib.metadata` in a subprocess's source string is text, not code)."""
    found = []
    for path in sorted((ROOT / "kvtui").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        # matplotlib's own `savefig(..., metadata=...)` (the SVG's date) is a plotting keyword, not a request's
        plotting = {id(k) for call in ast.walk(tree) if isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Attribute) and call.func.attr == "savefig" for k in call.keywords}
        for node in ast.walk(tree):
            if id(node) in plotting:
                continue
            if isinstance(node, ast.Attribute) and node.attr == "metadata":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} .metadata")
            if isinstance(node, ast.keyword) and node.arg == "metadata":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} metadata=")
            if isinstance(node, ast.arg) and node.arg == "metadata":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} parameter metadata")
    assert found == []


def test_labels_come_from_the_input():
    clip = _planned("a", AudioClip(str(CLIP), (1, 2)))
    part = ImagePart(1, 1, "ab" * 32, torch.zeros(3, 2, 2), label="copper.png")
    image = _planned("b", ImagePrompt((5, 0, 6), (part,)))
    assert (clip.audio_label, clip.image_label) == ("amber-lantern-23.wav", None)
    assert (image.audio_label, image.image_label) == (None, "copper.png")
    given = _planned("c", GivenInput(RequestInput((5, 0, 6), images=(part,))))
    assert (given.image_label, given.prompt_ids) == ("copper.png", [5, 0, 6])


# -- the intake: each InputSpec as the engine's RequestInput ----------------------------------------------
def test_a_token_prompt_is_its_ids(tiny):
    intake = _intake(tiny["tiny-llama"])
    got = intake.request_input(_planned("a", TokenPrompt((7, 8, 9, 10))))
    assert (got.prompt_ids, got.embeds, got.audio, got.images, got.lora) == ((7, 8, 9, 10), None, None, (), None)


def test_embeddings_rows_are_the_models_own_at_supplied_positions_and_zeros_elsewhere(tiny):
    loaded = tiny["tiny-llama"]
    table = loaded.model.get_input_embeddings().weight.detach().float()
    ids = (11, 12, 13, 14, 15, 16)
    mask = (True, True, False, False, True, False)
    got = _intake(loaded).request_input(_planned("a", EmbedsPrompt(ids, mask)))
    assert got.prompt_ids == (11, 12, PLACEHOLDER_ID, PLACEHOLDER_ID, 15, PLACEHOLDER_ID)
    assert got.embeds.is_token_ids.tolist() == list(mask)
    for p, (t, keep) in enumerate(zip(ids, mask)):
        expected = torch.zeros(table.shape[1]) if keep else table[t]
        assert torch.equal(got.embeds.rows[p], expected), p


def test_a_whole_embeddings_prompt_has_no_mask_and_every_row_supplied(tiny):
    loaded = tiny["tiny-llama"]
    table = loaded.model.get_input_embeddings().weight.detach().float()
    ids = (21, 22, 23)
    got = _intake(loaded).request_input(_planned("a", EmbedsPrompt(ids, (False, False, False))))
    assert got.prompt_ids == (PLACEHOLDER_ID,) * 3 and got.embeds.is_token_ids is None
    assert torch.equal(got.embeds.rows, table[list(ids)])


def test_a_mask_pairs_second_request_carries_the_first_tensor_under_its_own_mask(tiny):
    """The second of a pair: its ids hold the placeholder where the first's rows were, every position a token
    id; the tensor is the first's (table rows where the first supplied them, zeros where it had token ids)."""
    loaded = tiny["tiny-llama"]
    table = loaded.model.get_input_embeddings().weight.detach().float()
    first_ids = (31, 32, 33, 34)
    second_ids = (31, PLACEHOLDER_ID, PLACEHOLDER_ID, 34)
    got = _intake(loaded).request_input(_planned("b", EmbedsPrompt(second_ids, (True,) * 4, rows_of=first_ids)))
    assert got.prompt_ids == second_ids and got.embeds.is_token_ids.tolist() == [True] * 4
    zero = torch.zeros(table.shape[1])
    assert [torch.equal(r, e) for r, e in zip(got.embeds.rows, [zero, table[32], table[33], zero])] == [True] * 4


def test_an_image_prompt_keeps_its_parts_and_a_given_input_goes_as_it_is(tiny):
    intake = _intake(tiny["tiny-llama"])
    part = ImagePart(1, 1, "cd" * 32, torch.ones(3, 2, 2), label="amber.png")
    got = intake.request_input(_planned("a", ImagePrompt((5, 0, 6), (part,))))
    assert got.prompt_ids == (5, 0, 6) and got.images == (part,)
    given = RequestInput((1, 2, 3))
    assert intake.request_input(_planned("b", GivenInput(given))) is given


def test_an_audio_clip_is_read_once_into_whispers_features(tiny_whisper):
    """The clip's features equal transformers' own WhisperFeatureExtractor over the WAV's samples (read here
    with the standard library's wave module), and a second request of the same clip reuses the first's read."""
    intake = _intake(tiny_whisper)
    first = intake.request_input(_planned("a", AudioClip(str(CLIP), (1, 2))))
    second = intake.request_input(_planned("b", AudioClip(str(CLIP), (1, 2))))
    with wave.open(str(CLIP)) as w:
        samples = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32) / 32768.0
    expected = tiny_whisper.feature_extractor(samples, sampling_rate=16000, return_tensors="pt").input_features[0]
    assert first.prompt_ids == (1, 2) and first.audio.label == "amber-lantern-23.wav"
    assert torch.equal(first.audio.features, expected)
    assert second.audio is first.audio


def test_an_adapter_is_attached_and_a_missing_one_refuses_its_request_alone(tiny):
    intake = _intake(tiny["tiny-llama"], names=("lora-a",))
    ok = intake.submit(_planned("a", TokenPrompt((5, 6, 7)), adapter="lora-a"))
    gone = intake.submit(_planned("b", TokenPrompt((5, 6, 7)), adapter="lora-z"))
    plain = intake.submit(_planned("c", TokenPrompt((5, 6, 7))))
    assert isinstance(ok, Admitted) and ok.state.input.lora is intake.adapters.get("lora-a")
    assert isinstance(gone, Refused) and (gone.code, gone.detail) == ("model_not_found",
                                                                      "The model `lora-z` does not exist.")
    assert isinstance(plain, Admitted) and plain.state.input.lora is None
    assert set(intake.engine.requests) == {"a", "c"}


def test_a_duplicate_id_is_refused_and_n_sequences_are_named(tiny):
    intake = _intake(tiny["tiny-llama"])
    first = intake.submit(_planned("a", TokenPrompt((5, 6, 7))))
    again = intake.submit(_planned("a", TokenPrompt((8, 9))))
    assert isinstance(first, Admitted) and first.sequence_ids == ("a",)
    assert isinstance(again, Refused) and again.code == "internal_error"
    assert again.detail.startswith("submit failed: ValueError: duplicate")
    four = _planned("n", TokenPrompt((5, 6, 7)), max_new_tokens=3)
    four = dataclasses.replace(four, sampling=dataclasses.replace(four.sampling, n=2, temperature=1.0, seed=3))
    outcome = intake.submit(four)
    assert outcome.sequence_ids == ("0_n", "1_n")


def test_cancel_after_aborts_at_that_many_tokens(tiny):
    intake = _intake(tiny["tiny-llama"])
    intake.submit(_planned("a", TokenPrompt((5, 6, 7)), max_new_tokens=10, cancel_after=3))
    finished = []
    while intake.engine.has_unfinished():
        finished += intake.engine.step().finished
        intake.cancel_due()
    assert [(f.request_id, f.finish_reason, len(f.output_ids)) for f in finished] == [("a", "abort", 3)]


def test_the_queue_drains_in_order_from_another_thread(tiny):
    intake = _intake(tiny["tiny-llama"])
    order = []

    def feed():
        intake.put(_planned("a", TokenPrompt((5, 6, 7))))
        order.append(intake.call(lambda: sorted(intake.engine.requests)))
        intake.abort("a")
        intake.put(_planned("b", TokenPrompt((8, 9))))

    thread = threading.Thread(target=feed)
    thread.start()
    thread.join()
    assert intake.ready.is_set()
    outcomes = intake.drain()
    assert [o.planned.request_id for o in outcomes] == ["a", "b"] and not intake.ready.is_set()
    assert order[0].result(timeout=1) == ["a"]  # the call ran after a's submit, before b's
    assert intake.engine.requests["a"].is_done and not intake.engine.requests["b"].is_done


def test_a_planned_embeddings_scenario_goes_through_the_intake(tiny):
    """plan_requests gives `embeds: passphrase` prompts as EmbedsPrompt with the canary; through the intake
    the supplied rows are the model's own rows of the tokens that spell the passphrase."""
    from kvtui.scenario import parse_scenario, plan_requests

    loaded = tiny["tiny-llama"]
    spec = parse_scenario("max_requests: 2\nmodel: tiny-llama\nengine: {max_len: 128}\n"
                          "prompts: {kind: passphrase, embeds: passphrase}")
    planned = plan_requests(spec, loaded.tokenizer)
    table = loaded.model.get_input_embeddings().weight.detach().float()
    intake = _intake(loaded)
    for p in planned:
        assert isinstance(p.input, EmbedsPrompt) and p.passphrase in p.text and p.facts == PromptFacts()
        supplied = [t for t, keep in zip(p.prompt_ids, p.input.mask) if not keep]
        assert p.passphrase in loaded.tokenizer.decode(supplied)
        got = intake.request_input(p)
        rows = [got.embeds.rows[i] for i in got.embeds.supplied_positions]
        assert all(torch.equal(r, table[t]) for r, t in zip(rows, supplied)) and len(rows) == len(supplied)
