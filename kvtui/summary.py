"""The end-of-run summary table, shared by `kvtui run --headless` and `kvtui replay`."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from kvtui.events import (
    SKIP_REASONS,
    CanaryEvidence,
    ConstraintEvidence,
    Contamination,
    FlowEvidence,
    Header,
    NoninterferenceEvidence,
    ProvenanceEvidence,
    ReferenceEvidence,
    RequestIdEvidence,
    SamplingEvidence,
    StateEvidence,
    Summary,
    TaintEvidence,
)
from kvtui.scenario.errors import printable


def _ms(value) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def print_summary(summary: Summary, header: Header, console: Console) -> None:
    """Render the figures of a run (see kvtui.events.Summary for the fields)."""
    engine = header.engine
    kv = ""
    if engine.get("kv") == "paged":
        kv = f", paged KV: blocks of {engine.get('block_size')}" + (", prefix caching" if engine.get("prefix_caching")
                                                                      else "")
    if engine.get("batch_invariant"):
        kv += f", batch-invariant (tiles of {engine.get('invariant_tile', '?')})"
    title = (f"{header.scenario.get('name', '?')} on {header.model.id} "
             f"({header.clock} clock, {engine.get('layout', '?')} layout{kv})")
    if header.target:
        title = (f"{header.scenario.get('name', '?')} against {header.target} ({header.model.id}, "
                 f"{header.engine.get('api', '?')} API, client-side wall clock"
                 + (f", sent from {header.engine['workers']} Ray workers" if header.engine.get("workers") else "") + ")")
    # the title on a line of its own: a table's title wraps at the table's width, which broke a long
    # model id (a served path) mid-word although the terminal had room for it
    console.print(Text(printable(title), style="italic"), overflow="fold")
    table = Table(show_header=False, box=None)
    table.add_column("metric", style="bold")
    table.add_column("value")
    for name, value in (_target_rows(summary, header) if header.target else _rows(summary, header=header)):
        if name == "reference checks" and header.reference_tolerance and header.model.dtype != "float32":
            # which tolerance labelled numeric flips (float32's is always the built-in 1e-3)
            value += f"; {tolerance_text(header.reference_tolerance)}"
        table.add_row(name, value)
    console.print(table)
    if summary.request_id_audit:  # one line, never wrapped: for pasting into a report
        console.print(printable(summary.request_id_audit), markup=False, highlight=False, soft_wrap=True)
    fidelity = summary.load_fidelity
    if fidelity is not None and fidelity.warning:  # the one line saying the client set the pace
        console.print(Text.assemble(("warning:", "yellow"), " ", printable(fidelity.warning)), soft_wrap=True)


def tolerance_text(described: dict) -> str:
    """'numeric tolerance 0.75 logits (calibrated on AMD EPYC)', from a header's reference_tolerance
    (kvtui/detect/tolerance.py): the figure and where it came from."""
    if described.get("source") == "batch-invariant":
        return "no numeric tolerance (batch-invariant: a solo rerun reproduces the logits)"
    where = {"calibrated": "calibrated", "measured": "measured at load"}.get(described.get("source"), "built-in")
    on = f" on {described['cpu']}" if described.get("cpu") else ""
    return f"numeric tolerance {described.get('tolerance', 0):.3g} logits ({where}{on})"


def finish_counts(s: Summary) -> str:
    """'stop 6, rejected 2: too_long 2': requests by finish reason, the rejected last with their codes."""
    parts = [f"{k} {v}" for k, v in sorted(s.finish_reasons.items()) if k != "rejected"]
    if s.finish_reasons.get("rejected"):
        codes = ", ".join(f"{k} {v}" for k, v in sorted((s.rejection_reasons or {}).items()))
        parts.append(f"rejected {s.finish_reasons['rejected']}" + (f": {codes}" if codes else ""))
    return ", ".join(parts) or "-"


def requests_text(s: Summary) -> str:
    """'8 (stop 8)'; with parallel sampling '6 submitted, 10 sequences finished (length 10): ...', since each
    of a request's n sequences finishes, and counts in the figures, on its own."""
    reasons = finish_counts(s)
    if s.requests_submitted is None:
        return f"{s.requests_finished} ({reasons})"
    return (f"{s.requests_submitted} submitted, {s.requests_finished} sequences finished ({reasons}): a request with "
            "n > 1 runs as n sequences, and the rows below count sequences")


