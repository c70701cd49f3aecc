"""The end-of-run summary table, shared by `kvtui run --headless` and `kvtui replay`."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvtui.events import (
    CanaryEvidence,
    Contamination,
    FlowEvidence,
    Header,
    NoninterferenceEvidence,
    ProvenanceEvidence,
    ReferenceEvidence,
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
    title = (f"{header.scenario.get('name', '?')} on {header.model.id} "
             f"({header.clock} clock, {engine.get('layout', '?')} layout{kv})")
    if header.target:
        title = (f"{header.scenario.get('name', '?')} against {header.target} ({header.model.id}, "
                 f"{header.engine.get('api', '?')} API, client-side wall clock)")
    table = Table(title=escape(printable(title)), show_header=False, title_justify="left", box=None)
    table.add_column("metric", style="bold")
    table.add_column("value")
    for name, value in (_target_rows(summary) if header.target else _rows(summary)):
        table.add_row(name, value)
    console.print(table)


def _rows(s: Summary) -> list[tuple[str, str]]:
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(s.finish_reasons.items())) or "-"
    ttft, tpot = s.time_to_first_token_seconds, s.time_per_output_token_seconds
    rows = [
        ("requests", f"{s.requests_finished} ({reasons})"),
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
    rows += _paged_rows(s)
    if s.passphrase_requests:
        rows.append(("own passphrase echoed", f"{s.passphrase_echoed}/{s.passphrase_requests}"))
    if s.stopped_early:
        rows.append(("stopped early", f"yes ({s.requests_not_submitted} requests not submitted)"))
    if s.requests_in_flight:
        rows.append(("in flight at the end", f"{s.requests_in_flight} requests arrived but never finished"))
    if s.reference_checked is not None:
        rows.append(("reference checks", f"{s.reference_checked} checked"
                     + (f", {s.reference_skipped} skipped (sampled out or left at a stop)" if s.reference_skipped else "")))
    findings = ", ".join(f"{k} {n}" for k, n in sorted((s.findings_by_kind or {}).items()))
    detail = ", ".join(f"{c.detector} {c.kind} {c.value}" for c in s.contamination_events_total)
    rows.append(("contamination findings", f"{sum((s.findings_by_kind or {}).values())}"
                 + (f" ({findings}; reports: {detail})" if detail else "")))
    if s.contamination_by_fault:
        rows.append(("events while a fault was on",
                     ", ".join(f"{k} {v}" for k, v in sorted(s.contamination_by_fault.items()))))
    return rows


def _paged_rows(s: Summary) -> list[tuple[str, str]]:
    """Paged KV figures: preemptions, prefix-cache hit rate (tokens) and cross-tenant hits."""
    rows = []
    if s.num_preemptions_total is not None:
        rows.append(("preemptions", str(s.num_preemptions_total)))
    if s.prefix_cache_queries:
        rate = s.prefix_cache_hits / s.prefix_cache_queries
        rows.append(("prefix cache hit rate", f"{rate:.1%} ({s.prefix_cache_hits} of {s.prefix_cache_queries} "
                                              "prompt tokens)"))
        rows.append(("cross-tenant prefix hits", f"{s.prefix_cache_cross_tenant_hits} tokens"))
    return rows


ENGINE_ONLY_ROWS = ("duration", "prefill / decode tokens/s", "padding ratio (mean, query / key)",
                    "peak slot occupancy", "peak KV usage")


def _target_rows(s: Summary) -> list[tuple[str, str]]:
    """A server timed from outside: the engine-only rows (steps, padding, slots) give way to client-side
    request figures and the server's own gauges."""
    itl, e2e = s.inter_token_latency_seconds, s.e2e_request_latency_seconds
    extra = {
        "output tokens/s": [("duration", f"{s.duration_s:.2f} s"),
                            ("request throughput", f"{s.request_throughput_per_s:.2f} req/s")],
        "TPOT p50 / p95": [("ITL p50 / p95", f"{_ms(itl.p50)} / {_ms(itl.p95)}"),
                           ("E2E latency p50 / p95", f"{_ms(e2e.p50)} / {_ms(e2e.p95)}")]
        + ([("server peak KV usage / waiting", f"{s.kv_cache_usage_perc_peak:.1%} / {s.num_requests_waiting_peak}")]
           if s.kv_cache_usage_perc_peak or s.num_requests_waiting_peak else []),
    }
    rows = []
    for row in _rows(s):
        if row[0] not in ENGINE_ONLY_ROWS:
            rows += [row] + extra.get(row[0], [])
    return rows


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
    if isinstance(ev, ProvenanceEvidence):
        blocks = ", ".join(map(str, ev.blocks[:4])) + (" ..." if len(ev.blocks) > 4 else "")
        tenants = "" if ev.source_tenant is None and ev.victim_tenant is None else \
            f" by tenant {ev.source_tenant} for tenant {ev.victim_tenant}"
        return (f"{ev.hit_tokens} tokens of blocks {blocks} computed{tenants} under "
                f"{'the same' if ev.same_salt else 'another'} salt, {'the same' if ev.same_prefix else 'another'} "
                "prefix")
    if isinstance(ev, NoninterferenceEvidence):
        return (f"token {ev.token_index} changed: {ev.baseline_text[:40]!r} -> "
                f"{ev.text_with_neighbours_replaced[:40]!r}")
    if isinstance(ev, ReferenceEvidence):
        gap = "n/a" if ev.top2_gap is None else f"{ev.top2_gap:.3g}"
        if ev.batched_token is None and (ev.batched_piece is not None or ev.solo_piece is not None):
            return (f"token {ev.token_index}: {ev.batched_piece!r} vs solo {ev.solo_piece!r} (gap {gap}); "
                    f"{ev.batched_text[:40]!r} vs {ev.solo_text[:40]!r}")
        if ev.draw_tolerance is not None:  # a sampled token: how far the draw's boundary and the logits moved
            shift = "n/a" if ev.draw_shift is None else f"{ev.draw_shift:.3g}"
            spread = "n/a" if ev.logit_spread is None else f"{ev.logit_spread:.3g}"
            why = f"draw shift {shift} of {ev.draw_tolerance:.3g}, logits moved {spread} of {ev.tolerance:.3g}"
        else:
            why = f"gap {gap}"
        return (f"token {ev.token_index}: {ev.batched_token} vs solo {ev.solo_token} ({why}); "
                f"{ev.batched_text[:40]!r} vs {ev.solo_text[:40]!r}")
    return str(ev.model_dump())[:100]


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
