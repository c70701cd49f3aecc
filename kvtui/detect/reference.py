"""reference: each completed request's tokens vs the same request run in a clean engine (fresh pool,
no faults, same sampling seed).

The first divergent token is reported with both texts. When the top-2 logit gap at that token (the
smaller of the checked and the reference run's) is within the dtype's tolerance, the divergence is
a near tie flipped by numerical batch variance: kind `numeric`, not contamination. A non-finite
logit at or before the divergence is never numeric.

Who caused a real divergence: the request is run once more, alone, with the faults that were on
during its life. If that run gives the same tokens, the damage happens with no other request
present: kind `corruption`. If not, something of another request reached it: kind
`cross_request`, with the suspects in the evidence (the requests co-batched at the divergent step,
and the earlier owners of its slot) and as source the only suspect when there is one; the
session joins it with the other detectors' reports on the same victim (kvtui/detect/findings.py).

Cost and bounds: references run several requests at a time in one clean engine (its batch
invariance is what tests/test_engine_parity.py checks against transformers' own attention), off
the engine's critical path: the session drains the queue when the engine is idle, between steps on
the virtual clock, and at the end (interruptible). At most `max_queue` checks wait; beyond that the
oldest is dropped unchecked, counted as skipped for the reason `queue_full`; checks still waiting when
the run is stopped are skipped for the reason `stopped`. References are cached per (model, dtype,
prompt, sampling) in an LRU of `cache_size` entries.

Tolerances (logits): float32 1e-3 (batched-vs-solo noise measured here is under 1e-5), float16 0.1,
bfloat16 0.5 (measured on SmolLM2: bf16 greedy batch 16 vs batch 1 agrees on only 9 of 16).
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from kvtui.config import EngineConfig
from kvtui.engine import Engine
from kvtui.events import Contamination, ReferenceEvidence

TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6, torch.float16: 0.1, torch.bfloat16: 0.5}


def numeric_tolerance(dtype: torch.dtype) -> float:
    """Top-2 logit gap under which a divergence counts as numeric for `dtype` (logits)."""
    return TOLERANCE.get(dtype, 0.5)


@dataclass(frozen=True)
class PendingCheck:
    """A completed request waiting for its reference check.

    Attributes:
        request_id, prompt_ids, output_ids, sampling: the request as it ran.
        gaps: top-1 minus top-2 logit at each generated token (NaN where a logit was not finite).
        steps: the engine step of each generated token.
        cobatched: the other requests in the batch at each generated token's step.
        earlier_owners: requests that held its slot before it, most recent last.
        faults: the faults on during any step it took part in.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    gaps: tuple[float, ...]
    sampling: object
    steps: tuple[int, ...] = ()
    cobatched: tuple[tuple[str, ...], ...] = ()
    earlier_owners: tuple[str, ...] = ()
    faults: frozenset = frozenset()


