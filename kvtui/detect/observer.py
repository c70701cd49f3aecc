"""What a detector sees of a run, as an observer (kvtui/run/observers.py names the protocol and builds
the run's observers): one record per moment a run shows its observers, the same for a local run
(kvtui/session.py) and a run against a server (kvtui/remote/session.py), and `Quiet`, the base that
answers every moment an observer does not watch with no events.

An observer returns its events; the run emits them, in the order its observers are listed. Nothing here
imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Arrival:
    """A request (one sequence of it: n > 1 sends one per sequence) was handed to the engine or server.

    Attributes:
        request_id: the request (sequence) id.
        passphrase: its canary passphrase, or None.
        spoken: the passphrase is spoken in its audio clip (a speech model's transcript says it).
        input_key: its input's content key (kvtui.engine.inputs.RequestInput.content_key: a speech
            request's audio hash), None when not known (a target run).
        sampling: the SamplingParams it runs under (as the engine runs it: a capped max_new_tokens
            included), None when not known.
        same_as: a later turn of a session: the session's first request, whose passphrase it carries (it is
            then no source of its own); None otherwise.
    """

    request_id: str
    passphrase: str | None = None
    spoken: bool = False
    input_key: str | None = None
    sampling: object = None
    same_as: str | None = None


@dataclass(frozen=True)
class StepSeen:
    """One engine step (a local run), or one streamed chunk (a target run: no engine step).

    Attributes:
        t: seconds on the run's clock.
        step: the engine step number; -1 for a target run's chunk.
        pieces: (request id, new text) for each token the step sampled, in batch order (a target run:
            the chunk's text).
        report: the engine's StepEvent (kvtui.events; None for a target run).
    """

    t: float
    step: int
    pieces: Sequence[tuple[str, str]] = ()
    report: object = None


@dataclass(frozen=True)
class Finished:
    """A request left the engine or server; an observer's events on it are emitted before its
    request.finish event.

    Attributes:
        request_id: the request (sequence) id.
        text: its whole answer.
        t: seconds on the run's clock; step: the engine step it finished in (-1 for a target run).
        finish_reason: as its request.finish event says ("rejected": it never ran).
        completed: it finished normally with an answer (kvtui.events.Finish.completed).
        request: the engine's FinishedRequest (kvtui/engine/report.py: prompt and output ids, top-2
            gaps, sampling, draws, faults, input), None for a target run.
        trail: what it met while running (kvtui/run/trails.py Trails.pop: the step of each of its
            tokens, the requests co-batched at each, its slot's earlier owners), None for a target run.
    """

    request_id: str
    text: str
    t: float
    step: int
    finish_reason: str
    completed: bool = False
    request: object = None
    trail: tuple | None = None


@dataclass(frozen=True)
class DrainBudget:
    """How much deferred work (the reference detector's solo checks) one `drain` may do.

    Attributes:
        now: seconds on the run's clock, read for the time each batch's reports carry.
        limit: requests to check at most (None: every waiting one).
        should_stop: turns true to end the drain between two steps of the work (a stop, new work
            arriving, a deadline); the unchecked stay waiting.
        on_checked: hears each checked request's reports as soon as it is compared (the run emits them
            and shows progress); None: the reports are returned.
    """

    now: Callable[[], float]
    limit: int | None = None
    should_stop: Callable[[], bool] = lambda: False
    on_checked: Callable[[list], None] | None = None


class Quiet:
    """An observer's defaults: no events at any moment, nothing waiting, no counts. A detector's
    observer derives from it and overrides the moments it watches.

    Attributes:
        name: the observer's name (a detector name; "engine" for the engine's own signals).
        pending: deferred work waiting for `drain` (requests to check); 0 here.
        batch: how many of those one drain step takes together; 1 here.
    """

    name = ""
    pending = 0
    batch = 1

    def on_arrive(self, arrival: Arrival) -> list:
        """Reports on a request's arrival (none here)."""
        return []

    def on_step(self, step: StepSeen) -> list:
        """Reports on one step's state and new text (none here)."""
        return []

    def on_finish(self, finished: Finished) -> list:
        """Reports on a request's final text (none here); forget what was kept for it."""
        return []

    def drain(self, budget: DrainBudget) -> list:
        """Do deferred work within `budget`; returns its reports (none here)."""
        return []

    def counts(self) -> dict | None:
        """The reference.status fields this observer keeps (checked, skipped_by_reason, pending), or
        None: it keeps none."""
        return None

    def skip_pending(self) -> int:
        """Give up the waiting work (the run closes after a stop); returns how many requests (0 here)."""
        return 0
