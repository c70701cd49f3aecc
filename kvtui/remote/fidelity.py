"""How faithfully a `--target` run's client kept the scenario's schedule (docs/loadgen.md).

A load generator that falls behind its own schedule sends fewer requests per second than asked, later
than planned, and adds its own delay to every latency it reports: the figures then describe the client,
not the server. Each request's planned send time (its arrival on the plan, later by any hold) and its
actual send time (just before its POST goes out) are kept; the wait for a place under --max-concurrency
is the cap's doing and is left out of the lag. From these:

- schedule lag: actual minus planned send time, p50 / p99 / max (seconds);
- requested vs achieved rate: (n - 1) over the span of the planned vs the actual send times (req/s);
- client CPU: the process's CPU seconds (time.process_time: user + system, every thread) over the wall
  seconds since the load began; 1.0 is one core busy throughout (with --workers: the workers' CPU seconds
  summed, the share per worker);
- one warning line when the client rather than the server limited the run: lag p99 over LAG_LIMIT_S, or
  under RATE_SHARE of the requested rate sent (and the sends' span over LAG_LIMIT_S longer than planned,
  so that a handful of requests a few ms apart is no shortfall). When only the cap held requests back,
  the line says so instead (the server's answers set that pace).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvtui.events import LoadFidelity

LAG_LIMIT_S = 0.010  # schedule lag p99 above this: the client could not send on time
RATE_SHARE = 0.98  # achieved under this share of the requested rate: the client fell behind
BUSY_SHARE = 0.5  # a late client that got less than this share of a core was starved by other processes


def quantile(ordered: list[float], q: float) -> float:
    """The q-quantile (0..1) of an ascending list, linear interpolation (numpy's default)."""
    pos = (len(ordered) - 1) * q
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


class FidelityMeter:
    """Collects each request's planned and actual send time; figures() says how faithful the load was.

    Args:
        clock: the run's clock (seconds since the run started).
        cpu: the process CPU clock (seconds); tests pass a fake one.
    """

    def __init__(self, clock: Callable[[], float], cpu: Callable[[], float] = time.process_time) -> None:
        self.clock, self.cpu = clock, cpu
        self.planned: list[float] = []
        self.sent: list[float] = []
        self.lags: list[float] = []
        self.capped = 0
        self.max_concurrency: int | None = None
        self._start_wall: float | None = None
        self._start_cpu = 0.0
        self.senders = 1  # processes whose CPU `cpu` sums (kvtui/remote/workers.py sets it)

    def start(self) -> None:
        """The load begins now (wall and CPU time are counted from here)."""
        self._start_wall, self._start_cpu = self.clock(), self.cpu()

    def cpu_used(self) -> float:
        """CPU seconds used since start() (0.0 before it)."""
        return self.cpu() - self._start_cpu if self._start_wall is not None else 0.0

    def record(self, planned_s: float, sent_s: float, cap_wait_s: float = 0.0) -> float:
        """One request sent: planned and actual send time (seconds on the run's clock) and how long it
        waited for a place under the concurrency cap. Returns its schedule lag (seconds)."""
        lag = sent_s - planned_s - cap_wait_s
        self.planned.append(planned_s)
        self.sent.append(sent_s)
        self.lags.append(lag)
        self.capped += cap_wait_s > 0
        return lag

    def figures(self, t: float) -> LoadFidelity:
        """The figures so far, as the event the run emits (the warning line included)."""
        n = len(self.sent)
        wall = t - self._start_wall if self._start_wall is not None else 0.0
        cpu = self.cpu_used()
        requested = achieved = None
        if n >= 2:
            span = max(self.planned) - min(self.planned)
            requested = (n - 1) / span if span > 0 else None
            actual = max(self.sent) - min(self.sent)
            achieved = (n - 1) / actual if actual > 0 else None
        lags = sorted(self.lags)
        lag = (quantile(lags, 0.5), quantile(lags, 0.99), lags[-1]) if lags else (None, None, None)
        figures = LoadFidelity(t=t, requests_sent=n, capped=self.capped, requested_rate_per_s=requested,
                               achieved_rate_per_s=achieved, lag_p50_s=lag[0], lag_p99_s=lag[1], lag_max_s=lag[2],
                               client_cpu_s=cpu, wall_s=wall, senders=self.senders,
                               client_cpu_share=cpu / wall / self.senders if wall > 0 else None)
        return figures.model_copy(update={"warning": warning(figures, self.max_concurrency)})


def warning(f: LoadFidelity, max_concurrency: int | None = None) -> str | None:
    """The one line saying the client, not the server, limited the run; None when it kept up."""
    late = f.lag_p99_s is not None and f.lag_p99_s > LAG_LIMIT_S
    slow = False
    if f.requested_rate_per_s and f.achieved_rate_per_s:
        # behind by a share of the rate, and by more than the lag limit over the whole span (a few sends
        # a few ms apart are no shortfall)
        behind_s = (f.requests_sent - 1) * (1 / f.achieved_rate_per_s - 1 / f.requested_rate_per_s)
        slow = f.achieved_rate_per_s < RATE_SHARE * f.requested_rate_per_s and behind_s > LAG_LIMIT_S
    if not late and not slow:
        return None
    said = []
    if slow:
        said.append(f"sent {f.achieved_rate_per_s:.1f} of the {f.requested_rate_per_s:.1f} req/s asked")
    if late:
        said.append(f"schedule lag p99 {f.lag_p99_s * 1000:.0f} ms (max {f.lag_max_s * 1000:.0f} ms)")
    cpu = ""
    if f.client_cpu_share is not None:
        cpu = f" at {f.client_cpu_share:.0%} of a core{' each' if f.senders > 1 else ''}" + (
            " (other processes held the CPU: a busy machine)" if f.client_cpu_share < BUSY_SHARE else "")
    if slow and not late and f.capped:
        cap = f" (--max-concurrency {max_concurrency})" if max_concurrency else ""
        return (f"the concurrency cap{cap} held back {f.capped} requests: {'; '.join(said)}; the server's answers "
                "set that pace: raise the cap to offer the full rate")
    return (f"the client limited this run, not the server: {'; '.join(said)}{cpu}; its latencies include the "
            "client's own delay (docs/loadgen.md)")