def canary_blind(s: Summary, header: Header | None) -> bool:
    """Whether the canary could witness nothing: passphrase prompts ran with the canary on, yet no answer held
    a passphrase at all, its own (none echoed) or another request's (no canary report). A model that
    repeats no passphrase (random weights, a model that ignores the prompt) would not repeat a leaked one
    either, so the canary's silence says nothing about isolation."""
    if not s.passphrase_requests or s.passphrase_echoed:
        return False
    if header is not None and header.detectors and "canary" not in header.detectors:
        return False  # the canary did not run: nothing to call blind
    return not any(c.detector == "canary" and c.value for c in s.contamination_events_total)


def passphrase_text(s: Summary, header: Header | None) -> str:
    """'8/8'; when the canary was blind, also that it was and why, and what that leaves the findings."""
    echoed = f"{s.passphrase_echoed}/{s.passphrase_requests}"
    if not canary_blind(s, header):
        return echoed
    blind = (f"{echoed}: the canary was blind: no answer held a passphrase, its own or another's, so it could "
             "witness no leak; ")
    if header is not None and tuple(header.detectors) == ("canary",):
        return blind + "no other detector ran (--detectors canary), so this run could witness none"
    return blind + "findings rest on the other detectors, and a source none of them names shows as ?"


def _rows(s: Summary, target: bool = False, header: Header | None = None) -> list[tuple[str, str]]:
    ttft, tpot = s.time_to_first_token_seconds, s.time_per_output_token_seconds
    rows = [
        ("requests", requests_text(s)),
        *_failed_row(s),
        *_lora_row(s),
        ("prompt tokens", str(s.prompt_tokens)),
        ("generated tokens", str(s.generated_tokens)),
        ("duration", f"{s.duration_s:.2f} s over {s.steps} steps (all steps together took {s.measured_step_wall_s:.2f} s "
                     "measured)"),
        ("output tokens/s", f"{s.output_tokens_per_s:.1f}"),
        ("prefill / decode tokens/s", f"{s.prefill_tokens_per_s:.1f} / {s.decode_tokens_per_s:.1f}"),
        ("TTFT p50 / p95", f"{_ms(ttft.p50)} / {_ms(ttft.p95)}"),
        ("TPOT p50 / p95", f"{_ms(tpot.p50)} / {_ms(tpot.p95)}"),
        ("padding ratio (mean, query / key)", f"{s.padding_ratio_mean:.1%} / {s.key_padding_ratio_mean:.1%}"),
        ("peak slot occupancy", f"{s.slot_occupancy_peak:.0%}"),
        ("peak KV usage", f"{s.kv_cache_usage_perc_peak:.1%}"),
        ("goodput", f"{s.goodput_requests_per_s:.2f} req/s"),
    ]
    rows += _paged_rows(s, target)
    if s.passphrase_requests:
        rows.append(("own passphrase echoed", passphrase_text(s, header)))
    if s.stopped_early:
        unsent = s.requests_not_submitted  # a server plans none: nothing to count as not submitted
        rows.append(("stopped early", f"yes ({unsent} requests not submitted)" if unsent else "yes"))
    if s.requests_in_flight:
        rows.append(("in flight at the end", f"{s.requests_in_flight} requests arrived but never finished"))
    if s.reference_checked is not None:
        rows.append(("reference checks", f"{s.reference_checked} checked" + _reference_cache(s)
                     + skipped_text(s.reference_skipped, s.reference_skipped_by_reason)))
    findings = ", ".join(f"{k} {n}" for k, n in sorted((s.findings_by_kind or {}).items()))
    detail = ", ".join(f"{c.detector} {c.kind} {c.value}" for c in s.contamination_events_total)
    rows.append(("contamination findings", f"{sum((s.findings_by_kind or {}).values())}"
                 + (f" ({'; '.join(part for part in (findings, f'reports: {detail}') if part)})" if detail else "")))
    if s.contamination_by_fault:
        rows.append(("events while a fault was on",
                     ", ".join(f"{k} {v}" for k, v in sorted(s.contamination_by_fault.items()))))
    if s.fault_acts:
        rows.append(("steps a fault acted in", ", ".join(f"{k} {v}" for k, v in sorted(s.fault_acts.items()))))
    return rows


