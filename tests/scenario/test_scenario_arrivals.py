"""Arrival processes and length distributions hit their rates, burstiness and means (fixed seeds).

Tolerances are several standard errors wide for the sample sizes used (noted per test), so the
fixed-seed results are far from the edges.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from kvtui.scenario import parse_scenario
from kvtui.scenario.arrivals import Gamma, Poisson, Segment, arrivals, rate_times, segments

N = 20_000


def gaps(spec, seed: int, n: int = N, changes=()) -> list[float]:
    times = [a.at_s for a in itertools.islice(arrivals(spec, random.Random(seed), changes), n)]
    assert times == sorted(times)
    return [b - a for a, b in zip(times, times[1:])]


def cv(xs: list[float]) -> float:
    return statistics.pstdev(xs) / statistics.fmean(xs)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_poisson_rate_and_cv(seed):
    g = gaps(Poisson(process="poisson", rate_per_s=4.0), seed)
    # mean gap SE = 0.25 / sqrt(N) = 0.7%; CV SE ~ 1%
    assert statistics.fmean(g) == pytest.approx(0.25, rel=0.03)
    assert cv(g) == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("burstiness,tol", [(0.25, 0.10), (0.5, 0.06), (1.0, 0.05), (4.0, 0.05)])
def test_gamma_burstiness_sets_cv(seed, burstiness, tol):
    """vLLM benchmark_serving: shape = burstiness, scale = 1/(rate * burstiness): the mean gap stays
    1/rate and the CV of the gaps is 1/sqrt(burstiness)."""
    g = gaps(Gamma(process="gamma", rate_per_s=10.0, burstiness=burstiness), seed)
    assert statistics.fmean(g) == pytest.approx(0.1, rel=tol)
    assert cv(g) == pytest.approx(1 / math.sqrt(burstiness), rel=tol)


def test_first_arrival_at_zero_like_vllm():
    for spec in (Poisson(process="poisson", rate_per_s=3.0), Gamma(process="gamma", rate_per_s=3.0, burstiness=0.3)):
        assert next(arrivals(spec, random.Random(5))).at_s == 0.0


def test_constant_is_exact():
    s = parse_scenario("max_requests: 5\narrivals: {process: constant, rate_per_s: 4}")
    times = [a.at_s for a in itertools.islice(arrivals(s.arrivals, random.Random(0)), 5)]
    assert times == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])


def test_burst_groups():
    s = parse_scenario("max_requests: 9\narrivals: {process: burst, size: 3, every_s: 2.5}")
    times = [a.at_s for a in itertools.islice(arrivals(s.arrivals, random.Random(0)), 9)]
    assert times == [0.0] * 3 + [2.5] * 3 + [5.0] * 3


def test_stages_piecewise_rate():
    s = parse_scenario("arrivals:\n  process: poisson\n  stages:\n"
                       "    - {rate_per_s: 20, duration_s: 100}\n    - {rate_per_s: 0, duration_s: 10}\n"
                       "    - {rate_per_s: 60, duration_s: 100}\n")
    times = [a.at_s for a in arrivals(s.arrivals, random.Random(3))]  # finite: stages end
    counts = [sum(lo <= t < hi for t in times) for lo, hi in ((0, 100), (100, 110), (110, 210))]
    # Poisson counts: 2000 +- 45, 0, 6000 +- 77
    assert counts[0] == pytest.approx(2000, rel=0.06)
    assert counts[1] == 0
    assert counts[2] == pytest.approx(6000, rel=0.05)
    assert max(times) < 210


def test_timeline_rate_change_splits_segments():
    spec = Poisson(process="poisson", rate_per_s=5.0)
    segs = segments(spec, [(10.0, {"rate_per_s": 50.0}), (20.0, {"rate_per_s": 0.0})])
    assert segs == [Segment(0, 10, 5.0), Segment(10, 20, 50.0), Segment(20, math.inf, 0.0)]
    times = list(rate_times("poisson", segs, random.Random(1)))  # ends: rate 0 forever after 20 s
    assert sum(t < 10 for t in times) == pytest.approx(50, abs=30)
    assert sum(10 <= t < 20 for t in times) == pytest.approx(500, rel=0.15)
    assert max(times) < 20


def test_gamma_burstiness_change():
    spec = Gamma(process="gamma", rate_per_s=100.0, burstiness=4.0)
    times = list(itertools.islice(
        rate_times("gamma", segments(spec, [(50.0, {"burstiness": 0.25})]), random.Random(2)), 10_000))
    early = [b - a for a, b in zip(times, times[1:]) if b < 50]
    late = [b - a for a, b in zip(times, times[1:]) if a > 50]
    assert cv(early) == pytest.approx(0.5, rel=0.1)
    assert cv(late) == pytest.approx(2.0, rel=0.15)


def test_same_seed_same_times_other_seed_different():
    spec = Gamma(process="gamma", rate_per_s=3.0, burstiness=0.5)
    assert gaps(spec, 7, 100) == gaps(spec, 7, 100)
    assert gaps(spec, 7, 100) != gaps(spec, 8, 100)


def draws(dist_yaml: str, n: int = N, seed: int = 0) -> list[int]:
    dist = parse_scenario(f"max_requests: 1\noutput_tokens: {dist_yaml}").output_tokens
    rng = random.Random(seed)
    return [dist.sample(rng) for _ in range(n)]


def test_fixed_and_shorthand():
    assert set(draws("{dist: fixed, value: 7}", 100)) == {7}
    assert set(draws("9", 100)) == {9}


def test_uniform_covers_range():
    xs = draws("{dist: uniform, min: 4, max: 12}")
    assert set(xs) == set(range(4, 13))
    assert statistics.fmean(xs) == pytest.approx(8, rel=0.02)


def test_normal_mean_and_clip():
    xs = draws("{dist: normal, mean: 100, stdev: 20, min: 90, max: 1000}")
    assert min(xs) == 90  # clipped
    xs = draws("{dist: normal, mean: 100, stdev: 20}")
    assert statistics.fmean(xs) == pytest.approx(100, rel=0.01)  # SE 0.14
    assert statistics.pstdev(xs) == pytest.approx(20, rel=0.03)


def test_lognormal_mean_is_the_given_mean():
    xs = draws("{dist: lognormal, mean: 200, sigma: 0.8}")
    assert statistics.fmean(xs) == pytest.approx(200, rel=0.03)  # SE ~0.6%
    assert statistics.median(xs) < 200  # right tail


def test_choice_weights():
    xs = draws("{dist: choice, values: [16, 256], weights: [3, 1]}")
    assert xs.count(16) / len(xs) == pytest.approx(0.75, abs=0.02)
    assert set(draws("{dist: choice, values: [5]}", 50)) == {5}


def test_zipf_ratio():
    xs = draws("{dist: zipf, a: 1.0, min: 10, max: 500}")
    assert min(xs) >= 10 and max(xs) <= 500
    assert xs.count(10) / xs.count(11) == pytest.approx(2.0, rel=0.1)  # (1/1) / (1/2)
