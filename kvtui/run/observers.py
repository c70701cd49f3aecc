"""The run's observers: every detector watches a run through one protocol, and both kinds of run build
theirs here.

A run (kvtui/session.py, kvtui/remote/session.py) shows each observer four moments: a request's
arrival (`on_arrive`), a step with its new text (`on_step`; a target run's streamed chunk), a request's
end (`on_finish`, before its request.finish event), and time to spare (`drain`, where the reference
detector runs its batched solo checks). Each returns its contamination reports and the run emits them,
observer by observer in the order `build_observers` lists them, which is the order reports reach a
recording. The records an observer reads (`Arrival`, `StepSeen`, `Finished`, `DrainBudget`) and the
base with the defaults (`Quiet`) are in kvtui/detect/observer.py, where the detectors can read them.

A new detector is one module in kvtui/detect/ (its detector and an observer class deriving from
Quiet) and one entry in `OBSERVERS` (plus its name in kvtui.detect.DETECTOR_NAMES, so runs accept it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvtui.detect import DETECTOR_NAMES
from kvtui.detect.observer import Arrival, DrainBudget, Finished, Quiet, StepSeen

__all__ = ["OBSERVERS", "TARGET_OBSERVERS", "Arrival", "DrainBudget", "Finished", "Observer", "ObserverContext",
           "Quiet", "StepSeen", "build_observers", "check_names"]


@runtime_checkable
class Observer(Protocol):
    """What a run asks of each detector (kvtui/detect/observer.py Quiet gives the defaults).

    Attributes:
        name: a detector name of kvtui.detect.DETECTOR_NAMES, or "engine" (the engine's own errors,
            with slot_taint and attention_flow).
        pending: deferred work waiting for `drain` (requests whose reference check waits).
        batch: how many of those one drain step takes together.
    """

    name: str
    pending: int
    batch: int

    def on_arrive(self, arrival: Arrival) -> list:
        """A request arrived; returns contamination reports."""

    def on_step(self, step: StepSeen) -> list:
        """A step (or a streamed chunk) happened; returns contamination reports."""

    def on_finish(self, finished: Finished) -> list:
        """A request ended; returns contamination reports, emitted before its request.finish event."""

    def drain(self, budget: DrainBudget) -> list:
        """Deferred work within `budget`; returns the reports `budget.on_checked` did not hear."""

    def counts(self) -> dict | None:
        """The reference.status fields this observer keeps, or None."""

    def skip_pending(self) -> int:
        """Give up the waiting work at the run's close; returns how many requests."""


@dataclass(frozen=True)
class ObserverContext:
    """What an observer's factory may need of the run.

    Attributes:
        names: the detectors the run was asked for.
        loaded: the LoadedModel (a local run; None for a target run).
        tokenizer: the model's tokenizer.
        engine_config: the run's EngineConfig (a local run).
        progress: hears one line when the reference detector measures this machine's tolerance.
    """

    names: tuple[str, ...] = ()
    loaded: object = None
    tokenizer: object = None
    engine_config: object = None
    progress: Callable[[str], None] | None = field(default=None, compare=False)


def _engine(context: ObserverContext):
    from kvtui.detect.engine_signals import EngineObserver

    return EngineObserver(taint="slot_taint" in context.names, flow="attention_flow" in context.names)


def _provenance(context: ObserverContext):
    from kvtui.detect.provenance import ProvenanceObserver

    return ProvenanceObserver()


def _constraint(context: ObserverContext):
    from kvtui.detect.constraint import ConstraintObserver

    return ConstraintObserver(context.loaded.eos_token_ids or ())


def _sampling(context: ObserverContext):
    from kvtui.detect.sampling import SamplingObserver

    return SamplingObserver()


def _state(context: ObserverContext):
    from kvtui.detect.state_provenance import StateProvenanceObserver

    return StateProvenanceObserver()


def _canary(context: ObserverContext):
    from kvtui.detect.canary import CanaryObserver

    return CanaryObserver()


def _reference(context: ObserverContext):
    from kvtui.detect.reference import ReferenceObserver

    return ReferenceObserver(context.loaded, context.tokenizer, engine_config=context.engine_config,
                             progress=context.progress)


# name -> factory, in the order observers see each moment (so the order of their reports in a recording).
# "engine" is on in every local run (the engine's own errors); slot_taint and attention_flow are the same
# observer (built once, both flags from the names).
OBSERVERS: dict[str, Callable[[ObserverContext], Observer]] = {
    "engine": _engine,
    "slot_taint": _engine,
    "attention_flow": _engine,
    "prefix_provenance": _provenance,
    "constraint": _constraint,
    "sampling_provenance": _sampling,
    "state_provenance": _state,
    "canary": _canary,
    "reference": _reference,
}

ALWAYS = ("engine",)  # built in every local run, whatever the names
# what a target run watches from outside as an observer: the streamed text. Its `reference` is the solo
# reruns after the load (kvtui/remote/session.py TargetSession._references: HTTP, not an observer).
TARGET_OBSERVERS = ("canary",)


def check_names(names) -> tuple[str, ...]:
    """`names` as a tuple, each a detector name (kvtui.detect.DETECTOR_NAMES).

    Raises:
        ValueError: an unknown name (the first, sorted), with the known ones."""
    names = tuple(names)
    unknown = sorted(set(names) - set(DETECTOR_NAMES))
    if unknown:
        raise ValueError(f"unknown detector {unknown[0]!r}; known: {', '.join(DETECTOR_NAMES)}")
    return names


def build_observers(names, context: ObserverContext | None = None, *, target: bool = False) -> list[Observer]:
    """The observers of a run asked for detectors `names`, in OBSERVERS' order (each factory once).

    Args:
        names: detector names (kvtui.detect.DETECTOR_NAMES).
        context: what the factories read (the model, the engine config); a target run needs none.
        target: a run against a server: only TARGET_OBSERVERS apply, and no "engine" observer.

    Raises:
        ValueError: an unknown detector name.
    """
    names = check_names(names)
    context = context or ObserverContext(names=names)
    if context.names != names:
        context = ObserverContext(names, context.loaded, context.tokenizer, context.engine_config, context.progress)
    wanted = set(names) & set(TARGET_OBSERVERS) if target else set(names) | set(ALWAYS)
    built, observers = set(), []
    for name, factory in OBSERVERS.items():
        if name in wanted and factory not in built:
            built.add(factory)
            observers.append(factory(context))
    return observers
