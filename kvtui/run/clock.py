"""The local run's clock: which clock a Session runs on, its time, the dashboard's pause and the paced
clock's hold to the wall.

Three clocks: "virtual" (modeled step times, deterministic: headless runs), "paced" (the virtual clock's
steps and tokens, each step started no earlier than its modeled time on the wall clock:
kvtui/pacing.py) and "wall" (real time). The engine keeps the time (Engine.now); this module only says
how the run waits on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from kvtui.pacing import Pacer

MODELED_CLOCKS = ("virtual", "paced")  # clocks whose times are modeled (paced: virtual, held to the wall)
CLOCKS = ("wall", *MODELED_CLOCKS)
# what the header calls measured on every clock, and modeled on a modeled clock
MEASURED = ("step.wall_s", "summary.measured_step_wall_s")
MODELED_VIRTUAL = ("t", "start_s", "arrival_s", "scheduled_s", "first_token_s", "finish_s", "token_times_s",
                   "all latencies and tokens/s in the summary")


def check_clock(name: str) -> str:
    """`name` when it names a clock (CLOCKS).

    Raises:
        ValueError: another name.
    """
    if name not in CLOCKS:
        raise ValueError(f"clock {name!r}: use 'virtual', 'paced' or 'wall'")
    return name


def engine_clock(name: str) -> str:
    """The clock the engine itself runs on: the virtual clock for the paced clock too (the pacer only
    waits)."""
    return "virtual" if name in MODELED_CLOCKS else name


class RunClock:
    """A Session's clock.

    Args:
        name: one of CLOCKS (checked with check_clock first).
        engine: the kvtui.engine.Engine whose clock it is (`now`, `pause_clock`, `resume_clock`).
        pacer: the paced clock's Pacer (None: a real one on the paced clock); ignored by other clocks.
        spend: how the paced clock spends a wait: called with `until()`, the test that says the wait
            is over, before the rest is slept (the Session runs waiting reference checks then).
    """

    def __init__(self, name: str, engine, pacer: Pacer | None = None,
                 spend: Callable[[Callable[[], bool]], None] = lambda until: None) -> None:
        self.name, self.engine = name, engine
        self.pacer = (pacer or Pacer()) if name == "paced" else None
        self._spend = spend

    @property
    def modeled(self) -> bool:
        """Whether the run's times are modeled (virtual, paced), not measured."""
        return self.name in MODELED_CLOCKS

    def now(self) -> float:
        """Seconds on the engine's clock."""
        return self.engine.now()

    def pause(self) -> None:
        """Wall clock: stop the run's clock (a paused dashboard); steps taken while paused advance it
        by their own duration only (see Engine.pause_clock). Paced clock: stop pacing."""
        self.engine.pause_clock()
        if self.pacer is not None:
            self.pacer.pause()

    def resume(self) -> None:
        """Wall clock: let the run's clock go on from where it stopped. Paced clock: pace again from the
        engine's time now."""
        self.engine.resume_clock()
        if self.pacer is not None:
            self.pacer.resume()

    def hold_for_wall(self, max_wait_s: float = math.inf, wait: Callable[[float], object] | None = None) -> float:
        """Paced clock: wait until the wall clock reaches the engine's modeled time, `max_wait_s` at most,
        spending the wait (`spend`) first. Returns the seconds still to wait (0: the next step may
        start); other clocks return 0 at once.

        Args:
            max_wait_s: the longest wait in one call (a caller that must stay responsive waits in slices).
            wait: how to wait the rest (default: the pacer's sleep); the dashboard passes an event's
                wait, so a key press ends the wait early.
        """
        pacer = self.pacer
        if pacer is None:
            return 0.0
        delay = pacer.delay(self.engine.now())
        if delay <= 0:
            return 0.0
        deadline = pacer.wall() + min(delay, max_wait_s)
        self._spend(lambda: pacer.wall() >= deadline)
        left = deadline - pacer.wall()
        if left > 0:
            (wait or pacer.sleep)(left)
        return pacer.delay(self.engine.now())
