"""Canary text for trace prompts (`prompts: {kind: trace_passphrase}`): a trace's prompt lengths and, for
Mooncake traces, its shared prefixes, made of made-up words and ending with the request's passphrase.

Each Mooncake hash id becomes one block of `block_size` token ids, fixed by the scenario seed and the hash
id alone, so two requests whose hash_ids start with the same ids have exactly the same leading blocks of
token ids, as the trace says their prompts share. The words are lowercase syllables (ka, lo, mi, ...), none
of them a part of a passphrase word, so a model that repeats its prompt never says a passphrase by chance.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from kvtui.scenario.prompts import WORDS, encode_text, to_id_list

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
WORD_POOL = 512  # made-up words the text is drawn from
MAX_BLOCKS_CACHED = 65_536  # hash-id blocks kept after they are made


def made_up_words(count: int = WORD_POOL) -> list[str]:
    """`count` distinct lowercase words of 2 or 3 consonant-vowel syllables, the same on every run, none of
    them inside a passphrase word (kvtui.scenario.prompts.WORDS) or holding one."""
    rng = random.Random(0)
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < count:
        word = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.choice((2, 3))))
        upper = word.upper()
        if word in seen or any(upper in w or w in upper for w in WORDS):
            continue
        seen.add(word)
        out.append(word)
    return out


def encode_piece(tokenizer, text: str) -> list[int]:
    """`text`'s token ids without special tokens (a BOS a Llama tokenizer adds would split the text)."""
    try:
        return to_id_list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:  # a tokenizer without the keyword
        return encode_text(tokenizer, text)


class CanaryText:
    """Token ids of canary text: hash-id blocks and a request's own words.

    Args:
        tokenizer: the scenario model's tokenizer (encode).
        block_seed: hash id -> the seed of its block's words (the scenario's derive_seed of "hash_block:<id>").
        block_size: tokens per hash-id block.
    """

    def __init__(self, tokenizer, block_seed: Callable[[int], int], block_size: int) -> None:
        self.block_seed, self.block_size = block_seed, block_size
        self.words = [encode_piece(tokenizer, " " + w) for w in made_up_words()]
        self.blocks: dict[int, list[int]] = {}

    def words_ids(self, rng: random.Random, n: int) -> list[int]:
        """At least `n` token ids of words drawn by `rng` (whole words; cut them to length)."""
        out: list[int] = []
        while len(out) < n:
            out += rng.choice(self.words)
        return out

    def block(self, hash_id: int) -> list[int]:
        """The block of `block_size` token ids hash id `hash_id` stands for (the same on every call)."""
        if hash_id not in self.blocks:
            if len(self.blocks) >= MAX_BLOCKS_CACHED:
                self.blocks.clear()
            self.blocks[hash_id] = self.words_ids(random.Random(self.block_seed(hash_id)), self.block_size)[
                : self.block_size]
        return self.blocks[hash_id]

    def prompt(self, hash_ids: Sequence[int] | None, length: int, tail: list[int], rng: random.Random) -> list[int]:
        """A prompt of `length` token ids (at least len(tail)): the blocks of `hash_ids`, then words of its own
        drawn by `rng`, cut so that `tail` (the passphrase's part) ends it."""
        body_len = max(length - len(tail), 0)
        body: list[int] = []
        for h in hash_ids or ():
            if len(body) >= body_len:
                break
            body += self.block(h)
        if len(body) < body_len:
            body += self.words_ids(rng, body_len - len(body))
        return body[:body_len] + list(tail)
