"""Per-request token choice: greedy, or seeded temperature / top-k / top-p sampling.

Each sampling request owns a torch.Generator seeded from its SamplingParams.seed and draws exactly
one uniform number per generated token, so its tokens do not depend on its slot, its row or its
neighbours in the batch: the same request run solo draws the same numbers.

The draw is inverse-CDF sampling: the tokens top-k / top-p keep, in descending probability order
(ties by id), tile [0, 1] with intervals as wide as their renormalized probabilities, and the token
whose interval holds the uniform u is chosen. Each sampled token also yields a `Draw` (u, and the
distribution around it), so the reference detector can tell a draw that sat on a boundary which
rounding moved from one that a changed distribution moved (kvtui/detect/reference.py).
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass

import torch

from kvtui.engine.request import SamplingParams

# A Draw keeps the cumulative probability through the ranks at these offsets from the chosen token's
# rank: every rank within 8 (so their intervals are exact), then sparser out to 2048 ranks (brackets:
# in a flat tail a rounding-sized move of the CDF crosses tens, at most measured 174, ranks). It keeps
# the logits of the tokens within DRAW_LOGIT_RANKS ranks of the chosen one and of the DRAW_TOP most
# likely tokens.
CUM_OFFSETS = (-2048, -1536, -1024, -768, -512, -384, -256, -192, -128, -96, -64, -48, -32, -24, -16, -12,
               *range(-9, 9), 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
DRAW_LOGIT_RANKS = 8
DRAW_TOP = 8


@dataclass(frozen=True)
class Draw:
    """One sampled token's uniform and the model's distribution around it.

    Coordinates are the model's own distribution (softmax of logits / temperature) before top-k /
    top-p, by rank (descending probability, ties by id): rank r holds the interval
    [C(r - 1), C(r)] of cumulative probability, C(-1) = 0. The tokens top-k / top-p keep fill
    [0, mass]; the sampler's u picks the rank whose interval holds the draw point u * mass.

    Attributes:
        u: the uniform in [0, 1) (float64) that picked the token.
        mass: probability of the tokens top-k / top-p kept (1.0 when they keep all).
        rank: the chosen token's rank.
        cum: C(rank + offset) for each offset of CUM_OFFSETS (float64; 0 below rank 0, the total past
            the last rank).
        logit_ids, logit_ranks, logits: the tokens within DRAW_LOGIT_RANKS ranks of the chosen one
            and the DRAW_TOP most likely ones, their ranks and their logits (before temperature;
            float32, NaN where not finite).
    """

    u: float
    mass: float
    rank: int
    cum: array
    logit_ids: array
    logit_ranks: array
    logits: array

    @property
    def point(self) -> float:
        """Where the draw falls on the model's cumulative distribution: u * mass (probability)."""
        return self.u * self.mass

    def bounds(self, rank: int) -> tuple[float, float, bool] | None:
        """(low, high, exact): cumulative probabilities around rank `rank`'s interval, exact (the
        interval itself) within 8 ranks of the chosen one, beyond that the nearest kept ranks that
        bracket it; None past the kept offsets."""
        below, above = rank - 1 - self.rank, rank - self.rank
        if below < CUM_OFFSETS[0] or above > CUM_OFFSETS[-1]:
            return None
        low = max(i for i, o in enumerate(CUM_OFFSETS) if o <= below)
        high = min(i for i, o in enumerate(CUM_OFFSETS) if o >= above)
        return self.cum[low], self.cum[high], CUM_OFFSETS[low] == below and CUM_OFFSETS[high] == above

    def logit_of(self) -> dict[int, float]:
        """Listed token id -> logit."""
        return dict(zip(self.logit_ids, self.logits))


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A CPU generator seeded with params.seed, or None for greedy requests."""
    if params.greedy:
        return None
    generator = torch.Generator(device="cpu")
    generator.manual_seed(params.seed)
    return generator


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token id from one row of logits (see draw_token)."""
    return draw_token(logits, params, generator)[0]


