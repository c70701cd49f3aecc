"""Prompt embeddings over HTTP (`kvtui serve --enable-prompt-embeds`, vLLM's flag and request fields).

A client sends embedding rows in place of (part of) a prompt, as base64 of the bytes `torch.save` writes
for a (num_tokens, hidden_size) tensor:

- /v1/completions: `prompt_embeds` (one string, or a list of one); `prompt` is then omitted or empty.
  The rows are the whole prompt: no chat template, no special tokens added.
- /v1/chat/completions: a content part `{"type": "prompt_embeds", "data": "<base64>"}` among text parts.
  The chat template is rendered with a one-off marker string in place of each such part; the rendered
  text is cut at the markers, each text piece is tokenized on its own (no special tokens added, as
  `apply_chat_template` tokenizes its output; a tokenizer without a template gets BOS-style special
  tokens on the first piece only, as a plain prompt would), and each marker becomes one position per row
  of its tensor. vLLM does the same with a special placeholder token that it expands; a special token
  splits tokenization the same way, so the ids around an embedding are those of the text pieces.
  The request's tensor covers the whole prompt: zeros and `is_token_ids` True at text positions,
  the part's rows at its positions (PLACEHOLDER_ID in the prompt ids there).
- Image models (kvtui serve --model dinov2-smollm2): an image_url part (kvtui/serve/images.py) takes the
  same route, a marker of its own becoming IMAGE_TOKENS placeholder positions filled by the engine with
  the picture's projected rows (an ImagePart at the first); those positions are not supplied rows, so a
  chat with images only carries no embeddings tensor at all.

Decoding is safe: the size of the base64 text is checked before it is decoded (MAX_BYTES_PER_VALUE per
value of a max_len x hidden float32 tensor, as base64, plus room for the file's header), and
`torch.load(..., weights_only=True)` reads tensors only, never running pickled code. The tensor must be
a dense 2-D (a leading batch dimension of 1 is dropped, as vLLM does) float32, bfloat16 or float16
tensor, `hidden_size` wide, 1 to max_len rows, every value finite; it is cast to the model's dtype
(vLLM casts too), and refused when a value does not fit that dtype. Every refusal is a 400 (413 for the
size) naming the request field.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
import re
import secrets
from dataclasses import dataclass

import torch

from kvtui.engine.inputs import PLACEHOLDER_ID, ImagePart, RequestInput
from kvtui.serve.protocol import ApiError

ENABLE_HINT = "prompt_embeds needs the server started with --enable-prompt-embeds"
ACCEPTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_BYTES_PER_VALUE = 4 * 1.5  # float32 bytes, with room for base64's 4/3
HEADER_ROOM = 64 * 1024  # torch.save's zip header and pickle around the data


@dataclass(frozen=True)
class EmbedsSpec:
    """What a served model takes as prompt embeddings: rows `hidden_size` wide, cast to `dtype`, at most
    `max_len` of them in one request."""

    hidden_size: int
    dtype: torch.dtype
    max_len: int

    @property
    def max_chars(self) -> int:
        """The longest base64 text taken for one tensor."""
        return int(self.max_len * self.hidden_size * MAX_BYTES_PER_VALUE) + HEADER_ROOM

    @classmethod
    def of(cls, model, max_len: int) -> EmbedsSpec:
        """The spec of a transformers model (its input embedding table's width and dtype)."""
        weight = model.get_input_embeddings().weight
        return cls(int(weight.shape[1]), weight.dtype, max_len)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def decode(data, spec: EmbedsSpec, *, param: str = "prompt_embeds") -> torch.Tensor:
    """The [T, hidden] tensor in base64 `data`, cast to the model's dtype.

    Raises:
        ApiError: 413 for text past spec.max_chars; 400 naming `param` for anything else wrong (not base64,
            not a torch.save tensor, its shape, dtype, width, length, NaN/inf).
    """
    tensor = _read(data, spec, param)
    return _checked(tensor, spec, param)


def _expected(spec: EmbedsSpec) -> str:
    return f"expected a (num_tokens, {spec.hidden_size}) float32, bfloat16 or float16 tensor"


def _read(data, spec: EmbedsSpec, param: str) -> torch.Tensor:
    """The tensor torch.save wrote into base64 `data` (size, base64 and file checked)."""
    expected = _expected(spec)
    if not isinstance(data, str) or not data:
        raise ApiError(400, f"{param} must be a non-empty string: base64 of torch.save bytes, {expected}", param=param)
    if len(data) > spec.max_chars:
        raise ApiError(413, f"{param} is {len(data)} characters; at most {spec.max_chars} are taken (a "
                       f"{spec.max_len} x {spec.hidden_size} tensor)", param=param, code="request_too_large")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{param} is not valid base64; send base64 of torch.save bytes, {expected}",
                       param=param) from None
    try:
        tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError:  # weights_only refused an object: pickled code or a class it does not read
        raise ApiError(400, f"{param} holds objects other than tensors, which are never unpickled here; "
                       f"{expected}", param=param) from None
    except Exception:  # noqa: BLE001 - any unreadable file: not a zip, truncated (torch's words are its internals)
        raise ApiError(400, f"{param} {_unreadable(raw)}; {expected}", param=param) from None
    if not isinstance(tensor, torch.Tensor):
        raise ApiError(400, f"{param} holds a {type(tensor).__name__}, not a tensor; {expected}", param=param)
    return tensor


