"""What a person knows a model by, for messages: `default` (and its alias `smollm2`) is SmolLM2-135M-Instruct.
Imports nothing heavy, so scenario validation and the command line's first lines can name a model."""

from __future__ import annotations

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
DEFAULT_ALIASES = ("default", "smollm2")


def model_label(name: str) -> str:
    """The model `name` as messages name it: DEFAULT_MODEL_ID for `default` and `smollm2` (any case), any other
    name or path as given (e.g. "tiny-llama", "./models/my-llama")."""
    return DEFAULT_MODEL_ID if name.lower() in DEFAULT_ALIASES else name
