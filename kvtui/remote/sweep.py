"""`kvtui sweep SCENARIO --target URL`: the same planned requests sent at several arrival rates, one
`--target` run per rate, and where the server stops keeping up (docs/loadgen.md, Sweeps).

Every run sends the scenario's planned requests (same seed: same prompts, lengths and sampling) with
their arrivals re-timed to a Poisson process at the run's rate: one fixed sequence of unit exponential
gaps (drawn from the seed), divided by the rate, the first arrival at 0. Runs differ only in their pace.

The SLO is the scenario's own (`slo: {ttft_s, tpot_s}`, kvtui.metrics.SLO): a request meets it when it
completed within both limits, and a run *holds* it when at least `share` (default 90%) of the requests it
sent did (goodput's requests over all sent: failed and aborted ones count against it). The knee is the
highest rate that still held the SLO; a scenario without an SLO has none, and the throughput knee (the
last rate before output tokens per second stopped rising by more than PLATEAU) stands for it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from kvtui.scenario.plan import derive_seed

PLATEAU = 0.05  # a rate whose throughput rose by no more than this share over the previous rate's: saturated
SLO_SHARE = 0.9  # a run holds the SLO when this share of its requests met it


def retimed(plan: list, rate_per_s: float, seed: int) -> list:
    """`plan` (PlannedRequests, in arrival order) with Poisson arrivals at `rate_per_s` (req/s): the same
    unit exponential gaps for every rate (from `seed`), divided by the rate; the first at 0 s. `process:
    rounds` requests lose their round (they are sent at their times like any other).

    Raises:
        ValueError: a rate that is not above 0.
    """
    if rate_per_s <= 0:
        raise ValueError(f"a sweep's rate must be above 0 req/s, not {rate_per_s:g}")
    rng = random.Random(derive_seed(seed, "sweep_arrivals"))
    ordered = sorted(plan, key=lambda p: (p.arrival_s, p.request_id))
    at, out = 0.0, []
    for k, p in enumerate(ordered):
        if k:
            at += rng.expovariate(1.0) / rate_per_s
        out.append(replace(p, arrival_s=at, round=None))
    return out


@dataclass(frozen=True)
class SweepPoint:
    """One run of a sweep.

    Attributes:
        rate: the rate asked (req/s). achieved: the rate the client sent (req/s, load fidelity), None with
            fewer than two sends.
        sent, completed, good: requests sent; completed (stop or length); completed within the SLO.
        output_tok_s: output tokens per second (throughput); goodput: requests per second within the SLO,
            over the same time as `achieved` (sweep_goodput).
        ttft_p50_s, ttft_p99_s, tpot_p50_s: seconds, None when no request gave one.
        findings: contamination reports that count (not numeric noise). failed: the scenario's `expect`
            did not hold (the exit code's verdict). warning: the load fidelity's warning (docs/loadgen.md).
    """

    rate: float
    achieved: float | None
    sent: int
    completed: int
    good: int
    output_tok_s: float
    goodput: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    findings: int
    failed: bool
    warning: str | None

    @property
    def slo_share(self) -> float:
        """Share of the requests sent that met the SLO (0 with none sent)."""
        return self.good / self.sent if self.sent else 0.0

    def holds(self, share: float = SLO_SHARE) -> bool:
        """The run held the SLO: at least `share` of the requests it sent met it."""
        return self.sent > 0 and self.slo_share >= share - 1e-12


def point(rate: float, summary, contamination, failed: bool, fidelity) -> SweepPoint:
    """The SweepPoint of one finished run: its Summary, its contamination events, its verdict and its
    LoadFidelity (None when nothing was sent)."""
    ttft, tpot = summary.time_to_first_token_seconds, summary.time_per_output_token_seconds
    good = round(summary.goodput_requests_per_s * summary.duration_s)
    sent = fidelity.requests_sent if fidelity is not None else summary.requests_finished
    achieved = fidelity.achieved_rate_per_s if fidelity is not None else None
    return SweepPoint(rate=rate, achieved=achieved, sent=sent, completed=summary.requests_completed, good=good,
                      output_tok_s=summary.output_tokens_per_s, goodput=sweep_goodput(summary, achieved, good, sent),
                      ttft_p50_s=ttft.p50, ttft_p99_s=ttft.p99, tpot_p50_s=tpot.p50,
                      findings=sum(1 for e in contamination if e.counts), failed=failed,
                      warning=fidelity.warning if fidelity is not None else None)


def sweep_goodput(summary, achieved: float | None, good: int, sent: int) -> float:
    """A sweep run's goodput (req/s) over the same time as its achieved rate: the span of the client's sends,
    which `achieved` = (sent - 1) / span counts as sent / T with T = span x sent / (sent - 1); so goodput =
    good / T = achieved x good / sent, never above `achieved`. (The summary's goodput divides by the run's
    duration, to its last answer: a few requests a run could show more goodput than achieved rate.) A run
    of fewer than two sends has no span: the summary's goodput."""
    if achieved is None or not sent:
        return summary.goodput_requests_per_s
    return achieved * good / sent


def slo_knee(points: list[SweepPoint], share: float = SLO_SHARE) -> SweepPoint | None:
    """The highest-rate run that held the SLO, below the first (lowest-rate) run that broke it; None
    when the lowest rate already broke it."""
    knee = None
    for p in sorted(points, key=lambda p: p.rate):
        if not p.holds(share):
            break
        knee = p
    return knee


def throughput_knee(points: list[SweepPoint], plateau: float = PLATEAU) -> SweepPoint | None:
    """The run after which throughput stopped rising: the last rate before the first one whose output
    tokens per second rose by no more than `plateau` (a share) over it; the highest rate when every step
    rose more (no knee reached yet); None without runs."""
    ordered = sorted(points, key=lambda p: p.rate)
    for before, after in zip(ordered, ordered[1:]):
        if after.output_tok_s <= before.output_tok_s * (1 + plateau):
            return before
    return ordered[-1] if ordered else None


def doubling(start: float, max_rate: float) -> list[float]:
    """start, 2 start, 4 start, ... up to `max_rate` (req/s) inclusive."""
    rates, r = [], start
    while r <= max_rate * (1 + 1e-9):
        rates.append(r)
        r *= 2
    return rates
