"""reference: each completed request's tokens vs the same request run in a clean engine (fresh pool,
no faults, same sampling seed).

The first divergent token is judged. A greedy token is a near tie flipped by numerical batch variance,
kind `numeric` and not contamination, when the top-2 logit gap at it (the smaller of the checked and
the reference run's) is within the run's tolerance. A sampled token is numeric when the uniform both
runs drew fell where rounding moved a boundary of the cumulative distribution, and the distribution
around it moved no more than rounding does (sampled_flip_is_numeric). A non-finite logit at or before
the divergence is never numeric, nor a position the reference did not reach.

Past a numeric flip the free-running reference continues from another token, so the request is run
once more in the clean engine teacher-forced on the batched tokens (Engine.submit's `forced`): at every
position the clean engine makes its own choice (greedy argmax, or its draw with the request's own
generator: the same uniforms) and keeps its gap and Draw, but is fed the batched token, so penalties,
min_tokens, bad_words and the grammar advance exactly as in the batched run. Every position where its
choice differs from the batched token is judged the same way; the first that is not numeric is
reported and counted (its evidence names the first divergence and the numeric flips before it), so
damage that starts inside the tolerance is still caught. A request with only numeric flips gets one
`numeric` report. Forced references are cached per (prompt, sampling, output tokens).

The tolerance (logits; kvtui/detect/tolerance.py): float32 keeps 1e-3 (its batched-vs-solo noise is
under 1e-4 on SmolLM2); bfloat16 and float16 use the batched-against-solo spread measured on the
machine that runs the checks (per model, dtype, CPU, torch and threads, stored; measured at load when
missing), since their rounding depends on the CPU's kernels. TOLERANCE's low-precision figures (tuned
on an Intel CPU with AMX) are only a last resort, when no measurement can be made.

Who caused a real divergence: the request is run once more, alone, with the faults that were on
during its life (free-running for a first divergence; teacher-forced on the batched tokens for one
found past numeric flips). If that run gives the same tokens (teacher-forced: its own choice at the
divergent token is the batched one), the damage happens with no other request present: kind
`corruption`. If not, something of another request reached it: kind
`cross_request`, with the suspects in the evidence (the requests co-batched at the divergent step,
and the earlier owners of its slot) and as source the only suspect when there is one; the
session joins it with the other detectors' reports on the same victim (kvtui/detect/findings.py).

Cost and bounds: references run several requests at a time in one clean engine (its batch
invariance is what tests/engine/test_engine_parity.py checks against transformers' own attention), off
the engine's critical path: the session drains the queue when the engine is idle, between steps on
the virtual clock, and at the end (interruptible). At most `max_queue` checks wait; beyond that the
oldest is dropped unchecked, counted as skipped for the reason `queue_full`; checks still waiting when
the run is stopped are skipped for the reason `stopped`. References are cached per (model, dtype,
prompt, sampling, forced tokens) in an LRU of `cache_size` entries.

In the batch-invariant mode (EngineConfig.batch_invariant; the clean engines run in it too) a solo
rerun reproduces the batched logits bit for bit, so no divergence is numeric: every differing token
is judged as a real one, and no tolerance is measured.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from kvtui.config import EngineConfig
from kvtui.detect.observer import DrainBudget, Finished, Quiet
from kvtui.detect.tolerance import BUILT_IN, Tolerance, logit_spread, reference_tolerance
from kvtui.engine import Engine
from kvtui.engine.inputs import RequestInput
from kvtui.engine.sampling import DRAW_TOP, Draw
from kvtui.events import Contamination, ReferenceEvidence, SkipReason

TOLERANCE = BUILT_IN  # the built-in tolerances (logits); bfloat16 / float16 runs use a measured one


def numeric_tolerance(dtype: torch.dtype) -> float:
    """The built-in top-2 logit gap under which a divergence counts as numeric for `dtype` (logits).

    For float32 it is what runs use; for bfloat16 and float16 only a last resort (they were tuned on an
    Intel CPU with AMX): runs use the tolerance measured on their own machine (reference_tolerance)."""
    return BUILT_IN.get(dtype, 0.5)


TOP_SHARED = 4  # each run's most likely tokens whose move the spread accounts for, listed by the other run or not


def _log_odds(p: float) -> float:
    p = min(max(p, 1e-300), 1.0)
    return math.inf if p >= 1.0 else math.log(p) - math.log1p(-p)


def _reach(draw: Draw, rank: int) -> float:
    """How far (log-odds) the draw point lies from rank `rank`'s interval in that run: 0 inside it,
    inf past the ranks the draw kept. Where the draw kept only ranks that bracket the interval, the
    distance to the bracket's farther end (an upper bound)."""
    bounds = draw.bounds(rank)
    if bounds is None:
        return math.inf
    low, high, exact = bounds
    point, below, above = _log_odds(draw.point), _log_odds(low), _log_odds(high)
    if exact:
        return max(below - point, point - above, 0.0)
    return max(point - below, above - point)