def skipped_text(skipped: int | None, by_reason: dict[str, int] | None) -> str:
    """", 8 skipped: the run was stopped before they were checked" (every reason with its count when
    there are several; '' when nothing was skipped; no reason for a recording that does not say)."""
    if not skipped:
        return ""
    reasons = {k: n for k, n in sorted((by_reason or {}).items()) if n}
    if not reasons:
        return f", {skipped} skipped"
    if len(reasons) == 1:
        return f", {skipped} skipped: {SKIP_REASONS.get(next(iter(reasons)), next(iter(reasons)))}"
    return f", {skipped} skipped (" + "; ".join(f"{n}: {SKIP_REASONS.get(k, k)}" for k, n in reasons.items()) + ")"


def _reference_cache(s: Summary) -> str:
    """What a target server said of its prefix cache on the reference runs (they are sent past it)."""
    text = ""
    if s.reference_uncached_verified:
        every = "each" if s.reference_uncached_verified == s.reference_checked else \
            f"{s.reference_uncached_verified} of them"
        text += f" (the server reported 0 cached prompt tokens for {every})"
    if s.reference_cached:
        text += (f"; {s.reference_cached} not counted: the server took part of their prompts from its prefix "
                 "cache despite a fresh cache_salt")
    return text


FAILED_REASONS = ("error", "abort")


def _failed_row(s: Summary) -> list[tuple[str, str]]:
    """Requests that ended without a complete answer (error, abort), when there are any."""
    failed = {reason: n for reason, n in sorted(s.finish_reasons.items()) if reason in FAILED_REASONS and n}
    if not failed:
        return []
    which = ", ".join(f"{reason} {n}" for reason, n in failed.items())
    return [("failed requests", f"{sum(failed.values())} ({which}): no complete answer, so not in the token "
                                "counts, throughput, latency or reference checks")]


def lora_text(requests: dict[str, int], reloads: dict[str, int]) -> str:
    """'lora-a: 6 requests (v1 3, v2 3), reloaded 1 time; lora-b: 3 requests (v1 3); base model: 3 requests',
    from Summary's lora_requests ("name@version" -> arrived requests; "none": the base model) and
    lora_reloads (name -> timeline reloads). An adapter reloaded but never used still shows."""
    versions: dict[str, list[tuple[int, int]]] = {name: [] for name in reloads}
    unversioned: dict[str, int] = {}
    for key, n in requests.items():
        if key == "none":
            continue
        name, _, version = key.partition("@")
        if version.isdigit():
            versions.setdefault(name, []).append((int(version), n))
        else:  # a recording from before lora_version
            unversioned[name] = unversioned.get(name, 0) + n
            versions.setdefault(name, [])
    parts = []
    for name, seen in sorted(versions.items()):
        total = sum(n for _, n in seen) + unversioned.get(name, 0)
        text = f"{name}: {total} request{'s' if total != 1 else ''}"
        if seen:
            text += f" ({', '.join(f'v{v} {n}' for v, n in sorted(seen))})"
        if reloads.get(name):
            text += f", reloaded {reloads[name]} time{'s' if reloads[name] != 1 else ''}"
        parts.append(text)
    base = requests.get("none", 0)
    parts.append(f"base model: {base} request{'s' if base != 1 else ''}")
    return "; ".join(parts)


