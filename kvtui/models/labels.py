"""What a person knows a model by, for messages: `default` (and its alias `smollm2`) is SmolLM2-135M-Instruct.
Imports nothing heavy (the model registry holds names and kinds only), so scenario validation and the command
line's first lines can name a model."""

from __future__ import annotations

from kvtui.models import registry

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"


def model_label(name: str) -> str:
    """The model `name` as messages name it: DEFAULT_MODEL_ID for `default` and its aliases (any case), any
    other name or path as given (e.g. "tiny-llama", "./models/my-llama")."""
    return DEFAULT_MODEL_ID if registry.find_model(name) is registry.SMOLLM2 else name