def compare_draws(batched: Draw | None, solo: Draw | None) -> tuple[float, float] | None:
    """How far apart two runs' draws of one sampled token are (the same uniform, different tokens).

    Returns (shift, spread), or None without both draws (a reference that ended first):
        shift: the smallest move, in log-odds, of the cumulative distribution by rank that explains
            why the same u fell on different ranks: each run's rank must lie that close to the other
            run's draw point (the larger of the two distances; 0 for the same rank, where two tokens
            swapped places); inf when the uniforms differ or a rank lies past what a draw kept.
        spread: how much the logits of the tokens both runs list (those ranked near the draw and the
            most likely ones) moved relative to each other: max minus min of (batched - solo logit),
            logits (logit_spread). Both Draws keep the logits after the row's processing (penalties,
            bias, bad_words, min_tokens, the grammar bitmask), so a token masked (-inf) in both runs
            is left out. A run's TOP_SHARED most likely tokens count even when the other run does
            not list them: there they rank below its DRAW_TOP listed most likely tokens, so their
            logit is at most the lowest of those, which bounds their move (the spread is then the
            smallest one both records allow; rounding in a flat distribution reorders ranks 4 and 9).
            inf when a token is finite in one run and not in the other, or when no token is listed
            by both.
    """
    if batched is None or solo is None:
        return None
    if batched.u != solo.u:
        return math.inf, math.inf
    shift = max(_reach(batched, solo.rank), _reach(solo, batched.rank))
    ours, theirs = batched.logit_of(), solo.logit_of()
    if not any(t in theirs for t in ours):
        return shift, math.inf
    # a top token the other run does not list moved by at least (at most) this much: its logit there is
    # at most the other run's lowest listed top logit
    above = [ours[t] - _floor(solo) for t in _top(batched) if t not in theirs]
    below = [_floor(batched) - theirs[t] for t in _top(solo) if t not in ours]
    return shift, logit_spread(ours, theirs, above, below)


def _top(draw: Draw) -> list[int]:
    return [t for t, r in zip(draw.logit_ids, draw.logit_ranks) if r < TOP_SHARED]


def _floor(draw: Draw) -> float:
    """The logit at rank DRAW_TOP - 1, the lowest of the most likely tokens a Draw lists: every token it
    does not list has at most this logit (-inf when it is masked: NaN in the Draw)."""
    z = next(z for z, r in zip(draw.logits, draw.logit_ranks) if r == min(DRAW_TOP, len(draw.logit_ranks)) - 1)
    return -math.inf if math.isnan(z) else z