def _unreadable(raw: bytes) -> str:
    """Why bytes torch.load refused are no torch.save file, in the client's terms (torch's own words name its
    internals: a KeyError's bare number, miniz's central directory)."""
    if not raw.startswith(b"PK\x03\x04"):
        return (f"decodes to {len(raw)} bytes that are not a torch.save file (torch.save writes a zip archive, "
                f"starting PK; these start {raw[:8]!r})")
    return f"decodes to a zip archive of {len(raw)} bytes that torch.load cannot read (cut short or damaged)"


def _checked(tensor: torch.Tensor, spec: EmbedsSpec, param: str) -> torch.Tensor:
    """`tensor` as [T, hidden] in the model's dtype, once its layout, shape, dtype and values pass."""
    expected = _expected(spec)
    if tensor.device.type != "cpu":  # a meta (or other device's) tensor holds no values to read
        raise ApiError(400, f"{param} is a tensor on device {tensor.device.type}; send one saved from the CPU, "
                       f"{expected}", param=param)
    if tensor.layout != torch.strided:
        raise ApiError(400, f"{param} is a {tensor.layout} tensor; send a dense one, {expected}", param=param)
    if tensor.dim() == 3 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != 2:
        raise ApiError(400, f"{param} has shape {tuple(tensor.shape)}; {expected}", param=param)
    if tensor.dtype not in ACCEPTED_DTYPES:
        raise ApiError(400, f"{param} has dtype {_name(tensor.dtype)}; {expected}", param=param)
    rows, width = tensor.shape
    if width != spec.hidden_size:
        raise ApiError(400, f"{param} has shape {tuple(tensor.shape)}: rows of {width} values, this model's hidden "
                       f"size is {spec.hidden_size}; {expected}", param=param)
    if rows < 1:
        raise ApiError(400, f"{param} has no rows (shape {tuple(tensor.shape)}); {expected}", param=param)
    if rows > spec.max_len:
        raise ApiError(400, f"{param} has {rows} rows; this server takes at most {spec.max_len} tokens per request",
                       param=param, code="context_length_exceeded")
    if not torch.isfinite(tensor).all():
        raise ApiError(400, f"{param} holds NaN or inf; every value must be finite", param=param)
    cast = tensor.to(spec.dtype).contiguous()
    if not torch.isfinite(cast).all():
        raise ApiError(400, f"{param} holds values beyond the range of {_name(spec.dtype)}, the model's dtype",
                       param=param)
    return cast


def completion_input(value, spec: EmbedsSpec) -> RequestInput:
    """/v1/completions' `prompt_embeds` (a string, or a list of one) as the request's input."""
    if isinstance(value, list):
        if len(value) != 1:
            raise ApiError(400, f"{len(value)} prompt_embeds tensors in one request: send one per request",
                           param="prompt_embeds")
        value = value[0]
    return RequestInput.from_embeds(decode(value, spec))


@dataclass(frozen=True)
class ChatEmbeds:
    """A chat's prompt with its embedding and image parts spliced in: `input` for the engine, `text` the
    text parts of the last user message (for the detectors)."""

    input: RequestInput
    text: str


def has_embeds(messages) -> bool:
    """Whether any message (protocol.ChatMessage) has a prompt_embeds content part."""
    return any(isinstance(m.content, list) and any(p.type == "prompt_embeds" for p in m.content) for m in messages)


@dataclass(frozen=True)
class _Image:
    """A decoded image part: its content hash, the encoder's pixels, the client's uuid."""

    content_hash: str
    pixels: torch.Tensor
    uuid: str | None


