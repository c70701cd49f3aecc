"""Runs that would test nothing: planned requests the engine will reject for their length, and faults
that cannot act in the engine's layout or KV mode. `kvtui validate` and `kvtui run` both ask; a
scenario in which no request fits is refused (exit 2), one in which only some fit is warned about.

The length rules are the engine's admission rules (kvtui/engine/engine.py `_admission_problem`,
kvtui/engine/block_manager.py `fits`), restated here over planned lengths so that no model is needed:
an empty prompt, or a prompt of max_len tokens or more, is always rejected; prompt + max new tokens
above max_len is rejected with `on_too_long: reject` (with `cap` the output is shortened instead);
with paged KV a request whose prompt + output needs more blocks than the pool's usable ones less the
watermark is rejected. tests/run/test_run_outcomes.py checks these predictions against the engine's own
rejections. Torch-free: planned requests are read by their attributes only.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvtui.faults import fault_misfit


@dataclass(frozen=True)
class FitReport:
    """How the planned requests fit the engine: `total` planned, `rejected` by cause ("empty", "prompt":
    the prompt alone reaches max_len, "length": prompt + output above max_len, "blocks": more KV blocks
    than the paged pool can give one request), and the largest prompt + output seen (tokens)."""

    total: int
    rejected: Counter
    longest: int
    shortest_prompt: int
    longest_prompt: int

    @property
    def num_rejected(self) -> int:
        return sum(self.rejected.values())


def _on_too_long_at(scenario, t: float) -> str:
    """engine.on_too_long in effect at `t` seconds (the timeline may change it)."""
    value = scenario.engine.on_too_long
    for event in scenario.timeline:
        if event.at_s > t:
            break
        value = event.engine_overrides().get("on_too_long", value)
    return value


def _usable_blocks(engine) -> int | None:
    """Paged KV: blocks one request may hold (usable less the watermark), when known without the model."""
    if engine.kv != "paged" or engine.kv_budget_bytes is not None:
        return None
    usable = engine.pool_blocks(0) - 1
    return usable - int(engine.watermark * usable)


def _cause(engine, prompt: int, output: int, on_too_long: str, blocks: int | None) -> str:
    if prompt == 0:
        return "empty"
    if prompt >= engine.max_len:
        return "prompt"
    if prompt + output > engine.max_len:
        if on_too_long == "reject":
            return "length"
        output = engine.max_len - prompt
    if blocks is not None and -(-(prompt + output) // engine.block_size) > blocks:
        return "blocks"
    return ""


def check_fit(scenario, planned) -> FitReport:
    """Which of `planned` (PlannedRequest-like: prompt_ids, sampling.max_new_tokens, arrival_s) the
    scenario's engine will reject for their length, and why."""
    engine, blocks = scenario.engine, _usable_blocks(scenario.engine)
    rejected: Counter = Counter()
    longest, prompts = 0, []
    for p in planned:
        prompt, output = len(p.prompt_ids), p.sampling.max_new_tokens
        prompts.append(prompt)
        longest = max(longest, prompt + output)
        cause = _cause(engine, prompt, output, _on_too_long_at(scenario, p.arrival_s), blocks)
        if cause:
            rejected[cause] += 1
    return FitReport(len(prompts), rejected, longest, min(prompts, default=0), max(prompts, default=0))


def fit_lines(scenario, planned, source: str) -> tuple[list[str], list[str]]:
    """(errors, warnings): one error line when no planned request fits the engine (the run would test
    nothing), else one warning line when some do not; each names the file, the field and the fix. The
    same for min_tokens above the requests' output lengths (min_tokens_lines)."""
    errors, warnings = min_tokens_lines(scenario, planned, source)
    if errors:
        return errors, warnings
    report = check_fit(scenario, planned)
    if not report.num_rejected:
        return [], warnings
    e = scenario.engine
    cause, _ = report.rejected.most_common(1)[0]
    what = {
        "empty": "an empty prompt",
        "prompt": f"a prompt of max_len {e.max_len} tokens or more (prompts of {_span(report)} tokens)",
        "length": f"prompt + output_tokens above max_len {e.max_len} (up to {report.longest} tokens; prompts of "
                  f"{_span(report)} tokens)",
        "blocks": f"more KV blocks than the pool can give one request ({_usable_blocks(e)} of {e.block_size} "
                  "tokens with the watermark kept free)",
    }[cause]
    fix = {
        "empty": "give the prompts some text or tokens",
        "prompt": "raise engine.max_len or shorten the prompts",
        "length": f"raise engine.max_len to {report.longest} or lower output_tokens, or set engine.on_too_long: cap",
        "blocks": "raise engine.num_blocks (or engine.slots), or lower output_tokens",
    }[cause]
    field = "engine.num_blocks" if cause == "blocks" else "prompts" if cause == "empty" else "engine.max_len"
    if report.num_rejected == report.total:
        return [f"{source}: {field}: none of the {report.total} planned requests fits the engine: each has {what}, "
                f"so every one would be rejected and the run would test nothing; {fix}"], warnings
    return [], warnings + [f"{source}: {field}: {report.num_rejected} of the {report.total} planned requests have "
                           f"{what} and will be rejected; {fix}"]