def sampled_tolerance(dtype: torch.dtype, batched: Draw | None, solo: Draw | None,
                      base: float | None = None) -> float:
    """Logit tolerance of a sampled divergence in `dtype`: `base` (the run's logit tolerance, by default
    numeric_tolerance(dtype)) plus 2 units in the last place of the largest logit the two draws list.

    The logits reach the sampler rounded to the dtype, so each run's logit is off by up to half a unit
    in the last place (ulp = finfo(dtype).eps x 2^floor(log2 |z|)): one token's difference between the
    runs by up to 1 ulp from that rounding alone, and two tokens' differences apart by up to 2. In
    bfloat16 a logit of 20 has a unit of 0.125, one of 40 a unit of 0.25; in float32 the term is under
    1e-5 (float32 stays as strict as the greedy rule)."""
    values = [abs(z) for d in (batched, solo) if d is not None for z in d.logits if math.isfinite(z)]
    largest = max(values, default=0.0)
    ulp = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(largest)) if largest > 0 else 0.0
    return (numeric_tolerance(dtype) if base is None else base) + 2 * ulp


def sampled_flip_is_numeric(batched: Draw | None, solo: Draw | None, temperature: float, tolerance: float) -> bool:
    """Whether a sampled token that differs between the batched and the solo run is a rounding flip.

    Both runs drew the same uniform u. The flip is numeric when (compare_draws) the cumulative
    distribution by rank moved by at most tolerance / temperature in log-odds where u fell, and the
    logits near the draw and at the top moved by at most `tolerance` relative to each other
    (`tolerance`: logits, sampled_tolerance of the run's dtype).

    Why these bounds: the run's tolerance is the largest move of one logit relative to another that
    batch rounding makes (for bfloat16 and float16 measured on the machine, kvtui/detect/tolerance.py;
    the same figure the greedy rule holds the top-2 gap to), plus the rounding of the logits
    themselves (sampled_tolerance). A boundary of the cumulative distribution (the mass of the ranks
    above it, against the rest) has log-odds logsumexp(above / T) - logsumexp(rest / T). When the
    logits move by d, each logsumexp moves by a softmax-weighted mean of d / T, so their difference
    moves by at most (max d - min d) / T: the same rounding moves a boundary by at most tolerance / T.
    Measured on SmolLM2 on an Intel CPU with AMX, under the old constant tolerances (30 bfloat16 and
    20 float16 random sampled runs with isolation intact, scripts/sweep_sampled.py: 121 and 49
    divergences, all numeric): boundaries moved by up to 0.15 / T and logits by 0.5 relative in
    bfloat16 (tolerance 0.75 to 1.0), by 0.022 / T and 0.0625 in float16 (about 0.13 to 0.16); on a
    2-core AMD EPYC without AMX (10 bfloat16 runs) by up to 0.22 / T and 0.5. The divergences the
    library's faults caused, sampled in bfloat16, moved the logits by 1 or more or moved the boundary
    past the tolerance, and stay counted. No draw (a reference that ended first), different uniforms,
    records with no token in common or a token finite in one run only: False.
    """
    moved = compare_draws(batched, solo)
    return moved is not None and moved[0] <= tolerance / temperature and moved[1] <= tolerance


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
        draws: sampled requests: the Draw of each generated token (kvtui/engine/sampling.py).
        input: what it fed the model beyond the ids (kvtui.engine.inputs.RequestInput: audio, supplied
            embedding rows, images), replayed as it was; None: a text prompt of prompt_ids.
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
    draws: tuple = ()
    input: object = None


REFERENCE_STEP_TOKENS = 128  # the clean reference engine's token budget per step (see ReferenceDetector._engine)


