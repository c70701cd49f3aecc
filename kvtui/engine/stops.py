"""Stop strings, searched as vLLM's V1 detokenizer searches them (vllm/v1/engine/detokenizer.py,
`BaseIncrementalDetokenizer.update` and `check_stop_strings`).

After each generated token the request's text is searched only where a stop string could newly end:
the characters that token added, plus the `len(stop) - 1` characters before them (a stop string
split across tokens). Text that an earlier check already searched is never searched again, so a stop
string is found once, at the token that completes it.

Under `min_tokens` nothing is checked until the request has more than `min_tokens` tokens, and the
text of its first `min_tokens` tokens counts as already searched: a stop string that occurs there does
not end the request and does not cut its text, at that token or later (only one that reaches into the
text after it, by the overlap above, can).

Among the stop strings found in one check the first in the request's list wins (vLLM's order), at its
first occurrence in the searched part. The returned text ends before it, or after it with
include_stop_str_in_output.

The text is what the decoder holds settled: a trailing U+FFFD (a character whose bytes are split
across tokens) is held back until the character completes, as vLLM's incremental detokenizer holds it.
The engine (engine/output.py) and the server's streamed text (serve/detok.py) both use StopScan, so a
stream stops where the whole answer does.
"""

from __future__ import annotations

from dataclasses import dataclass

REPLACEMENT = "\ufffd"


def settled(text: str) -> str:
    """`text` without a trailing partial character (U+FFFD), the part an incremental decoder has emitted."""
    return text.rstrip(REPLACEMENT)


def find_stop(text: str, searched: int, stops: tuple[str, ...], include: bool) -> tuple[str, int] | None:
    """vLLM's check_stop_strings: the first of `stops` (in list order) that occurs in `text` ending past
    its first `searched` characters, as (stop string, where the returned text ends), or None.

    Args:
        text: the request's settled text so far; searched: how many of its characters earlier checks
            searched; stops: the stop strings; include: include_stop_str_in_output (the returned text
            ends after the stop string instead of before it).
    """
    if searched >= len(text):
        return None
    for stop in stops:
        index = text.find(stop, max(0, searched - len(stop) + 1))
        if index >= 0:
            return stop, index + len(stop) if include else index
    return None


@dataclass
class StopScan:
    """One sequence's stop-string search, token by token (see the module docstring).

    Args:
        stops: the stop strings; min_tokens: tokens before any check; include:
            include_stop_str_in_output.

    Attributes:
        searched: characters of the settled text already searched (or passed over under min_tokens).
    """

    stops: tuple[str, ...]
    min_tokens: int = 0
    include: bool = False
    searched: int = 0

    def update(self, text: str, tokens: int) -> tuple[str, int] | None:
        """Check the text after a token: `text` the sequence's decoded text after its first `tokens`
        tokens (trailing partial characters are held back here). Returns (stop string, where the
        returned text ends) when a stop string completes at this token, else None."""
        text = settled(text)
        start, self.searched = self.searched, len(text)
        if not self.stops or tokens <= self.min_tokens:
            return None
        return find_stop(text, start, self.stops, self.include)