def _lora_row(s: Summary) -> list[tuple[str, str]]:
    """The LoRA adapters' row (adapters, their versions and reloads), for a run that used adapters."""
    if s.lora_requests is None:
        return []
    return [("LoRA adapters", lora_text(s.lora_requests, s.lora_reloads or {}))]


def _paged_rows(s: Summary, target: bool) -> list[tuple[str, str]]:
    """Paged KV figures: preemptions, prefix-cache hit rate (tokens) and cross-tenant hits; the encoder cache
    (models with one: encoded, hits, entries held); against a
    target, the server's own prefix-cache counters and the cached prompt tokens it reported."""
    rows = []
    if s.num_preemptions_total is not None:
        rows.append(("preemptions", str(s.num_preemptions_total)))
    if s.prefix_cache_queries:
        rate = s.prefix_cache_hits / s.prefix_cache_queries
        rows.append(("server prefix cache hit rate" if target else "prefix cache hit rate",
                     f"{rate:.1%} ({s.prefix_cache_hits} of {s.prefix_cache_queries} prompt tokens"
                     + (" during the load, the server's counters)" if target else ")")))
    if s.prefix_cache_cross_tenant_hits is not None:
        rows.append(("cross-tenant prefix hits", f"{s.prefix_cache_cross_tenant_hits} tokens"))
    if s.kv_offload_hits is not None:
        rows.append(("KV offload tier", f"{s.kv_offload_hits} of {s.kv_offload_queries} prompt tokens restored; "
                                        f"{s.kv_offload_stores} blocks stored; {s.kv_offload_bytes / 1e6:.1f} MB held"))
    if s.encoder_cache_hits is not None:
        lookups = s.encoder_cache_hits + s.encoder_cache_misses
        size = s.encoder_cache_bytes or 0
        held = f"{size / 1e6:.1f} MB" if size >= 1e6 else f"{size / 1e3:.1f} kB"
        rows.append(("encoder cache", f"{s.encoder_cache_misses} encoded, {s.encoder_cache_hits} hits of {lookups} "
                                      f"lookups; {s.encoder_cache_entries} entries ({held}) held"))
    if s.state_checkpoints is not None:
        # more tokens than the prefix cache's hit row: that row counts first admissions' pool hits only
        rows.append(("recurrent state", f"{s.state_checkpoints} checkpoints kept, {s.state_restores} restored "
                                        f"({s.state_checkpoint_hits} tokens started from them: prefix hits, tier "
                                        "restores and re-admissions after preemption)"))
    if s.prompt_tokens_cached is not None:
        rows.append(("cached prompt tokens", f"{s.prompt_tokens_cached} of {s.prompt_tokens} (the server's usage, "
                                             "per request)"))
    rows += trace_hit_rows(s.trace_prefix_hits)
    return rows


def trace_hit_rows(table: dict | None) -> list[tuple[str, str]]:
    """A trace run's prefix hits: the trace's theoretical rate beside what the server said it cached, for all
    requests and each tenant."""
    rows = []
    for who, f in (table or {}).items():
        theory = f["trace_hit_tokens"] / f["trace_prompt_tokens"] if f["trace_prompt_tokens"] else 0.0
        said = "the server reported no cached tokens" if f["cached_tokens"] is None else (
            f"server cached {f['cached_tokens'] / f['prompt_tokens']:.1%} ({f['cached_tokens']} of "
            f"{f['prompt_tokens']})" if f["prompt_tokens"] else "no prompt tokens counted by the server")
        rows.append((f"trace prefix hits ({who})", f"{theory:.1%} in theory ({f['trace_hit_tokens']} of "
                                                  f"{f['trace_prompt_tokens']} prompt tokens); {said}"))
    return rows


ENGINE_ONLY_ROWS = ("duration", "prefill / decode tokens/s", "padding ratio (mean, query / key)",
                    "peak slot occupancy", "peak KV usage")


