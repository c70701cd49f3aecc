"""The end-of-run summary table, shared by `kvtui run --headless` and `kvtui replay`."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvtui.scenario.errors import printable


def _plain(text: object) -> str:
    """User or model text for a table: control characters escaped, rich markup taken literally."""
    return escape(printable(str(text)))


def _ms(value) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def print_summary(summary: dict, header: dict, console: Console) -> None:
    """Render the figures of a run (see Metrics.summary for the keys)."""
    scenario = header.get("scenario", {})
    title = (f"{scenario.get('name', '?')} on {header.get('model', {}).get('id', '?')} "
             f"({header.get('clock', '?')} clock, {header.get('engine', {}).get('layout', '?')} layout)")
    table = Table(title=_plain(title), show_header=False, title_justify="left")
    table.add_column("metric", style="bold")
    table.add_column("value")
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(summary["finish_reasons"].items())) or "-"
    ttft, tpot = summary["time_to_first_token_seconds"], summary["time_per_output_token_seconds"]
    rows = [
        ("requests", f"{summary['requests_finished']} ({reasons})"),
        ("prompt tokens", str(summary["prompt_tokens"])),
        ("generated tokens", str(summary["generated_tokens"])),
        ("duration", f"{summary['duration_s']:.2f} s over {summary['steps']} steps "
                     f"(measured step time {summary['measured_step_wall_s']:.2f} s)"),
        ("output tokens/s", f"{summary['output_tokens_per_s']:.1f}"),
        ("prefill / decode tokens/s", f"{summary['prefill_tokens_per_s']:.1f} / {summary['decode_tokens_per_s']:.1f}"),
        ("TTFT p50 / p95", f"{_ms(ttft['p50'])} / {_ms(ttft['p95'])}"),
        ("TPOT p50 / p95", f"{_ms(tpot['p50'])} / {_ms(tpot['p95'])}"),
        ("padding ratio (mean, query / key)",
         f"{summary['kvtui:padding_ratio_mean']:.1%} / {summary['kvtui:key_padding_ratio_mean']:.1%}"),
        ("peak slot occupancy", f"{summary['kvtui:slot_occupancy_peak']:.0%}"),
        ("peak KV usage", f"{summary['kv_cache_usage_perc_peak']:.1%}"),
        ("goodput", f"{summary['goodput_requests_per_s']:.2f} req/s"),
    ]
    if summary.get("kvtui:passphrase_requests"):
        rows.append(("own passphrase echoed",
                     f"{summary['kvtui:passphrase_echoed']}/{summary['kvtui:passphrase_requests']}"))
    if summary.get("stopped_early"):
        rows.append(("stopped early", f"yes ({summary.get('requests_not_submitted', 0)} requests not submitted)"))
    counts = summary.get("kvtui:contamination_events_total", [])
    real = sum(c["value"] for c in counts if c["kind"] != "numeric")
    detail = ", ".join(f"{c['detector']} {c['kind']} {c['value']}" for c in counts)
    rows.append(("contamination events", f"{real}" + (f" ({detail})" if detail else "")))
    if summary.get("contamination_by_fault"):
        rows.append(("events while a fault was on",
                     ", ".join(f"{k} {v}" for k, v in sorted(summary["contamination_by_fault"].items()))))
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)


def print_contamination(events: list[dict], console: Console, limit: int = 12) -> None:
    """One line per contamination event (victim <- source, kind, detector, evidence), numeric ones last."""
    if not events:
        return
    ordered = sorted(events, key=lambda e: (e["kind"] == "numeric", e["step"]))
    table = Table(title="contamination", title_justify="left")
    for column in ("step", "victim <- source", "kind", "detector", "evidence"):
        table.add_column(column)
    for e in ordered[:limit]:
        ev = e.get("evidence", {})
        if "leaked" in ev:
            text = f"says {ev['matched']!r}: …{ev['text'][-60:]!r}"
        elif "foreign_mass" in ev:
            text = f"attention on foreign keys {ev['foreign_mass']:.3f}"
        elif "examples" in ev:
            text = f"{ev['positions']} cells, e.g. slot {ev['examples'][0]['slot']} pos {ev['examples'][0]['pos']}"
        elif "replaced_neighbours" in ev:
            text = (f"token {ev['token_index']} changed: {ev['baseline_text'][:40]!r} -> "
                    f"{ev['text_with_neighbours_replaced'][:40]!r}")
        elif "token_index" in ev:
            text = (f"token {ev['token_index']}: {ev['batched_token']} vs solo {ev['solo_token']} "
                    f"(gap {ev['top2_gap']:.3g}); {ev['batched_text'][:40]!r} vs {ev['solo_text'][:40]!r}")
        else:
            text = str(ev)[:100]
        style = "dim" if e["kind"] == "numeric" else ("red" if e["kind"] == "cross_request" else "yellow")
        table.add_row(str(e["step"]), _plain(f"{e['victim']} <- {e['source'] or '?'}"),
                      f"[{style}]{_plain(e['kind'])}[/]", _plain(e["detector"]), _plain(text))
    if len(ordered) > limit:
        table.caption = f"{len(ordered) - limit} more in the recording"
    console.print(table)
