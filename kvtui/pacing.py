"""The paced clock: the virtual clock held to the wall clock (`--clock paced`).

On the virtual clock every step lasts its modeled duration (kvtui.engine.StepCostModel), so a
scenario's arrivals and timeline land on the same steps on any machine; but nothing ties modeled time
to real time, so a dashboard on it runs as fast as the engine computes. The paced clock keeps the
virtual clock's steps and tokens exactly and adds one rule: the next step starts only once the wall
clock has reached the engine's modeled time. When the engine computes a step faster than modeled,
the run waits (an audience watches the scenario unfold in real time); when it computes slower, the
run goes as fast as it can, the pacer lines the two clocks up again where they are (a slow stretch is
never followed by a rush to catch up), and `pace()` says how far behind real time it runs.

Nothing here touches the engine or the model: the session asks `delay()` before each step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

PACE_WINDOW_S = 3.0  # wall seconds over which pace() is measured
MIN_PACE_SPAN_S = 1.0  # pace() is unknown (None) until the clocks were lined up this long


class Pacer:
    """Holds modeled time (seconds on the virtual clock) to real time.

    Args:
        wall: the real-time source in seconds (time.monotonic); tests pass a fake one.
        sleep: how to wait `s` seconds (time.sleep); tests pass one that moves their fake wall.
        window_s: wall seconds over which `pace()` is measured.
    """

    def __init__(self, wall: Callable[[], float] = time.monotonic, sleep: Callable[[float], object] = time.sleep,
                 window_s: float = PACE_WINDOW_S) -> None:
        self.wall, self.sleep, self.window_s = wall, sleep, window_s
        self._anchor: tuple[float, float] | None = None  # (wall, model) seconds where the clocks were lined up
        self._aligned: deque[tuple[float, float]] = deque()  # recent (wall, model) points with delay() == 0

    def delay(self, model_s: float) -> float:
        """Wall seconds to wait before the engine may go on at modeled time `model_s` (0: go now).

        The first call lines the clocks up (model_s shown now). An engine that is behind is not asked to
        catch up: the clocks are lined up again at (now, model_s)."""
        now = self.wall()
        if self._anchor is None:
            self._anchor = (now, model_s)
        due = self._anchor[0] + (model_s - self._anchor[1])
        if due > now:
            return due - now
        self._anchor = (now, model_s)
        self._aligned.append((now, model_s))
        while len(self._aligned) > 2 and self._aligned[1][0] <= now - self.window_s:
            self._aligned.popleft()
        return 0.0

    def pace(self) -> float | None:
        """Modeled seconds per wall second over the last `window_s` (1.0: real time; 0.6: the engine
        computes 0.6 s of the scenario per second), or None until at least MIN_PACE_SPAN_S is known."""
        if len(self._aligned) < 2:
            return None
        (w0, m0), (w1, m1) = self._aligned[0], self._aligned[-1]
        if w1 - w0 < MIN_PACE_SPAN_S:
            return None
        return (m1 - m0) / (w1 - w0)

    def pause(self) -> None:
        """Stop pacing (a paused dashboard): the next delay() lines the clocks up afresh, and the paused
        time does not count in pace()."""
        self._anchor = None
        self._aligned.clear()

    def resume(self) -> None:
        """Go on after a pause: the clocks line up where they are now (steps taken while paused do not
        make the run wait)."""
        self.pause()
