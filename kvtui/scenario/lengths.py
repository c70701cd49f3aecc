"""Token-length distributions for prompt and output lengths (tokens).

Each is a small frozen pydantic model with `sample(rng) -> int`, drawn from a `random.Random` the
caller seeds, so a scenario seed fixes every length. Values are rounded to whole tokens and clipped to
[min, max] where the distribution has bounds.

YAML: `{dist: fixed, value: 24}`, `{dist: uniform, min: 8, max: 64}`,
`{dist: normal, mean: 128, stdev: 32, min: 1, max: 512}`, `{dist: lognormal, mean: 128, sigma: 0.8}`,
`{dist: choice, values: [16, 256], weights: [3, 1]}`, `{dist: zipf, a: 1.2, min: 1, max: 512}`;
a bare integer `24` means `{dist: fixed, value: 24}`.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import random
from typing import Annotated, Literal, Union

import pydantic
from pydantic import Field

from kvtui.scenario.base import Strict
from kvtui.scenario.errors import Problem

MAX_TOKENS = 1_000_000  # upper bound on any length (tokens); keeps zipf tables and prompts finite
Tokens = Annotated[int, Field(ge=1, le=MAX_TOKENS)]


class _Bounded(Strict):
    min: Tokens = Field(1, description="smallest length drawn (tokens); draws below are raised to it")
    max: Tokens = Field(MAX_TOKENS, description="largest length drawn (tokens); draws above are cut to it")

    @pydantic.model_validator(mode="after")
    def _ordered(self):
        if self.min > self.max:
            raise Problem(f"min ({self.min}) is above max ({self.max})", "make min <= max", ("min",))
        return self

    def clip(self, x: float) -> int:
        return max(self.min, min(self.max, int(round(x))))


class Fixed(Strict):
    """Always `value` tokens."""

    dist: Literal["fixed"] = "fixed"
    value: Tokens = Field(description="the length (tokens)")

    def sample(self, rng: random.Random) -> int:
        return self.value


class Uniform(_Bounded):
    """Whole numbers in [min, max], each equally likely."""

    dist: Literal["uniform"] = "uniform"
    min: Tokens = Field(description="shortest length (tokens)")
    max: Tokens = Field(description="longest length (tokens), at least min")

    def sample(self, rng: random.Random) -> int:
        return self.min + int(rng.random() * (self.max - self.min + 1))


class Normal(_Bounded):
    """Normal(mean, stdev) rounded and clipped to [min, max]."""

    dist: Literal["normal"] = "normal"
    mean: Annotated[float, Field(gt=0, le=MAX_TOKENS)] = Field(description="mean length (tokens)")
    stdev: Annotated[float, Field(ge=0, le=MAX_TOKENS)] = Field(description="standard deviation (tokens)")

    def sample(self, rng: random.Random) -> int:
        return self.clip(rng.gauss(self.mean, self.stdev))


class LogNormal(_Bounded):
    """Log-normal with the given `mean` (tokens, before clipping) and `sigma` (stdev of the log).

    The log's mean is mu = ln(mean) - sigma^2 / 2, so E[length] = mean. Long right tail: the shape of
    real chat prompt/answer lengths (sigma 0.5 mild, 1.0 heavy).
    """

    dist: Literal["lognormal"] = "lognormal"
    mean: Annotated[float, Field(gt=0, le=MAX_TOKENS)] = Field(description="mean length before clipping (tokens)")
    sigma: Annotated[float, Field(ge=0, le=4)] = Field(
        description="standard deviation of the length's logarithm: 0.5 a mild tail, 1.0 a heavy one")

    def sample(self, rng: random.Random) -> int:
        mu = math.log(self.mean) - self.sigma**2 / 2
        return self.clip(rng.lognormvariate(mu, self.sigma))


class Choice(Strict):
    """One of `values`, with optional relative `weights` (default all equal)."""

    dist: Literal["choice"] = "choice"
    values: Annotated[list[Tokens], Field(min_length=1, max_length=10_000)] = Field(
        description="the lengths to choose from (tokens)")
    weights: Annotated[list[Annotated[float, Field(ge=0)]], Field(min_length=1, max_length=10_000)] | None = Field(
        None, description="relative weight of each value, one per value; null = all equal")

    @pydantic.model_validator(mode="after")
    def _weights(self):
        if self.weights is not None:
            if len(self.weights) != len(self.values):
                raise Problem(f"{len(self.weights)} weights for {len(self.values)} values",
                              "give one weight per value", ("weights",))
            if sum(self.weights) <= 0:
                raise Problem("weights sum to 0", "give at least one positive weight", ("weights",))
        return self

    def sample(self, rng: random.Random) -> int:
        cum = list(itertools.accumulate(self.weights or [1.0] * len(self.values)))
        return self.values[min(bisect.bisect_right(cum, rng.random() * cum[-1]), len(self.values) - 1)]


class Zipf(_Bounded):
    """Bounded Zipf: P(min + k) proportional to (k + 1)^-a for k = 0 .. max - min. Most lengths near
    `min`, a few very long (a ~ 1 heavy tail, a >= 2 light)."""

    dist: Literal["zipf"] = "zipf"
    a: Annotated[float, Field(gt=0, le=10)] = Field(description="exponent: about 1 a heavy tail, 2 or more a light one")
    max: Annotated[int, Field(ge=1, le=100_000)] = Field(description="longest length (tokens)")

    def sample(self, rng: random.Random) -> int:
        cum = _zipf_cdf(self.a, self.max - self.min + 1)
        return self.min + min(bisect.bisect_left(cum, rng.random() * cum[-1]), len(cum) - 1)


@functools.lru_cache(maxsize=16)
def _zipf_cdf(a: float, n: int) -> list[float]:
    return list(itertools.accumulate(k**-a for k in range(1, n + 1)))


def _shorthand(value: object) -> object:
    """`24` -> {dist: fixed, value: 24}."""
    if isinstance(value, int) and not isinstance(value, bool):
        return {"dist": "fixed", "value": value}
    return value


LengthDist = Annotated[
    Union[Fixed, Uniform, Normal, LogNormal, Choice, Zipf],
    Field(discriminator="dist"),
    pydantic.BeforeValidator(_shorthand),
]
DIST_NAMES = ("fixed", "uniform", "normal", "lognormal", "choice", "zipf")