class ReferenceDetector:
    """Queue completed requests (`on_finish`); `drain()` checks them and returns events.

    Args:
        loaded: the LoadedModel the run uses (its model runs the references).
        tokenizer: for the texts in the evidence.
        engine_config: the run's EngineConfig (layout and budgets of the fault replays).
        max_queue: most checks waiting; beyond, the oldest is skipped and counted.
        batch: references computed together in one clean engine.
        cache_size: references kept (LRU).
    """

    def __init__(self, loaded, tokenizer, *, engine_config: EngineConfig | None = None, max_queue: int = 64,
                 batch: int = 8, cache_size: int = 256) -> None:
        self.loaded, self.tokenizer = loaded, tokenizer
        self.config = engine_config or EngineConfig()
        self.tolerance = numeric_tolerance(loaded.dtype)
        self.queue: deque[PendingCheck] = deque()
        self.max_queue, self.batch, self.cache_size = max_queue, batch, cache_size
        self._cache: OrderedDict = OrderedDict()
        self._clean: Engine | None = None  # reused across drains: no pool allocated per check
        self._resume: tuple | None = None  # (items, engine, states) of a clean run a stop interrupted
        self._interrupted = 0  # how many checks that run was for (they wait at the queue's front)
        self.checked = 0
        self.skipped_by_reason: Counter = Counter()  # reason (kvtui.events.SKIP_REASONS) -> requests left unchecked

    @property
    def pending(self) -> int:
        return len(self.queue)

    @property
    def skipped(self) -> int:
        """Completed requests left unchecked, whatever the reason."""
        return sum(self.skipped_by_reason.values())

    def on_finish(self, check: PendingCheck) -> None:
        """Queue a completed request (one with output); the oldest waiting check is skipped when full."""
        if not check.output_ids:
            return
        if len(self.queue) >= self.max_queue:
            self.queue.popleft()
            self.skipped_by_reason["queue_full"] += 1
        self.queue.append(check)

    def skip_pending(self) -> int:
        """Give up the waiting checks (a stop); returns how many, counted as skipped for `stopped`."""
        n = len(self.queue)
        if n:
            self.skipped_by_reason["stopped"] += n
        self.queue.clear()
        return n

    def drain(self, t: float, limit: int | None = None, should_stop: Callable[[], bool] | None = None,
              on_checked: Callable[[list[Contamination]], None] | None = None) -> list[Contamination]:
        """Check up to `limit` waiting requests (all when None), `batch` at a time; stops early (the
        unchecked stay queued) once `should_stop()` is true. Returns their events, time-stamped `t`;
        with `on_checked`, each request's events go to it as soon as that request is compared (and
        `checked` counts it), and none are returned."""
        events = []
        while self.queue and (limit is None or limit > 0) and not (should_stop and should_stop()):
            take = min(self.batch, len(self.queue), limit if limit is not None else len(self.queue))
            if self._interrupted:  # the same checks again, so the interrupted run resumes
                take = min(self._interrupted, len(self.queue))
            checks = [self.queue.popleft() for _ in range(take)]
            references = self._references([(c.prompt_ids, c.sampling) for c in checks], should_stop)
            if references is None:  # stopped mid-batch: put them back, at the front
                self.queue.extendleft(reversed(checks))
                self._interrupted = take
                break
            self._interrupted = 0
            for n, (check, reference) in enumerate(zip(checks, references)):
                found = self._compare(check, reference, t, should_stop)
                if found is None:  # stopped in the check's fault replay: it and the rest wait again
                    self.queue.extendleft(reversed(checks[n:]))
                    return events
                self.checked += 1
                if on_checked is None:
                    events += found
                else:
                    on_checked(found)
            limit = None if limit is None else limit - take
        return events

    # -- references ---------------------------------------------------------------------------
    def _references(self, items, should_stop=None) -> list[tuple[list[int], list[float]]] | None:
        """(tokens, top-2 gaps) of each (prompt, sampling) in a clean engine, from the LRU cache or
        computed together; None when `should_stop()` turned true meanwhile."""
        keys = [(self.loaded.model_id, str(self.loaded.dtype), tuple(p), s) for p, s in items]
        missing = [i for i, key in enumerate(keys) if key not in self._cache]
        if missing:
            computed = self._run([items[i] for i in missing], frozenset(), should_stop)
            if computed is None:
                return None
            for i, result in zip(missing, computed):
                self._cache[keys[i]] = result
        results = []
        for key in keys:
            self._cache.move_to_end(key)
            results.append(self._cache[key])
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return results

    def _run(self, items, faults: frozenset, should_stop=None) -> list[tuple[list[int], list[float]]] | None:
        """Run (prompt, sampling) pairs together with `faults` on and no EOS, so each covers its
        max_new_tokens (comparisons stop at the checked output's length). Without faults the clean engine
        is kept between calls (its pool grows to the longest request seen, so a long run does not allocate
        a pool per check); with faults a fresh engine replays the request alone.

        Returns None when `should_stop()` turned true between steps; the clean run is then kept as it
        is, and a later call with the same items resumes it instead of starting over."""
        key = tuple((tuple(p), s) for p, s in items)
        if not faults and self._resume is not None and self._resume[0] == key:
            engine, states = self._resume[1], self._resume[2]
        else:
            max_len = max(len(p) + s.max_new_tokens for p, s in items)
            engine = self._clean_engine(max_len) if not faults else self._engine(len(items), max_len, faults)
            states = [engine.submit(f"reference-{i}", list(p), s) for i, (p, s) in enumerate(items)]
        self._resume = None
        while engine.has_unfinished():
            if should_stop is not None and should_stop():
                self._resume = (key, engine, states) if not faults else None
                return None
            engine.step()
        return [(list(s.generated_ids), list(s.top2_gaps)) for s in states]

    def _engine(self, slots: int, max_len: int, faults: frozenset) -> Engine:
        config = replace(self.config, num_slots=slots, max_batch_size=slots, max_len=max_len, kv_budget_bytes=None,
                         faults=faults, max_waiting=None, on_too_long="reject")
        if not faults:  # the clean reference: a slot pool (a paged run's blocks and prefix cache are what is checked)
            config = replace(config, kv="slots", num_blocks=None, prefix_caching=False)
        return Engine(self.loaded.model, config, eos_token_ids=(), pad_token_id=_pad(self.tokenizer))

    def _clean_engine(self, max_len: int) -> Engine:
        engine = self._clean
        if engine is None or engine.pool.max_len < max_len or engine.has_unfinished():
            size = max(256, 1 << (max_len - 1).bit_length())  # powers of two: few re-allocations ...
            size = min(size, max(self.config.max_len, max_len))  # ... within the model's position table
            engine = self._clean = self._engine(self.batch, size, frozenset())
        return engine

    # -- comparison ---------------------------------------------------------------------------
    def _compare(self, check: PendingCheck, reference, t: float, should_stop=None) -> list[Contamination] | None:
        """The check's report (none when it equals its reference); None when `should_stop()` turned
        true during the replay that attributes a divergence (the check is then not done)."""
        output, (ref, ref_gaps) = list(check.output_ids), reference
        index = _first_difference(output, ref)
        if index is None:
            return []
        nonfinite = any(not math.isfinite(g) for g in check.gaps[: index + 1])
        gap = None if nonfinite else min(_at(check.gaps, index), _at(ref_gaps, index))
        if gap is not None and gap <= self.tolerance:
            kind, source, suspects = "numeric", None, ()
        else:
            attributed = self._attribute(check, index, should_stop)
            if attributed is None:
                return None
            kind, source, suspects = attributed
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        evidence = ReferenceEvidence(
            token_index=index, batched_token=output[index], solo_token=ref[index] if index < len(ref) else None,
            top2_gap=None if gap is None else round(gap, 6), tolerance=self.tolerance, batched_text=decode(output),
            solo_text=decode(ref[: len(output)]), nonfinite=nonfinite, suspects=suspects)
        step = check.steps[index] if index < len(check.steps) else -1
        return [Contamination(t=t, step=step, detector="reference", kind=kind, victim=check.request_id,
                              source=source, evidence=evidence)]

    def _attribute(self, check: PendingCheck, index: int, should_stop=None
                   ) -> tuple[str, str | None, tuple[str, ...]] | None:
        """corruption when the request alone, with the same faults, diverges the same way; else
        cross_request with its suspects (and the source when there is only one). None when
        `should_stop()` turned true during that replay (a quit does not wait for it)."""
        replayed = self._run([(check.prompt_ids, check.sampling)], frozenset(check.faults), should_stop)
        if replayed is None:
            return None
        alone = replayed[0][0]
        output = list(check.output_ids)
        if _first_difference(output, alone) is None:
            return "corruption", None, ()
        suspects = set(check.cobatched[index] if index < len(check.cobatched) else ()) | set(check.earlier_owners)
        suspects.discard(check.request_id)
        ordered = tuple(sorted(suspects))
        return "cross_request", ordered[0] if len(ordered) == 1 else None, ordered


def _first_difference(output: list[int], reference: list[int]) -> int | None:
    """Index of the first token of `output` that differs from `reference` (None: none differs)."""
    return next((i for i, (a, b) in enumerate(zip(output, reference)) if a != b),
                None if len(reference) >= len(output) else len(reference))


def _at(values, index: int) -> float:
    return values[index] if index < len(values) else float("inf")


def _pad(tokenizer) -> int:
    return getattr(tokenizer, "pad_token_id", None) or 0