def min_tokens_lines(scenario, planned, source: str) -> tuple[list[str], list[str]]:
    """(errors, warnings) for min_tokens above output lengths: a request's min_tokens is capped at its own
    output length (SamplingParams needs min_tokens <= max_new_tokens), which is refused in one line when it
    happens to every planned request (min_tokens would mean nothing) and warned about when to some."""
    capped = [p for p in planned if p.min_tokens_asked > p.sampling.max_new_tokens]
    if not capped:
        return [], []
    asked = max(p.min_tokens_asked for p in capped)
    s = scenario.sampling
    field = "sampling.min_tokens" if s.min_tokens == asked else next(
        (f"sampling.mix.{i}.min_tokens" for i, e in enumerate(s.mix) if e.min_tokens == asked), "sampling.min_tokens")
    lengths = sorted(p.sampling.max_new_tokens for p in capped)
    span = f"{lengths[0]}" if lengths[0] == lengths[-1] else f"{lengths[0]}-{lengths[-1]}"
    if len(capped) == len(planned):
        return [f"{source}: {field}: {asked} is above the output length of every planned request ({span} tokens), "
                f"so each would be held to its own length, not to {asked}; lower {field} to {lengths[0]} or less, "
                "or raise output_tokens"], []
    return [], [f"{source}: {field}: {asked} is above the output length of {len(capped)} of the {len(planned)} "
                f"planned requests ({span} tokens); their min_tokens is capped at their length; lower {field} to "
                f"{lengths[0]} or raise output_tokens"]


def _span(report: FitReport) -> str:
    a, b = report.shortest_prompt, report.longest_prompt
    return f"{a}" if a == b else f"{a}-{b}"


def idle_faults(scenario, faults=(), layout: str | None = None, prefix_caching: bool | None = None,
                scenario_faults: bool = True) -> list[tuple[str, str, str]]:
    """Faults that could not act in this run: (fault, where it comes from, why), where a fault comes
    from `faults` (extra ones, e.g. --fault; where: "extra") or the scenario (engine.faults, or a
    timeline switch checked in the layout in effect then; where: the field path), the engine taken
    as the scenario's with `layout` / `prefix_caching` overridden when given."""
    e = scenario.engine
    layout = layout or e.layout
    caching = e.prefix_caching if prefix_caching is None else prefix_caching
    tier = bool(e.kv_offload_blocks)
    found = [(name, "extra", why) for name in faults
             if (why := fault_misfit(name, layout, e.kv, caching, tier) or _request_misfit(name, scenario))]
    if not scenario_faults:
        return found
    found += [(name, "engine.faults", why) for name in e.faults if (why := fault_misfit(name, layout, e.kv, caching, tier))]
    for i, event in enumerate(scenario.timeline):
        layout = event.engine_overrides().get("layout", layout)
        if event.fault_switch and event.fault_switch[1]:
            name = event.fault_switch[0]
            why = fault_misfit(name, layout, e.kv, caching, tier)
            if why:
                found.append((name, f"timeline.{i}.set.fault", why))
    return found


def _request_misfit(name: str, scenario) -> str:
    """Why fault `name` finds no request of its kind in the scenario ("" when it does): cow_missing acts on
    forked sequences (sampling.n > 1), stale_bitmask on structured output's bitmask rows."""
    s = scenario.sampling
    if name == "cow_missing" and (s.n == 1 or s.n_fraction == 0):
        return "fault cow_missing acts on the sequences of a request with n > 1 (sampling.n), and this scenario has none"
    if name == "stale_bitmask" and (s.structured is None or s.structured.fraction == 0):
        return "fault stale_bitmask acts on structured output's bitmask rows (sampling.structured), and this " \
               "scenario has no constrained request"
    return ""
