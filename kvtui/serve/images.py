"""Images over HTTP: OpenAI's chat content part `{"type": "image_url", "image_url": {"url": "data:..."}}`.

The served model must have an image encoder (`kvtui serve --model dinov2-smollm2`, or its tiny twin
`tiny-vision`); a text model answers 400. Only `data:` URLs are taken: `data:<media type>;base64,<data>`
with media type image/png, image/jpeg, image/webp, image/gif or image/bmp. kvtui fetches nothing over the
network, so an http(s) URL is refused with 400 saying to send the picture inline. `image_url.detail`
is accepted and ignored (every picture becomes one 224 x 224 encoder input); vLLM's optional per-part
`uuid` (its `multi_modal_uuids`) becomes ImagePart.uuid, which the encoder cache trusts only under the
mm_uuid_trusted fault.

Decoding is bounded: the base64 text is checked against MAX_IMAGE_CHARS (413) before it is decoded, and
the picture's width and height, read from its header, against MAX_IMAGE_SIDE each and MAX_IMAGE_PIXELS in
all (400 `image_too_large`) before Pillow decodes its pixels. Both bounds matter: a PNG of 1 x 39,000,000
pixels (151 kB) is under the total, yet its decode, hash and resize took 4.7 s here (AMD EPYC, 2 cores)
and held the GIL for up to 1.8 s at a time, so /health waited behind it; 16384 x 2441, at both bounds,
takes 1.0 s and lets other threads run (gaps of 0.02 s). The decode runs in the server's tokenizing
threads (kvtui/serve/app.py), never on the event loop. Pillow opens the bytes only with the decoders of
the accepted formats, and `.load()` decodes them fully inside the same try, so a truncated or corrupt
file is a 400, never a half-read picture.
Each refusal names the part (`messages[i].content[j]...`) and says what to send.

Where an image goes in the prompt: the chat template is rendered with a marker in the part's place,
exactly as prompt_embeds parts are (kvtui/serve/embeds.py), and the marker becomes IMAGE_TOKENS
placeholder positions (PLACEHOLDER_ID) that the engine fills with the picture's projected rows.
"""

from __future__ import annotations

import base64
import binascii
import io
import re

from kvtui.serve.protocol import ApiError

MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP",
               "image/gif": "GIF", "image/bmp": "BMP"}
FORMATS = tuple(sorted(set(MEDIA_TYPES.values())))  # the only decoders Pillow may use here
MAX_IMAGE_CHARS = 20 * 1024 * 1024  # base64 characters of one picture (about 15 MB of file)
MAX_IMAGE_PIXELS = 40_000_000  # width x height of one picture, checked before its pixels are decoded
MAX_IMAGE_SIDE = 16_384  # width and height each (the picture becomes 224 x 224): see the module docstring
SEND = ("send the picture inline as {\"type\": \"image_url\", \"image_url\": {\"url\": "
        "\"data:image/png;base64,<base64 of the file>\"}} (PNG, JPEG, WebP, GIF or BMP)")
NO_IMAGES_HINT = "start `kvtui serve --model dinov2-smollm2` to send images"
_SPACE = re.compile(r"\s+")


def is_image_part(part) -> bool:
    """Whether a content part (protocol.TextPart) is an image_url part."""
    return part.type == "image_url"


def has_images(messages) -> bool:
    """Whether any message (protocol.ChatMessage) has an image_url content part."""
    return any(isinstance(m.content, list) and any(is_image_part(p) for p in m.content) for m in messages)


def refuse_images(model_name: str, messages) -> None:
    """ApiError 400 naming the first image part: the served model has no image encoder."""
    where = first_image_param(messages)
    raise ApiError(400, f"model `{model_name}` takes no images (it has no image encoder); {NO_IMAGES_HINT}, "
                   "or send text only", param=where, code="model_not_supported")


def first_image_param(messages) -> str:
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            for j, p in enumerate(m.content):
                if is_image_part(p):
                    return f"messages[{i}].content[{j}]"
    return "messages"


