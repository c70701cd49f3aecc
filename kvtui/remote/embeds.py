"""Prompt embeddings sent to a target server (`prompts.embeds` scenarios against `kvtui run --target`).

A planned request with an `embeds_mask` (kvtui.scenario.plan) is sent as embedding rows, the rows being
the scenario model's own input embeddings of the prompt's tokens (float32, base64 of torch.save bytes,
as vLLM's `--enable-prompt-embeds` and `kvtui serve --enable-prompt-embeds` take them):

- `embeds: all` (every position a row): /v1/completions with `prompt_embeds` = the rows of the whole
  planned prompt, chat template included (the ids kvtui planned are the rendered chat). The server
  applies no template to prompt_embeds: the model sees exactly the local run's input.
- a mixed mask (`embeds: passphrase`): /v1/completions cannot say which positions are rows, so the chat
  API: one user message whose content is parts, the text before the rows, a `prompt_embeds` part with the
  rows of the masked tokens (the passphrase's), the text after. The server renders its own chat template
  around the parts. vLLM joins a message's parts with "\\n" (vllm/renderers/chat_utils.py), so on vLLM
  the rows stand between two newlines that the plan's prompt does not have; kvtui serve joins them with
  nothing. Either way the prompt is the server's, and the reference run sends the same body.
- `embeds: mask_pairs` cannot be expressed over HTTP (its second request holds the first's tensor with
  every position marked a token id; a request without prompt_embeds parts carries no tensor): refused.

The table is read from kvtui's converted copy of the default model (one safetensors tensor, no model
built), or built in-process for the tiny test models (their weights are seeded, bit-identical on every
build). Any other model is refused: which rows a served model expects is not known to the client.
"""

from __future__ import annotations

import base64
import io

from kvtui.models.registry import SMOLLM2, find_model
from kvtui.models.types import ModelLoadError
from kvtui.request import EmbedsPrompt

EMBEDS_TABLE_KEY = "model.embed_tokens.weight"


def embedding_table(model: str):
    """The [vocab, hidden] float32 input embedding table of `model`: the table of its registry entry's
    `embeds_from` (default and dinov2-smollm2, whose LM is the default model: the default model's; tiny-llama,
    tiny-gpt2: their own).

    Raises:
        ModelLoadError: any other model, or the default model not installed.
    """
    import torch

    entry = find_model(model)
    source = entry.embeds_from if entry is not None else None
    if source is None:
        raise ModelLoadError(f"prompt-embeds scenarios against a --target need the default model (the rows sent "
                             f"are its embedding table's); model {model!r} is not supported there")
    if source != SMOLLM2.name:  # a tiny LM: its seeded weights, built in-process
        from kvtui.models import build_tiny

        return build_tiny(source)[0].get_input_embeddings().weight.detach().to(torch.float32)
    from safetensors import safe_open

    from kvtui.models import default as _default
    from kvtui.models import gguf as _gguf

    sha = _default.DEFAULT_GGUF_SHA256
    _default.default_model_path()  # ModelLoadError (one line, how to install) when the package is missing
    dest = _default.cache_dir() / _gguf.cache_name(_default.DEFAULT_MODEL_ID, sha)
    if not _gguf.is_valid_copy(dest, sha):  # converted once (about 20 s), as every local run does
        from kvtui.models import load_model

        load_model(SMOLLM2.name, progress=False)
    with safe_open(str(dest / "model.safetensors"), framework="pt") as f:
        return f.get_tensor(EMBEDS_TABLE_KEY).to(torch.float32)


def tensor_b64(rows) -> str:
    """base64 of the bytes torch.save writes for `rows` (a dense tensor)."""
    import torch

    buffer = io.BytesIO()
    torch.save(rows.contiguous().clone(), buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def check_expressible(planned) -> None:
    """Refuse a plan that HTTP cannot carry (`embeds: mask_pairs`).

    Raises:
        ValueError: one line naming what cannot be sent.
    """
    if any(isinstance(p.input, EmbedsPrompt) and p.input.rows_of is not None for p in planned):
        raise ValueError("prompts.embeds: mask_pairs cannot be sent to a --target: its second request carries the "
                         "first's tensor with every position marked a token id, which no OpenAI-style request "
                         "expresses; use embeds: all or passphrase")


def is_whole(planned) -> bool:
    """Whether a request's every position is a row (sent to /v1/completions)."""
    return isinstance(planned.input, EmbedsPrompt) and planned.input.whole


def completion_embeds(planned, table) -> str:
    """`prompt_embeds` for /v1/completions: the rows of every planned prompt id."""
    import torch

    return tensor_b64(table[torch.tensor(planned.prompt_ids, dtype=torch.long)])


def chat_parts(planned, tokenizer, table) -> list[dict]:
    """The user message's content parts: the prompt text cut around each run of masked tokens, each run a
    prompt_embeds part of its tokens' rows (see the module docstring).

    Raises:
        ValueError: a run's decoded tokens are not found in the prompt text (in order).
    """
    import torch

    text = planned.text or ""
    ids, mask = list(planned.prompt_ids), planned.input.mask
    runs, start = [], None
    for i, keep in enumerate([*mask, True]):
        if not keep and start is None:
            start = i
        elif keep and start is not None:
            runs.append((start, i))
            start = None
    parts, at = [], 0
    for a, b in runs:
        piece = tokenizer.decode(ids[a:b], skip_special_tokens=False)
        found = text.find(piece, at)
        if found < 0:
            raise ValueError(f"{planned.request_id}: the embedded tokens {piece!r} are not in the prompt text")
        if found > at:
            parts.append({"type": "text", "text": text[at:found]})
        parts.append({"type": "prompt_embeds", "data": tensor_b64(table[torch.tensor(ids[a:b], dtype=torch.long)])})
        at = found + len(piece)
    if at < len(text):
        parts.append({"type": "text", "text": text[at:]})
    return parts