def _target_rows(s: Summary, header: Header | None = None) -> list[tuple[str, str]]:
    """A server timed from outside: the engine-only rows (steps, padding, slots) give way to client-side
    request figures and the server's own gauges. A transcription server's output is counted in words (its
    transcripts split at spaces: the endpoint returns text, no token counts), and its rows say so."""
    itl, e2e = s.inter_token_latency_seconds, s.e2e_request_latency_seconds
    extra = {
        "output tokens/s": [("duration", f"{s.duration_s:.2f} s"),
                            ("request throughput", f"{s.request_throughput_per_s:.2f} req/s")],
        "TPOT p50 / p95": [("ITL p50 / p95", f"{_ms(itl.p50)} / {_ms(itl.p95)}"),
                           ("E2E latency p50 / p95", f"{_ms(e2e.p50)} / {_ms(e2e.p95)}")]
        + ([("server peak KV usage / waiting", f"{s.kv_cache_usage_perc_peak:.1%} / {s.num_requests_waiting_peak}")]
           if s.kv_cache_usage_perc_peak or s.num_requests_waiting_peak else []),
    }
    if s.load_fidelity is not None:
        extra["goodput"] = fidelity_rows(s.load_fidelity)
    words = header is not None and header.engine.get("api") == "transcription"
    rows = []
    for name, value in _rows(s, target=True, header=header):
        if name not in ENGINE_ONLY_ROWS:
            row = WORD_ROWS[name](value) if words and name in WORD_ROWS else (name, value)
            rows += [row] + extra.get(name, [])
    return rows


def fidelity_rows(f) -> list[tuple[str, str]]:
    """A target run's load fidelity (kvtui.events.LoadFidelity): the schedule lag, the rate asked and sent,
    and the client's CPU."""
    rate = (f"{f.requested_rate_per_s:.1f} / {f.achieved_rate_per_s:.1f} req/s"
            if f.requested_rate_per_s is not None and f.achieved_rate_per_s is not None else
            "- (fewer than two sends, or all planned at one instant)")
    capped = f"; {f.capped} waited for --max-concurrency (not counted as lag)" if f.capped else ""
    each = " each" if f.senders > 1 else ""
    cpu = f"{f.client_cpu_s:.2f} s over {f.wall_s:.2f} s" + (f" ({f.client_cpu_share:.0%} of a core{each})"
                                                             if f.client_cpu_share is not None else "")
    def ms(v) -> str:
        return "-" if v is None else f"{v * 1000:.1f} ms"

    return [("schedule lag p50 / p99 / max", f"{ms(f.lag_p50_s)} / {ms(f.lag_p99_s)} / {ms(f.lag_max_s)}{capped}"),
            ("rate requested / achieved", rate),
            ("client CPU (the load)" if f.senders == 1 else f"client CPU (the load, {f.senders} Ray workers)", cpu)]


# a transcription target's rows: its output is words (the transcript split at spaces), not tokens
WORD_ROWS = {
    "generated tokens": lambda value: ("generated words", f"{value} (transcripts split at spaces: the transcription "
                                                          "API returns text, not tokens)"),
    "output tokens/s": lambda value: ("output words/s", value),
}


EXCERPT_CHARS = 40  # characters of each text a changed-answer report shows
EXCERPT_LEAD = 10  # characters kept before the first difference when the excerpt does not start at 0


def differing_excerpts(a: str, b: str, width: int = EXCERPT_CHARS) -> tuple[str, str]:
    """Excerpts of two texts, `width` characters each at most, cut at the same offset so that the first
    character where they differ is inside both: from the start when it lies within the first
    width - EXCERPT_LEAD characters, else from EXCERPT_LEAD characters before it; "…" marks a cut."""
    first = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    start = 0 if first < width - EXCERPT_LEAD else first - EXCERPT_LEAD

    def cut(text: str) -> str:
        return ("…" if start else "") + text[start:start + width] + ("…" if len(text) > start + width else "")

    return cut(a), cut(b)