class ReferenceDetector:
    """Queue completed requests (`on_finish`); `drain()` checks them and returns events.

    Args:
        loaded: the LoadedModel the run uses (its model runs the references).
        tokenizer: for the texts in the evidence.
        engine_config: the run's EngineConfig (layout and budgets of the fault replays).
        max_queue: most checks waiting; beyond, the oldest is skipped and counted.
        batch: references computed together in one clean engine.
        cache_size: references kept (LRU).
        tolerance: the numeric tolerance (kvtui.detect.tolerance.Tolerance); None: reference_tolerance
            (bfloat16 / float16: this machine's calibration, measured now when there is none, which
            `progress`, a callable taking one line, hears about).

    Attributes:
        tolerance: logits (see the module docstring); numeric: the Tolerance with its source.
    """

    def __init__(self, loaded, tokenizer, *, engine_config: EngineConfig | None = None, max_queue: int = 64,
                 batch: int = 8, cache_size: int = 256, tolerance: Tolerance | None = None,
                 progress: Callable[[str], None] | None = None) -> None:
        self.loaded, self.tokenizer = loaded, tokenizer
        self.config = engine_config or EngineConfig()
        self.exact = self.config.batch_invariant  # a solo rerun reproduces the logits: no divergence is numeric
        self.numeric = (Tolerance(0.0, "batch-invariant", {"tolerance": 0.0, "source": "batch-invariant"}) if self.exact
                        else tolerance or reference_tolerance(loaded, progress=progress))
        self.tolerance = self.numeric.value
        self.queue: deque[PendingCheck] = deque()
        self.max_queue, self.batch, self.cache_size = max_queue, batch, cache_size
        self._cache: OrderedDict = OrderedDict()
        self._clean: Engine | None = None  # reused across drains: no pool allocated per check
        self._resume: tuple | None = None  # (items, engine, states) of a clean run a stop interrupted
        self._interrupted = 0  # how many checks that run was for (they wait at the queue's front)
        self.checked = 0
        self.skipped_by_reason: Counter = Counter()  # SkipReason -> requests left unchecked

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
            self.skipped_by_reason[SkipReason.QUEUE_FULL] += 1
        self.queue.append(check)

    def skip_pending(self) -> int:
        """Give up the waiting checks (a stop); returns how many, counted as skipped for `stopped`."""
        n = len(self.queue)
        if n:
            self.skipped_by_reason[SkipReason.STOPPED] += n
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
            references = self._references([(c.input or c.prompt_ids, c.sampling) for c in checks], should_stop)
            forced = None if references is None else self._forced(checks, references, should_stop)
            if forced is None:  # stopped mid-batch: put them back, at the front
                self.queue.extendleft(reversed(checks))
                self._interrupted = take
                break
            self._interrupted = 0
            for n, (check, reference, continued) in enumerate(zip(checks, references, forced)):
                found = self._compare(check, reference, t, should_stop, continued)
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
    def _references(self, items, should_stop=None) -> list[tuple[list[int], list[float], list]] | None:
        """(tokens, top-2 gaps, draws) of each (prompt, sampling) or (prompt, sampling, forced tokens) in a
        clean engine, from the LRU cache or computed together; None when `should_stop()` turned true
        meanwhile. A prompt: a RequestInput or token ids. With forced tokens the tokens are the model's own
        choices at each forced position (see _run)."""
        items = [_item(it) for it in items]
        keys = [(self.loaded.model_id, str(self.loaded.dtype), p.identity, s, f) for p, s, f in items]
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

    def _forced(self, checks: list[PendingCheck], references: list, should_stop=None) -> list | None:
        """Each check's teacher-forced reference (the clean engine fed the check's own output: its choice
        at every position, as _references), or None for a check whose first divergence is not a numeric
        flip (there is nothing to continue); None when `should_stop()` turned true meanwhile."""
        wanted = [i for i, (c, r) in enumerate(zip(checks, references)) if self._numeric_start(c, r)]
        runs = self._references([(checks[i].input or checks[i].prompt_ids, checks[i].sampling, checks[i].output_ids)
                                 for i in wanted], should_stop) if wanted else []
        if runs is None:
            return None
        out: list = [None] * len(checks)
        for i, run in zip(wanted, runs):
            out[i] = run
        return out

    def _run(self, items, faults: frozenset, should_stop=None) -> list[tuple[list[int], list[float], list]] | None:
        """Run (prompt, sampling[, forced tokens]) items together with `faults` on and no EOS, so each covers
        its max_new_tokens (comparisons stop at the checked output's length). Without faults the clean
        engine is kept between calls (its pool grows to the longest request seen, so a long run does not
        allocate a pool per check); with faults a fresh engine replays the request alone.

        Returns (tokens, top-2 gaps, draws) per item; a forced item (Engine.submit's `forced`) emits the
        given tokens and returns its own choice at each position (shorter when its own logits processing
        masks a forced token: it stops there). None when `should_stop()` turned true between steps; the
        clean run is then kept as it is, and a later call with the same items resumes it instead of
        starting over."""
        items = [_item(it) for it in items]
        key = tuple((p.identity, s, f) for p, s, f in items)
        if not faults and self._resume is not None and self._resume[0] == key:
            engine, states = self._resume[1], self._resume[2]
        else:
            max_len = max(len(p.prompt_ids) + s.max_new_tokens for p, s, _ in items)
            engine = self._clean_engine(max_len) if not faults else self._engine(len(items), max_len, faults)
            states = [engine.submit(f"reference-{i}", p, s, forced=f) for i, (p, s, f) in enumerate(items)]
        self._resume = None
        while engine.has_unfinished():
            if should_stop is not None and should_stop():
                self._resume = (key, engine, states) if not faults else None
                return None
            engine.step()
        return [(list(s.chosen_ids if s.forced else s.generated_ids), list(s.top2_gaps), list(s.draws))
                for s in states]

    def _engine(self, slots: int, max_len: int, faults: frozenset) -> Engine:
        config = replace(self.config, num_slots=slots, max_batch_size=slots, max_len=max_len, kv_budget_bytes=None,
                         faults=faults, max_waiting=None, on_too_long="reject")
        if not faults:  # the clean reference: a slot pool (a paged run's blocks and prefix cache are what is checked)
            # and short steps: the checks run while the server is idle and stop between steps when work
            # arrives, so a step's length is what a new request may wait (a 1024-token prefill step of
            # SmolLM2 takes 2.5-3.4 s on one thread of a 2-core Xeon, a 128-token one about 0.3 s)
            config = replace(config, kv="slots", num_blocks=None, prefix_caching=False, kv_offload_blocks=None,
                             max_tokens_per_step=min(config.max_tokens_per_step, REFERENCE_STEP_TOKENS))
        # structured output: the same grammar; no stop strings, no EOS ids
        engine = Engine.from_loaded(self.loaded, config, eos_token_ids=(), tokenizer=None,
                                    pad_token_id=_pad(self.tokenizer), grammar_tokenizer=self.tokenizer)
        engine.output.stop_mask_ids = frozenset(self.loaded.eos_token_ids)  # min_tokens masks EOS as in the checked run
        return engine

    def _clean_engine(self, max_len: int) -> Engine:
        engine = self._clean
        if engine is None or engine.pool.max_len < max_len or engine.has_unfinished():
            size = max(256, 1 << (max_len - 1).bit_length())  # powers of two: few re-allocations ...
            size = min(size, max(self.config.max_len, max_len))  # ... within the model's position table
            engine = self._clean = self._engine(self.batch, size, frozenset())
        return engine

    # -- comparison ---------------------------------------------------------------------------
    def _compare(self, check: PendingCheck, reference, t: float, should_stop=None,
                 forced=None) -> list[Contamination] | None:
        """The check's report (none when it equals its reference); None when `should_stop()` turned
        true during the replay that attributes a divergence (the check is then not done).

        `forced`: the teacher-forced reference (_forced) when the first divergence is a numeric flip:
        every later position where its choice differs from the output is judged the same way, and the
        first that is not numeric is reported (counted) instead of the flip."""
        output = list(check.output_ids)
        first = _first_difference(output, reference[0])
        if first is None:
            return []
        index, verdict, solo, flips = first, self._judge(check, first, reference), reference, 0
        if verdict.numeric and forced is not None:
            for j in _differences(output, forced[0]):
                judged = self._judge(check, j, forced)
                if not judged.numeric:
                    index, verdict, solo = j, judged, forced
                    break
                flips += 1
        if verdict.numeric:
            kind, source, suspects = "numeric", None, ()
        else:  # a first divergence: replayed free-running as before; one after numeric flips: teacher-forced
            attributed = self._attribute(check, index, should_stop, forced=flips > 0)
            if attributed is None:
                return None
            kind, source, suspects = attributed
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        solo_ids = solo[0][: len(output)] if solo is reference else output[:index] + solo[0][index: index + 1]
        evidence = ReferenceEvidence(**{
            "token_index": index, "batched_token": output[index], "solo_token": _at(solo[0], index, None),
            "top2_gap": None if verdict.gap is None else round(verdict.gap, 6), "tolerance": self.tolerance,
            "batched_text": decode(output), "solo_text": decode(solo_ids), "nonfinite": verdict.nonfinite,
            "suspects": suspects, **verdict.fields,
            **({} if forced is None else {"first_divergence": first, "numeric_flips": flips})})
        step = check.steps[index] if index < len(check.steps) else -1
        return [Contamination(t=t, step=step, detector="reference", kind=kind, victim=check.request_id,
                              source=source, evidence=evidence)]

    def _numeric_start(self, check: PendingCheck, reference) -> bool:
        """Whether the check's first divergence from its free-running reference is a numeric flip."""
        first = _first_difference(list(check.output_ids), reference[0])
        return first is not None and self._judge(check, first, reference).numeric

    def _judge(self, check: PendingCheck, index: int, reference) -> "_Verdict":
        """Whether the divergence at `index` from `reference` (tokens, gaps, draws) is a numeric flip:
        greedy, the smaller top-2 gap of the two runs within the tolerance; sampled,
        sampled_flip_is_numeric. Never numeric past the reference's end or after a non-finite logit."""
        tokens, gaps, draws = reference
        nonfinite = any(math.isnan(g) for g in check.gaps[: index + 1])  # +inf: one token allowed, no tie
        gap = None if nonfinite else min(_at(check.gaps, index), _at(gaps, index))
        fields: dict = {}
        if not getattr(check.sampling, "greedy", True):
            near, fields = self._sampled(check, _at(check.draws, index, None), _at(draws, index, None))
        else:
            near = gap is not None and gap <= self.tolerance
        return _Verdict(near and not nonfinite and index < len(tokens), gap, nonfinite, fields)

    def _sampled(self, check: PendingCheck, draw: Draw | None, solo: Draw | None) -> tuple[bool, dict]:
        """A sampled divergence: numeric or not (sampled_flip_is_numeric), and the evidence's draw fields."""
        temperature = check.sampling.temperature
        tolerance = sampled_tolerance(self.loaded.dtype, draw, solo, base=self.tolerance)
        moved = compare_draws(draw, solo)
        fields = dict(draw_u=None if draw is None else draw.u, tolerance=round(tolerance, 6),
                      draw_tolerance=round(tolerance / temperature, 6), draw_shift=_finite(moved and moved[0]),
                      logit_spread=_finite(moved and moved[1]))
        return sampled_flip_is_numeric(draw, solo, temperature, tolerance), fields

    def _attribute(self, check: PendingCheck, index: int, should_stop=None, forced: bool = False
                   ) -> tuple[str, str | None, tuple[str, ...]] | None:
        """corruption when the request alone, with the same faults, diverges the same way; else
        cross_request with its suspects (and the source when there is only one). None when
        `should_stop()` turned true during that replay (a quit does not wait for it).

        The same way: the replay gives the same tokens; with `forced` (a divergence after numeric flips)
        the replay is teacher-forced on the output too, and its own choice at `index` is the output's."""
        output = list(check.output_ids)
        replayed = self._run([(check.input or check.prompt_ids, check.sampling, tuple(output) if forced else None)],
                             frozenset(check.faults), should_stop)
        if replayed is None:
            return None
        alone = replayed[0][0]
        same = _at(alone, index, None) == output[index] if forced else _first_difference(output, alone) is None
        if same:
            return "corruption", None, ()
        suspects = set(check.cobatched[index] if index < len(check.cobatched) else ()) | set(check.earlier_owners)
        suspects.discard(check.request_id)
        ordered = tuple(sorted(suspects))
        return "cross_request", ordered[0] if len(ordered) == 1 else None, ordered


