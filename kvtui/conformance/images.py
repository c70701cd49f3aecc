"""The image check: whether the server takes image parts at all. kvtui's client sends no image parts
with its audits yet (kvtui/target/session.py refuses image prompts), so a server that takes images is
reported n/a with that reason rather than judged; a server that refuses them is n/a with its answer."""

from __future__ import annotations

import base64
import io

from kvtui.conformance.base import CheckResult, Server, not_applicable, refusal
from kvtui.target.openai import CHAT_PATH

IMAGES = "images"
TITLE = "images"


def _png() -> str:
    """A 16 x 16 grey PNG as a data URL."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (128, 128, 128)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def images(server: Server) -> CheckResult:
    """One chat request with an inline image_url part; n/a either way (see the module docstring)."""
    sent = "1 chat request with an inline 16 x 16 PNG image_url part"
    server.say(f"images: {sent}")
    content = [{"type": "text", "text": "What is in the picture?"}, {"type": "image_url", "image_url": {"url": _png()}}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4}
    if server.served_model:
        body["model"] = server.served_model
    with server.client() as client:
        r = client.post(CHAT_PATH, json=server.uncached(body))
    if r.status_code >= 400:
        return not_applicable(IMAGES, TITLE, sent, f"the server takes no images: {refusal(r)}")
    return not_applicable(IMAGES, TITLE, sent, "the server took the image (HTTP 200), but kvtui has no image "
                          "isolation audit of a server yet (its client sends no image prompts with a scenario)")