def evidence_text(e: Contamination) -> str:
    """One line of a report's evidence, by its detector's evidence type."""
    ev = e.evidence
    if isinstance(ev, CanaryEvidence):
        return f"says {ev.matched!r}: …{ev.text[-60:]!r}"
    if isinstance(ev, FlowEvidence):
        return f"attention on foreign keys {ev.foreign_mass:.3f}" if ev.foreign_mass is not None else "non-finite"
    if isinstance(ev, TaintEvidence):
        first = ev.examples[0] if ev.examples else None
        if first is not None and first.block is not None:
            return f"{ev.positions} cells, e.g. block {first.block} offset {first.offset}"
        return f"{ev.positions} cells" + (f", e.g. slot {first.slot} pos {first.pos}" if first else "")
    if isinstance(ev, ProvenanceEvidence) and ev.audio_hash is not None:
        return f"encoder-cache hit: cross-attention K/V of audio {ev.source_audio_hash} for audio {ev.audio_hash}"
    if isinstance(ev, ProvenanceEvidence):
        blocks = ", ".join(map(str, ev.blocks[:4])) + (" ..." if len(ev.blocks) > 4 else "")
        tenants = "" if ev.source_tenant is None and ev.victim_tenant is None else \
            f" by tenant {ev.source_tenant} for tenant {ev.victim_tenant}"
        return (f"{ev.hit_tokens} tokens of blocks {blocks} computed{tenants} under "
                f"{'the same' if ev.same_salt else 'another'} salt, {'the same' if ev.same_prefix else 'another'} "
                "prefix")
    if isinstance(ev, NoninterferenceEvidence):
        before, after = differing_excerpts(ev.baseline_text, ev.text_with_neighbours_replaced)
        return f"token {ev.token_index} changed: {before!r} -> {after!r}"
    if isinstance(ev, SamplingEvidence):
        return _sampling_text(ev, e.source)
    for kind, text in ((ReferenceEvidence, _reference_text), (ConstraintEvidence, _constraint_text),
                       (RequestIdEvidence, request_id_text), (StateEvidence, state_text)):
        if isinstance(ev, kind):
            return text(ev)
    return str(ev.model_dump())[:100]


def state_text(ev: StateEvidence) -> str:
    """e.g. "restored a checkpoint for 32 tokens: r000's state of 48 other tokens (slot 0), kept by r001", or
    "a fresh start (slot 1) read r000's state of 21 tokens"."""
    got = f"{ev.writer}'s state of {ev.writer_tokens} other tokens" if ev.writer else "the zero state"
    kept = f", kept by {ev.publisher}" if ev.publisher else ""
    if ev.via == "slot":
        return f"a fresh start (slot {ev.slot}) read {got}"
    what = "restored a checkpoint" if ev.via == "checkpoint" else "forked"
    return f"{what} for {ev.tokens} tokens: {got} (slot {ev.slot}){kept}"


def request_id_text(ev: RequestIdEvidence) -> str:
    """e.g. "id 'kvtui-1a2b3c-001' shared with r002 in flight: no whole answer within 30 s (...)", or for a
    probe "fresh id '...-probe-0': HTTP 503: ...; 0 of 2 probes answered, /health 503"."""
    if ev.group in ("probe", "health"):
        what = f"fresh id {ev.client_id!r}: " if ev.group == "probe" else "GET /health: "
        health = f", /health {ev.health_status}" if ev.health_status is not None else ""
        return f"{what}{ev.outcome}; {ev.probes_answered} of {ev.probes_sent} probes answered{health}"
    shared = f" shared with {', '.join(ev.shares_id_with)}" + (" in flight" if ev.overlapped else "") \
        if ev.shares_id_with else ""
    return f"id {ev.client_id!r} ({ev.group}){shared}: {ev.outcome}"