class ReferenceObserver(Quiet):
    """`reference` as a local run's observer (kvtui/run/observers.py): each completed request is queued
    (with its trail: the steps, co-batched requests and earlier slot owners it met) and checked when
    the run drains its observers, `batch` at a time.

    Args: as ReferenceDetector's.

    Attributes:
        detector: the ReferenceDetector (its tolerance, `numeric`, queue and counts).
    """

    name = "reference"

    def __init__(self, loaded, tokenizer, **options) -> None:
        self.detector = ReferenceDetector(loaded, tokenizer, **options)

    @property
    def pending(self) -> int:
        """Completed requests waiting for their check."""
        return self.detector.pending

    @property
    def batch(self) -> int:
        """Checks computed together in one clean engine."""
        return self.detector.batch

    @property
    def checked(self) -> int:
        """Requests checked so far."""
        return self.detector.checked

    def on_finish(self, finished: Finished) -> list[Contamination]:
        """Queue a completed request's check (a target run's, with no engine request, is not one)."""
        f = finished.request
        if finished.completed and f is not None:
            steps, cobatched, earlier = finished.trail or ((), (), ())
            self.detector.on_finish(PendingCheck(
                f.request_id, f.prompt_ids, f.output_ids, f.top2_gaps, f.sampling, steps, cobatched, earlier,
                frozenset(f.faults), f.draws, f.input))
        return []

    def drain(self, budget: DrainBudget) -> list[Contamination]:
        """Check up to `budget.limit` waiting requests, `batch` at a time, until `budget.should_stop()`;
        each batch's reports carry the run's time when it starts. Returns the reports `budget.on_checked`
        did not hear."""
        ref, limit, events = self.detector, budget.limit, []
        while ref.pending and (limit is None or limit > 0) and not budget.should_stop():
            batch = min(ref.batch, limit or ref.batch)
            events += ref.drain(budget.now(), limit=batch, should_stop=budget.should_stop,
                                on_checked=budget.on_checked)
            limit = None if limit is None else limit - batch
        return events

    def counts(self) -> dict:
        ref = self.detector
        return {"checked": ref.checked, "skipped_by_reason": ref.skipped_by_reason, "pending": ref.pending}

    def skip_pending(self) -> int:
        return self.detector.skip_pending()