def chat_input(tokenizer, messages, spec: EmbedsSpec | None, *, image_tokens: int | None = None,
               max_len: int | None = None) -> ChatEmbeds:
    """The chat's prompt (see the module docstring), from protocol.ChatMessage objects with text,
    prompt_embeds and image_url parts (a tokenizing thread: it decodes and renders).

    An image part (kvtui/serve/images.py) takes the same route as a prompt_embeds part: a marker in the
    rendered template, cut out, and `image_tokens` placeholder positions in its place (an ImagePart starting
    at the first). `spec` None: prompt_embeds parts are refused; `image_tokens` None: image parts are.
    `max_len`: the most positions taken (spec.max_len when spec is given).

    Raises:
        ApiError: 400 for a bad part (param messages, or the image part's messages[i].content[j]), tensor
            (param prompt_embeds) or picture, or a template that drops or repeats a part; 413 for a picture
            or tensor too large.
    """
    nonce = secrets.token_hex(8)
    chat, parts, last_user = _marked(messages, spec, image_tokens, nonce)
    template = bool(getattr(tokenizer, "chat_template", None))
    rendered = _render(tokenizer, chat, template)
    marker = re.compile(rf"<\|kvtui-part-{nonce}-(\d+)\|>")
    order = [int(i) for i in marker.findall(rendered)]
    if order != list(range(len(parts))):
        raise ApiError(400, "the model's chat template does not place each prompt_embeds or image part once, in "
                       f"order ({len(parts)} parts, placed {len(order)} times)", param="messages")
    texts = marker.split(rendered)[::2]  # the text pieces around the markers (split also yields the indexes)
    ids: list[int] = []
    is_token: list[bool] = []
    rows: list[torch.Tensor] = []
    images: list[ImagePart] = []
    width = spec.hidden_size if spec is not None else 0
    for i, piece in enumerate(texts):
        special = not template and i == 0  # no template: the first piece is tokenized as a plain prompt
        piece_ids = list(tokenizer.encode(piece, add_special_tokens=special)) if piece or special else []
        ids += piece_ids
        is_token += [True] * len(piece_ids)
        rows.append(torch.zeros(len(piece_ids), width, dtype=spec.dtype if spec else torch.float32))
        if i < len(parts):
            part = parts[i]
            if isinstance(part, _Image):
                images.append(ImagePart(len(ids), image_tokens, part.content_hash, part.pixels, uuid=part.uuid,
                                        label=f"image {len(images)}"))
                ids += [PLACEHOLDER_ID] * image_tokens
                is_token += [True] * image_tokens  # not a supplied row: the image fills it
                rows.append(torch.zeros(image_tokens, width, dtype=spec.dtype if spec else torch.float32))
            else:
                ids += [PLACEHOLDER_ID] * part.shape[0]
                is_token += [False] * part.shape[0]
                rows.append(part)
    limit = spec.max_len if spec is not None else max_len
    if limit is not None and len(ids) > limit:
        raise ApiError(400, f"the prompt holds {len(ids)} positions (text, prompt_embeds rows and images); this "
                       f"server takes at most {limit} tokens per request", param="messages",
                       code="context_length_exceeded")
    if any(not isinstance(p, _Image) for p in parts):
        embeds = RequestInput.from_embeds(torch.cat(rows), token_ids=ids, is_token_ids=is_token)
        return ChatEmbeds(RequestInput(embeds.prompt_ids, embeds=embeds.embeds, images=tuple(images)), last_user)
    return ChatEmbeds(RequestInput(tuple(ids), images=tuple(images)), last_user)


def _marked(messages, spec: EmbedsSpec | None, image_tokens: int | None, nonce: str) -> tuple[list[dict], list, str]:
    """The chat as the template takes it with a marker in place of each prompt_embeds or image part, the
    parts in order (tensors and _Images), and the last user message's text."""
    from kvtui.serve import images as img

    parts: list = []
    chat, last_user = [], ""
    for index, m in enumerate(messages):
        if m.content is None or isinstance(m.content, str):
            text = m.content or ""
            chat.append({"role": m.role, "content": text})
        else:
            pieces, words = [], []
            for j, part in enumerate(m.content):
                if part.type == "text" and part.text is not None:
                    pieces.append(part.text)
                    words.append(part.text)
                    continue
                if part.type == "prompt_embeds":
                    if spec is None:
                        raise ApiError(400, f"{ENABLE_HINT} (it is off on this server)", param="messages")
                    data = getattr(part, "data", None)
                    if not isinstance(data, str) or not data:
                        raise ApiError(400, "a prompt_embeds content part needs `data`: base64 of torch.save bytes "
                                       "of a (num_tokens, hidden_size) tensor", param="messages")
                    parts.append(decode(data, spec))
                elif img.is_image_part(part):
                    param = f"messages[{index}].content[{j}]"
                    if image_tokens is None:
                        raise ApiError(400, f"this model takes no images; {img.NO_IMAGES_HINT}", param=param,
                                       code="model_not_supported")
                    url, uuid = img.part_url_and_uuid(part, param)
                    parts.append(_decoded(img.decode_image(url, f"{param}.image_url.url"), uuid))
                else:
                    raise ApiError(400, f"content part of type {part.type!r} is not supported: send text, "
                                   "image_url or prompt_embeds", param="messages")
                pieces.append(f"<|kvtui-part-{nonce}-{len(parts) - 1}|>")
            chat.append({"role": m.role, "content": "".join(pieces)})
            text = "".join(words)
        if m.role == "user":
            last_user = text
    return chat, parts, last_user


def _decoded(picture, uuid: str | None) -> _Image:
    """A decoded PIL picture as the engine takes it (kvtui.models.dinov2's hash and preprocessing)."""
    from kvtui.models.dinov2 import image_hash, image_tensor

    return _Image(image_hash(picture), image_tensor(picture), uuid)


def _render(tokenizer, chat: list[dict], template: bool) -> str:
    """The chat's prompt text with the assistant turn opened ('role: content' lines without a template)."""
    from jinja2 import TemplateError

    try:
        if template:
            return tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        return "".join(f"{m['role']}: {m['content']}\n" for m in chat) + "assistant:"
    except (TemplateError, ValueError, TypeError, KeyError) as e:
        raise ApiError(400, f"messages: the model's chat template cannot render them ({e})", param="messages") \
            from None
