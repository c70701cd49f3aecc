"""Tokenizer fix-ups shared by every loader: chat template, pad token, end-of-sequence ids."""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerBase

IM_END = "<|im_end|>"

# Plain ChatML, for a model that ships no chat template of its own.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase, fallback_template: str = CHATML_TEMPLATE) -> None:
    """Give `tokenizer` a chat template (`fallback_template` if it has none) and a pad token
    (its eos token if it has none). Changes the tokenizer in place."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = fallback_template
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """End-of-sequence ids: the generation config's, the tokenizer's eos, and `<|im_end|>` when
    the chat template ends turns with it. Order kept, duplicates dropped.

    Also writes the result back to `model.generation_config.eos_token_id` (and fills a missing
    pad_token_id) so that `model.generate` stops on the same ids.
    """
    ids: list[int] = []
    gen = model.generation_config
    configured = gen.eos_token_id if gen is not None else None
    for value in (configured if isinstance(configured, (list, tuple)) else [configured]):
        if value is not None and value >= 0:
            ids.append(int(value))
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    template = getattr(tokenizer, "chat_template", None) or ""
    if IM_END in template:
        im_end = tokenizer.get_vocab().get(IM_END)
        if im_end is not None:
            ids.append(int(im_end))
    unique = tuple(dict.fromkeys(ids))
    if gen is not None and unique:
        gen.eos_token_id = unique[0] if len(unique) == 1 else list(unique)
        if gen.pad_token_id is None and tokenizer.pad_token_id is not None:
            gen.pad_token_id = tokenizer.pad_token_id
    return unique
