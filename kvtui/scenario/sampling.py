"""The scenario's per-request sampling parameters: penalties, logit bias, min_tokens and bad words
(OpenAI's and vLLM's names and ranges), for every request or, through `mix`, for a fraction of them.

    sampling:
      temperature: 0.8
      repetition_penalty: 1.1          # every request
      mix:                             # a request takes one entry with its probability, else none
        - {fraction: 0.3, frequency_penalty: 0.5, presence_penalty: 0.5}
        - {fraction: 0.2, logit_bias: {"42": -100}, bad_words: [" the"], min_tokens: 4}
        - {fraction: 0.2, temperature: 0}

An entry's fields replace the section's for the requests that take it. Which entry a request takes
is drawn from the scenario seed's own stream ("sampling_mix"), so the mix does not move the
arrivals, prompts or lengths.
"""

from __future__ import annotations

from typing import Annotated, Any

import pydantic
from pydantic import Field

from kvtui.scenario.base import Strict
from kvtui.scenario.errors import Problem

PENALTY_FIELDS = ("frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                  "bad_words")


def _token_id_keys(value: Any) -> Any:
    """logit_bias keys as OpenAI writes them ("42") or as YAML reads a bare number (42): int token ids."""
    if not isinstance(value, dict):
        return value
    out = {}
    for key, bias in value.items():
        if isinstance(key, str) and key.strip().isdigit():
            key = int(key)
        if not isinstance(key, int) or isinstance(key, bool):
            raise Problem(f"logit_bias key {key!r} is not a token id", 'write token ids as keys, e.g. {"42": -100}')
        out[key] = bias
    return out


Bias = Annotated[float, Field(ge=-100, le=100)]
LogitBias = Annotated[dict[Annotated[int, Field(ge=0)], Bias], Field(max_length=300),
                      pydantic.BeforeValidator(_token_id_keys)]
Words = Annotated[list[Annotated[str, Field(min_length=1, max_length=200)]], Field(max_length=100)]


class PenaltyFields(Strict):
    """The fields a scenario's sampling section and each mix entry share (None: not set here)."""

    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = Field(
        None, description="OpenAI: subtract count x this from each token's logit (counts over the request's own "
                          "output); 0 = off")
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = Field(
        None, description="OpenAI: subtract this from the logit of each token the output already holds; 0 = off")
    repetition_penalty: Annotated[float, Field(gt=0, le=100)] | None = Field(
        None, description="vLLM / HF: divide a positive logit (multiply a negative one) of every token in the "
                          "prompt or output by this; 1 = off")
    logit_bias: LogitBias | None = Field(
        None, description='OpenAI: token id -> bias in [-100, 100] added to its logit, e.g. {"42": -100} bans 42')
    min_tokens: Annotated[int, Field(ge=0, le=100_000)] | None = Field(
        None, description="vLLM: no EOS before this many tokens, and no stop string in their text; above every "
                          "planned request's output length it is refused, above some a warning names how many "
                          "are capped at their length")
    bad_words: Words | None = Field(
        None, description="vLLM: words never to generate (tokenized as written and with a leading space)")


class MixEntry(PenaltyFields):
    """One share of the requests and the sampling they take instead of the section's; a field left
    null takes the section's value."""

    fraction: Annotated[float, Field(gt=0, le=1)] = Field(description="the probability a request takes this entry")
    temperature: Annotated[float, Field(ge=0, le=100)] | None = Field(None, description="0 = greedy")
    top_k: Annotated[int, Field(ge=0, le=1_000_000)] | None = Field(None, description="0 = all")
    top_p: Annotated[float, Field(gt=0, le=1)] | None = Field(None, description="nucleus mass")


Mix = Annotated[list[MixEntry], Field(max_length=64)]


def check_mix(mix: list[MixEntry]) -> list[MixEntry]:
    """Fractions may not add up past 1 (the rest of the requests take none)."""
    total = sum(e.fraction for e in mix)
    if total > 1 + 1e-9:
        raise Problem(f"the mix's fractions add up to {total:g}, more than 1", "lower them so they add up to 1 "
                      "or less (the rest of the requests take no entry)")
    return mix


def vocabulary_problem(section, vocab: int) -> str | None:
    """`field: problem; fix` for the first logit_bias token id at or past `vocab` (tokens), in the
    section or a mix entry; None when every id is in [0, vocab)."""
    places = [("sampling.logit_bias", section.logit_bias)]
    places += [(f"sampling.mix.{i}.logit_bias", entry.logit_bias) for i, entry in enumerate(section.mix)]
    for where, bias in places:
        bad = next((t for t in sorted(bias or {}) if t >= vocab), None)
        if bad is not None:
            return (f"{where}: token id {bad} is outside the model's vocabulary ({vocab} tokens, ids 0 to "
                    f"{vocab - 1}); use token ids of this model's tokenizer")
    return None


def pick_entry(mix, rng) -> MixEntry | None:
    """The entry a request takes (one uniform draw from `rng` per request, also without a mix entry)."""
    u, acc = rng.random(), 0.0
    for entry in mix:
        acc += entry.fraction
        if u < acc:
            return entry
    return None


def asked_min_tokens(section, entry: MixEntry | None) -> int:
    """The min_tokens a request is asked for: its mix entry's when set, else the section's (0 when neither)."""
    value = getattr(entry, "min_tokens", None) if entry is not None else None
    return (section.min_tokens if value is None else value) or 0


def request_fields(section, entry: MixEntry | None, max_new_tokens: int) -> dict:
    """The SamplingParams fields of one request: the section's, with its mix entry's set fields over them."""
    def get(name, default):
        value = getattr(entry, name, None) if entry is not None else None
        if value is None:
            value = getattr(section, name)
        return default if value is None else value

    return dict(
        temperature=get("temperature", 0.0), top_k=get("top_k", 0), top_p=get("top_p", 1.0),
        frequency_penalty=get("frequency_penalty", 0.0), presence_penalty=get("presence_penalty", 0.0),
        repetition_penalty=get("repetition_penalty", 1.0),
        logit_bias=tuple(sorted(get("logit_bias", {}).items())),
        min_tokens=min(asked_min_tokens(section, entry), max_new_tokens), bad_words=tuple(get("bad_words", [])))