class _Verdict(NamedTuple):
    """A judged divergence: numeric or not, the top-2 gap (None after a non-finite logit), whether a
    logit up to it was non-finite, and the evidence's draw fields (sampled tokens)."""

    numeric: bool
    gap: float | None
    nonfinite: bool
    fields: dict


def _item(item: tuple) -> tuple:
    """(RequestInput, sampling, forced tokens or None) of a (prompt, sampling[, forced]) item whose prompt
    is a RequestInput or token ids."""
    forced = item[2] if len(item) > 2 and item[2] is not None else None
    return RequestInput.of(item[0]), item[1], None if forced is None else tuple(forced)


def _first_difference(output: list[int], reference: list[int]) -> int | None:
    """Index of the first token of `output` that differs from `reference` (None: none differs)."""
    return next(_differences(output, reference), None)


def _differences(output: list[int], reference: list[int]):
    """Indices of the tokens of `output` that differ from `reference`, in order; past the reference's end
    only the first index (it ended there)."""
    for i, token in enumerate(output):
        if i >= len(reference):
            yield i
            return
        if reference[i] != token:
            yield i


def _at(values, index: int, default=math.inf):
    return values[index] if index < len(values) else default


def _finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, 6)


def _pad(tokenizer) -> int:
    return getattr(tokenizer, "pad_token_id", None) or 0
