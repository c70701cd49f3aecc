"""Tiny random-weight test models and their byte-level tokenizer, built in-process.

No file is read and nothing is downloaded. The same name and seed always give bit-identical
weights. Each call builds a fresh model and tokenizer (about 10 ms): nothing is shared between
callers, so a caller that changes, say, `tokenizer.padding_side` cannot affect another.

The weights are drawn with a large `initializer_range` so that logits are well spread (median
top-1/top-2 gap about 1 logit rather than about 0.04 with the usual 0.02): batched-vs-solo greedy
parity tests then do not hinge on a near-tie broken differently by float32 noise (~1e-5).
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from kvtui.models.chat import CHATML_TEMPLATE
from kvtui.models.registry import TINY_GPT2, TINY_LLAMA

DEFAULT_SEED = 1234
# Standard deviation of the random weights. 0.02 (the usual value) gives a median top-1/top-2
# logit gap of ~0.04 (tiny-llama); 0.5 gives ~1 logit, and activations stay far from float16
# overflow. Measured in tests/models/test_models.py::test_tiny_logits_well_spread.
INITIALIZER_RANGE = 0.5

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2 (as in SmolLM2)


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: one token per UTF-8 byte plus the three ChatML special tokens.

    Ids 0-2 are `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`; ids 3-258 are the 256 bytes in
    byte order. Any text round-trips through encode/decode. eos is `<|im_end|>`, pad is
    `<|endoftext|>`, and the chat template is ChatML. Nothing is added around encoded text.
    """
    byte_chars = _byte_chars()
    assert set(byte_chars) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({c: len(SPECIAL_TOKENS) + i for i, c in enumerate(byte_chars)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        model_max_length=2048,
    )
    # SmolLM2's ChatML shape, without SmolLM2's default system message (which would add ~70
    # byte-tokens to every tiny prompt).
    tok.chat_template = CHATML_TEMPLATE
    return tok


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-unicode table (what the ByteLevel pre-tokenizer emits), in byte order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def build_tiny(name: str, *, seed: int = DEFAULT_SEED) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Build a tiny random-weight causal LM and its tokenizer, in float32 on the CPU, eval mode.

    - "tiny-llama": Llama, hidden 64, 2 layers, 4 query heads, 2 KV heads (grouped-query
      attention), head_dim 16, MLP 128, RoPE, 2048 positions, untied lm_head.
    - "tiny-gpt2": GPT-2, hidden 64, 2 layers, 4 heads, 2048 learned positions, tied lm_head.

    Weights come from `torch.manual_seed(seed)` inside a forked RNG, so the caller's global RNG
    state is untouched and the same (name, seed) is bit-identical on every call.

    Raises:
        ValueError: `name` is neither (kvtui.models.registry's TINY_LLAMA and TINY_GPT2).
    """
    tokenizer = build_tiny_tokenizer()
    vocab = len(tokenizer)
    ids = dict(
        bos_token_id=tokenizer.convert_tokens_to_ids(IM_START),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if name == TINY_LLAMA.name:
        config = LlamaConfig(
            vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128, max_position_embeddings=2048,
            initializer_range=INITIALIZER_RANGE, tie_word_embeddings=False, **ids,
        )
        cls = LlamaForCausalLM
    elif name == TINY_GPT2.name:
        config = GPT2Config(
            vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=2048,
            initializer_range=INITIALIZER_RANGE, **ids,
        )
        cls = GPT2LMHeadModel
    else:
        raise ValueError(f"unknown tiny model {name!r}: use one of {TINY_LLAMA.name}, {TINY_GPT2.name}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval(), tokenizer