def draw_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
               ) -> tuple[int, Draw | None]:
    """Pick the next token id from one row of logits, and say how it was drawn.

    Args:
        logits: [V] logits of the last position of one request (any float dtype; computed in float32).
        params: greedy when temperature == 0, else temperature, top_k, top_p.
        generator: the request's own generator (None for greedy).
    Returns:
        (token id, its Draw; None when greedy). Ties in greedy mode go to the lowest id (torch.argmax).
    Raises:
        ValueError: a sampling request without a generator.
    """
    if params.greedy:
        return int(torch.argmax(logits)), None
    if generator is None:
        raise ValueError("sampling with temperature > 0 needs the request's generator")
    logits = logits.float().cpu()
    scaled = logits / params.temperature
    if not torch.isfinite(scaled).all() and torch.isfinite(logits).all():
        # a temperature so small (1e-300 is 0 in float32) that the division overflows to inf, and softmax
        # to NaN: take the limit instead, every probability on the top logit (shared by exact ties)
        scaled = torch.where(logits == logits.max(), 0.0, -torch.inf)
    probs = torch.softmax(scaled, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if 0 < params.top_k < keep.numel():  # a top_k at or past the vocabulary keeps every token
        keep[params.top_k :] = False
    if params.top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        keep &= before < params.top_p
    u = torch.rand((), generator=generator, dtype=torch.float64).item()
    cum, kept = cumulative(sorted_probs), int(keep.sum())
    index = pick_rank(cum, kept, u)
    return int(order[index]), _draw(u, index, cum, order, kept, logits)


def cumulative(sorted_probs: torch.Tensor) -> torch.Tensor:
    """C(r), the cumulative probability through rank r: [V] float64 from [V] probabilities in
    descending order, divided by their sum so that C(V - 1) = 1 exactly (a float32 softmax sums to
    1 only within its rounding)."""
    cum = torch.cumsum(sorted_probs.double(), dim=0)
    return cum / cum[-1]


def pick_rank(cum: torch.Tensor, kept: int, u: float) -> int:
    """The rank whose interval [C(r - 1), C(r)] holds the draw point u x mass (see Draw): `cum` [V]
    float64 from `cumulative`; the first `kept` ranks are the ones top-k / top-p keep.

    On the very numbers the Draw keeps, on purpose: the sampler used to search a float32 cumulative
    sum, which resolves 1 - C only to about 6e-8, while the Draw kept a float64 one clamped at 1, so
    near the top of the distribution (u = 0.9999996) the rank drawn lay 0.17 log-odds outside its
    own Draw's interval and the reference detector counted a rounding flip as a changed
    distribution."""
    point = u * float(cum[kept - 1])
    index = int(torch.searchsorted(cum[:kept], torch.tensor([point], dtype=torch.float64)))
    return min(index, kept - 1)


def _draw(u: float, index: int, full: torch.Tensor, order: torch.Tensor, kept: int,
          logits: torch.Tensor) -> Draw:
    """The Draw of the token at rank `index` (full: [V] float64 cumulative probability by rank, from
    `cumulative`; kept: how many ranks top-k / top-p kept; logits: [V] float32 in vocabulary order)."""
    ranks = torch.tensor([index + o for o in CUM_OFFSETS]).clamp(max=len(full) - 1)
    cum = torch.where(ranks < 0, torch.zeros((), dtype=full.dtype), full[ranks.clamp(min=0)])
    ranks = sorted(set(range(min(DRAW_TOP, len(order)))) |
                   set(range(max(index - DRAW_LOGIT_RANKS, 0), min(index + DRAW_LOGIT_RANKS + 1, len(order)))))
    listed = order[torch.tensor(ranks)]
    values = logits[listed].tolist()
    return Draw(u, float(full[kept - 1]), index, array("d", cum.tolist()), array("i", listed.tolist()),
                array("i", ranks), array("f", [v if math.isfinite(v) else math.nan for v in values]))


def bad_words_token_ids(tokenizer, words) -> tuple[tuple[int, ...], ...]:
    """Token sequences of `bad_words`, as vLLM builds them (SamplingParams.update_from_tokenizer): each
    word as written (leading spaces stripped), and with a leading space when that gives a different
    first token and as many tokens, so a word is banned at the start of the text and after a space.
    No special tokens. Words that tokenize to nothing are left out."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            continue
        out.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(dict.fromkeys(out))


def resolve_bad_words(params: SamplingParams, tokenizer) -> SamplingParams:
    """`params` with bad_words_ids filled from its bad_words (unchanged when it has none, or has ids)."""
    if not params.bad_words or params.bad_words_ids:
        return params
    return SamplingParams(**{**params.__dict__, "bad_words_ids": bad_words_token_ids(tokenizer, params.bad_words)})