def _reference_text(ev: ReferenceEvidence) -> str:
    gap = "n/a" if ev.top2_gap is None else f"{ev.top2_gap:.3g}"
    batched, solo = differing_excerpts(ev.batched_text, ev.solo_text)
    if ev.batched_token is None and (ev.batched_piece is not None or ev.solo_piece is not None):
        return (f"token {ev.token_index}: {ev.batched_piece!r} vs solo {ev.solo_piece!r} (gap {gap}); "
                f"{batched!r} vs {solo!r}")
    if ev.draw_tolerance is not None:  # a sampled token: how far the draw's boundary and the logits moved
        shift = "past the recorded ranks" if ev.draw_shift is None else \
            f"{ev.draw_shift:.3g} of {ev.draw_tolerance:.3g}"
        spread = "not comparable" if ev.logit_spread is None else f"{ev.logit_spread:.3g} of {ev.tolerance:.3g}"
        why = f"draw shift {shift}, logits moved {spread}" if ev.draw_u is not None else "no draw recorded"
    else:
        why = f"gap {gap}"
    return (f"token {ev.token_index}: {ev.batched_token} vs solo {ev.solo_token} ({why}){_flips(ev)}; "
            f"{batched!r} vs {solo!r}")


def _sampling_text(ev: SamplingEvidence, source: str | None) -> str:
    """e.g. "token 3 (564) sampled with r002's row state; generator seeded by r002, drawn by r004"."""
    parts = []
    if "row_state" in ev.via:
        parts.append(f"sampled with {source}'s row state")
    if "generator" in ev.via:
        seeded, *drew = ev.generator
        parts.append(f"generator seeded by {seeded}" + (f", drawn by {', '.join(drew)}" if drew else ""))
    if "penalty_history" in ev.via:
        parts.append(f"penalties counted {', '.join(ev.penalty_history)}")
    return f"token {ev.token_index} ({ev.token_id}) " + "; ".join(parts)


def _flips(ev: ReferenceEvidence) -> str:
    """', after 2 numeric flips from token 3' (a divergence found past numeric flips, teacher-forced);
    ', 2 numeric flips, none counted' (a numeric report whose continuation was checked); '' otherwise."""
    if ev.numeric_flips is None:
        return ""
    if ev.first_divergence is not None and ev.token_index != ev.first_divergence:
        return f", after {ev.numeric_flips} numeric flips from token {ev.first_divergence}"
    return f", {ev.numeric_flips} numeric flips, none counted" if ev.numeric_flips else ""


def _constraint_text(ev: ConstraintEvidence) -> str:
    if ev.rule == "grammar_bitmask":
        return (f"token {ev.token_index} ({ev.token_id}) was sampled through bitmask row {ev.bitmask_row}, which "
                f"{', '.join(ev.suspects)}'s grammar filled")
    by = f", picked by {ev.sampled_with}'s row state" if ev.sampled_with else ""
    return f"token {ev.token_index} ({ev.token_id}) is banned by its own {ev.rule}{by}"


def print_contamination(events: list[Contamination], console: Console, limit: int = 12,
                        recording=None) -> None:
    """One line per contamination event (victim <- source, kind, detector, evidence), numeric ones last;
    beyond `limit`, a count and where the rest are (`recording`, the file that holds them, if any)."""
    if not events:
        return
    ordered = sorted(events, key=lambda e: (e.kind in ("numeric", "unknown"), e.step))
    table = Table(title="contamination", title_justify="left", box=None)
    for column in ("step", "victim <- source", "kind", "detector", "evidence"):
        table.add_column(column)
    for e in ordered[:limit]:
        style = "dim" if e.kind in ("numeric", "unknown") else ("red" if e.kind in ("cross_request", "cross_tenant")
                                                                else "yellow")
        table.add_row(str(e.step) if e.step >= 0 else "-", escape(printable(f"{e.victim} <- {e.source or '?'}")), f"[{style}]{e.kind}[/]",
                      e.detector, escape(printable(evidence_text(e))))
    if len(ordered) > limit:
        table.caption = (f"{len(ordered) - limit} more in {recording}" if recording else
                         f"{len(ordered) - limit} more not shown")
    console.print(table)