def part_url_and_uuid(part, param: str) -> tuple[str, str | None]:
    """An image_url part's URL and its optional uuid (vLLM's field), checked for shape.

    Raises:
        ApiError: 400 naming `param` (the part) when image_url or its url is missing or not a string.
    """
    image_url = getattr(part, "image_url", None)
    if isinstance(image_url, str):  # a bare string, as some clients send it
        url = image_url
    elif isinstance(image_url, dict) and isinstance(image_url.get("url"), str):
        url = image_url["url"]
    else:
        raise ApiError(400, f"an image_url content part needs `image_url`: an object with `url`; {SEND}",
                       param=f"{param}.image_url")
    uuid = getattr(part, "uuid", None)
    if uuid is not None and (not isinstance(uuid, str) or not uuid):
        raise ApiError(400, "an image part's `uuid` must be a non-empty string (an id the client gives the "
                       "picture), or left out", param=f"{param}.uuid")
    return url, uuid


def decode_image(url: str, param: str):
    """The picture in a `data:` URL, fully decoded (a PIL image).

    Raises:
        ApiError: 400 naming `param` for a network URL, a URL that is not base64 data of an accepted image
            type, or bytes Pillow cannot read completely; 400 `image_too_large` for a picture past MAX_IMAGE_SIDE
            a side or MAX_IMAGE_PIXELS in all (read from its header, before any pixel is decoded); 413 for base64
            past MAX_IMAGE_CHARS.
    """
    return _pillow(_data_bytes(url, param), param)


def _data_bytes(url: str, param: str) -> bytes:
    """The file bytes of a base64 `data:` URL of an accepted image type (ApiError otherwise)."""
    head = url[:16].lower()
    if head.startswith(("http://", "https://")):
        raise ApiError(400, f"{param} is a network URL: kvtui fetches nothing over the network; {SEND}", param=param)
    if not head.startswith("data:"):
        raise ApiError(400, f"{param} is not a data: URL; {SEND}", param=param)
    header, comma, data = url[5:].partition(",")
    fields = [f.strip().lower() for f in header.split(";")]
    media = fields[0]
    if not comma or "base64" not in fields[1:]:
        raise ApiError(400, f"{param} is not base64 data (data:<type>;base64,<data>); {SEND}", param=param)
    if media not in MEDIA_TYPES:
        raise ApiError(400, f"{param} has media type {media or '(none)'!r}, not an accepted image type; {SEND}",
                       param=param)
    if len(data) > MAX_IMAGE_CHARS:
        raise ApiError(413, f"{param} holds {len(data)} base64 characters; at most {MAX_IMAGE_CHARS} are taken per "
                       "picture: send a smaller file", param=param, code="request_too_large")
    try:
        raw = base64.b64decode(_SPACE.sub("", data), validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{param} is not valid base64; {SEND}", param=param) from None
    if not raw:
        raise ApiError(400, f"{param} holds no data; {SEND}", param=param)
    return raw


def _pillow(raw: bytes, param: str):
    """The picture in file bytes `raw`, fully decoded by Pillow (ApiError otherwise)."""
    from PIL import Image, UnidentifiedImageError

    image = None
    try:
        image = Image.open(io.BytesIO(raw), formats=FORMATS)
        width, height = image.size  # from the header: nothing is decoded yet
        if max(width, height) > MAX_IMAGE_SIDE or width * height > MAX_IMAGE_PIXELS:
            raise _too_many_pixels(param, f"is {width} x {height} pixels")
        image.load()
    except ApiError:
        raise
    except UnidentifiedImageError:
        raise ApiError(400, f"{param} is not a picture Pillow reads as PNG, JPEG, WebP, GIF or BMP; {SEND}",
                       param=param) from None
    except Image.DecompressionBombError:
        raise _too_many_pixels(param, "decodes to too many pixels") from None
    except Exception as e:  # noqa: BLE001 - truncated or corrupt data: any decoder error
        why = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        kind = getattr(image, "format", None) or "image"
        raise ApiError(400, f"{param} could not be decoded as a complete {kind} picture ({why}); "
                       f"{SEND}", param=param) from None
    return image


def _too_many_pixels(param: str, what: str) -> ApiError:
    """The 400 for a picture past the pixel bounds (`what`: "is W x H pixels")."""
    return ApiError(400, f"{param} {what}; at most {MAX_IMAGE_SIDE} pixels a side and {MAX_IMAGE_PIXELS} in all are "
                    "taken per picture (it is resized to 224 x 224 anyway): send a smaller picture", param=param,
                    code="image_too_large")
