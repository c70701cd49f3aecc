"""Find a spoken passphrase in a transcript.

A passphrase WORD-WORD-NN (e.g. SILVER-RABBIT-19) read aloud comes back from speech recognition as
ordinary text: "The past race is silver rabbit 19." or "... Copper Falcon sixty seven". Matching is
on words: the transcript is lower-cased, every character other than a letter or digit separates
words (so "Falcon," and "sixty-seven" split cleanly), and runs of English number words are read
as one number ("sixty seven" -> 67, "nineteen" -> 19, "a hundred and five" -> 105).

Whisper tiny.en, given espeak-ng's slow speech, writes the number as digits nearly always and
mishears "passphrase" itself almost always ("past race", "past phrase"), so the preamble is not
matched; each passphrase word must come back as a whole word ("orchid" heard as "or Kid" is a miss).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen".split())}
_TENS = {w: 10 * i for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split(), start=2)}
_WORD = re.compile(r"[a-z0-9]+")


def _read_number(words: list[str], i: int) -> tuple[int, int] | None:
    """The number spelled by words[i:], as (value, words used), or None. Reads [units | tens [units]]
    optionally preceded by "[a | UNITS] hundred [and]": 0-999."""
    j, value = i, 0
    if j + 1 < len(words) and words[j + 1] == "hundred" and (words[j] in _UNITS or words[j] == "a"):
        value, j = 100 * _UNITS.get(words[j], 1), j + 2
        if j + 1 < len(words) and words[j] == "and" and (words[j + 1] in _UNITS or words[j + 1] in _TENS):
            j += 1
    if j < len(words) and words[j] in _TENS:
        value, j = value + _TENS[words[j]], j + 1
        if j < len(words) and 0 < _UNITS.get(words[j], 0) < 10:
            value, j = value + _UNITS[words[j]], j + 1
    elif j < len(words) and words[j] in _UNITS:
        value, j = value + _UNITS[words[j]], j + 1
    return (value, j - i) if j > i else None


def _digits(text: str) -> str:
    """A digit string without leading zeros ("07" -> "7", "0" stays)."""
    return text.lstrip("0") or "0"


def spoken_words(transcript: str) -> list[str]:
    """The transcript as lower-case words, with number words folded into digit strings.

    >>> spoken_words("The past race is Copper Falcon, sixty-seven.")
    ['the', 'past', 'race', 'is', 'copper', 'falcon', '67']
    """
    words = _WORD.findall(transcript.lower())
    out, i = [], 0
    while i < len(words):
        number = _read_number(words, i)
        if number is None:
            out.append(_digits(words[i]) if words[i].isdigit() else words[i])
            i += 1
        else:
            out.append(str(number[0]))
            i += number[1]
    return out


@dataclass(frozen=True)
class SpokenMatch:
    """Which parts of a passphrase a transcript holds.

    Attributes:
        passphrase: as given, e.g. "SILVER-RABBIT-19".
        words: one flag per word part (SILVER, RABBIT), in order: found anywhere as a whole word.
        number: the number part (19) found as a number, in digits or in words.
        in_order: every part found, adjacent and in the passphrase's order ("silver rabbit 19").
    """

    passphrase: str
    words: tuple[bool, ...]
    number: bool
    in_order: bool

    @property
    def complete(self) -> bool:
        """Every word and the number came back (in any order)."""
        return all(self.words) and self.number

    @property
    def found(self) -> int:
        """How many parts came back (0 to len(words) + 1)."""
        return sum(self.words) + int(self.number)


def match_spoken(passphrase: str, transcript: str) -> SpokenMatch:
    """Look for passphrase WORD-WORD-NN's parts in a transcript, case- and punctuation-insensitively.

    The passphrase's parts are split on "-"; its last part is the number when it is all digits
    (leading zeros ignored), else every part is a word.

    Raises:
        ValueError: the passphrase has no word or number parts.
    """
    parts = [p for p in re.split(r"[^A-Za-z0-9]+", passphrase.lower()) if p]
    if not parts:
        raise ValueError(f"passphrase {passphrase!r} has no parts: use WORD-WORD-NN")
    number = _digits(parts[-1]) if parts[-1].isdigit() else None
    names = parts[:-1] if number is not None else parts
    heard = spoken_words(transcript)
    wanted = [*names, *([number] if number is not None else [])]
    in_order = any(heard[i:i + len(wanted)] == wanted for i in range(len(heard) - len(wanted) + 1))
    return SpokenMatch(passphrase=passphrase, words=tuple(n in heard for n in names),
                       number=number is not None and number in heard, in_order=in_order)
