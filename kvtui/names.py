"""Suggesting the name a user meant: the one rule every place that takes a name from a list uses (fault,
model, detector, option choice, scenario field or file), so a typo gets the same hint everywhere."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(word: object, choices: Iterable[str]) -> str | None:
    """The choice closest to `word` (difflib's ratio at least 0.6), or None (also for a word that is not text)."""
    if not isinstance(word, str):
        return None
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(word: object, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for a close match of `word` among `choices`, else ''."""
    close = closest(word, choices)
    return f" (did you mean '{close}'?)" if close else ""
