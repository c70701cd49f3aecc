"""The dashboard's engine panels for a target server: (Snapshot, width, height) -> a Rich renderable,
drawn from the snapshot's ServerView (kvtui/tui/server_track.py). A figure the server does not expose is
said in words, never drawn as 0."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text

from kvtui.tui.draw import RED, bar, color, ms, sparkline

NO_SLOTS = ("the server exposes no slot map: llama.cpp's /slots does (start it with --slots); "
            "vLLM, SGLang and TGI show none")
NO_SLOT_DETAIL = "set LLAMA_SERVER_SLOTS_DEBUG=1 on llama-server to see each slot's context and request"


def slot_map(snap, width: int, height: int) -> Text | Group:
    """One line per llama.cpp slot: busy or idle, the run's request in it when the server says, the
    slot's context (prompt + generated tokens) against its n_ctx; else why there is no slot map."""
    view = snap.server
    if view.samples == 0:
        return Text(f"waiting for {view.url}/slots and /metrics…" if not snap.done else
                    f"{NO_SLOTS}.", style="dim")
    if view.slots is None:
        kv = "" if view.kv_usage is None else f"; the server's KV cache is {view.kv_usage:.1%} in use"
        return Text(f"{NO_SLOTS}{kv}.", style="dim")
    lines = []
    detail = False
    for s, colour in zip(view.slots[: max(height - 1, 1)], view.slot_colors):
        line = Text(f"{s.id:>3} ")
        if not s.busy:
            lines.append(line.append(f"idle · n_ctx {s.n_ctx or '?'}", style="dim"))
            continue
        owner = s.request_id or "busy"
        line.append(f" {owner} ", style=f"bold black on {color(colour)}" if colour >= 0 else "bold reverse")
        if s.context_tokens is not None and s.n_ctx:
            detail = True
            room = max(width - line.cell_len - 14, 4)
            line.append(" ").append(bar(s.context_tokens / s.n_ctx, room), style=color(colour))
            line.append(f" {s.context_tokens}/{s.n_ctx}")
        lines.append(line)
    busy = sum(1 for s in view.slots if s.busy)
    foot = f"{busy}/{len(view.slots)} slots busy (llama.cpp /slots)"
    lines.append(Text(foot if detail or not busy else f"{foot} · {NO_SLOT_DETAIL}", style="dim"))
    return Group(*lines)


def _gauge(value: float | None, fmt: str, missing: str = "not exposed") -> str:
    return missing if value is None else format(value, fmt)


def stats(snap, width: int, height: int) -> Group:
    """What the terminal monitors of vLLM, SGLang and llama.cpp show, under whichever names the server has,
    one line each with its history: token rates, KV usage, running and waiting, prefix hit rate, speculative
    acceptance (each or 'not exposed'); then the client's counts, TTFT / TPOT as it measured them, the latest
    finding (victim ← source) and how faithfully it kept the schedule. Lines are cut at the width."""
    view = snap.server
    spark_w = max(width - 34, 4)
    lines = []
    gen = view.generation_rate
    rates = Text("prompt   ", style="bold").append(f"{view.prompt_rate:.0f} tok/s" if view.prompt_rate is not None
                                                   else "not exposed")
    rates.append("  generate ", style="bold").append(f"{gen:.0f} tok/s " if gen is not None else "not exposed")
    lines.append(rates.append(sparkline(view.generation_history, spark_w) if gen is not None else "", style="#59a14f"))
    kv = Text("KV usage ", style="bold")
    if view.kv_usage is None:
        kv.append("not exposed (vllm:kv_cache_usage_perc, sglang:token_usage, llamacpp:kv_cache_usage_ratio)",
                  style="dim")
    else:
        kv.append(f"{view.kv_usage:7.1%} ").append(sparkline(view.kv_history, spark_w, 1.0), style="#4e79a7")
    lines.append(kv)
    server = Text("server   ", style="bold").append(f"running {_gauge(view.running, '.0f')}  "
                                                     f"waiting {_gauge(view.waiting, '.0f')}")
    if view.running is not None:
        server.append("  run ").append(sparkline(view.running_history, spark_w // 2), style="#f28e2b")
        server.append(" wait ").append(sparkline(view.waiting_history, spark_w // 2), style="#e15759")
    lines.append(server)
    lines.append(Text("prefix   ", style="bold").append(*_prefix(view)).append(
        " " + sparkline(view.hit_history, spark_w, 1.0) if view.hit_rate is not None else "", style="#76b7b2"))
    lines.append(Text("spec     ", style="bold").append(*_spec(view)))
    lines.append(Text("client   ", style="bold").append(
        f"streaming {snap.running}  no token yet {snap.waiting}  finished {snap.finished}"))
    lines.append(Text("TTFT     ", style="bold").append(f"p50 {ms(snap.ttft.p50):>8}  p95 {ms(snap.ttft.p95):>8}")
                 .append("  TPOT ", style="bold").append(f"p50 {ms(snap.tpot.p50)}  p95 {ms(snap.tpot.p95)}"))
    lines.append(Text("finding  ", style="bold").append(*_latest_finding(snap)))
    lines.append(Text("sending  ", style="bold").append(*_fidelity(view.fidelity)))
    for line in lines:
        line.no_wrap = True
        line.truncate(width)
    return Group(*lines)


def _spec(view) -> tuple[str, str | None]:
    """Speculative decoding: vLLM's acceptance rate, SGLang's accept length, with their history."""
    if view.spec is None and view.spec_exposed:
        return "nothing drafted (the server's speculative decoding is off or idle)", "dim"
    if view.spec is None:
        return "not exposed (vllm:spec_decode_num_accepted_tokens, sglang:spec_accept_length)", "dim"
    value, unit = view.spec
    shown = f"{value:.1%} accepted" if unit == "accepted" else f"{value:.2f} {unit}"
    top = 1.0 if unit == "accepted" else None
    return f"{shown} {sparkline(view.spec_history, 24, top)}", None


def _latest_finding(snap) -> tuple[str, str | None]:
    """kvtui's own verdict beside the server's figures: the latest report, victim ← source."""
    counted = [c for c in snap.contamination if c.kind not in ("numeric", "unknown")]
    if not counted:
        return "none yet", "dim"
    c = counted[-1]
    return f"{c.victim} ← {c.source or '?'} ({c.detector}, {c.kind})", f"bold {RED}"


def _fidelity(f) -> tuple[str, str | None]:
    """The client's own pace (kvtui.events.LoadFidelity): schedule lag, rate asked and sent, its CPU; the
    warning when the client, not the server, limited the run."""
    if f is None:
        return "lag and rate come with the first finished requests", "dim"
    lag = "-" if f.lag_p99_s is None else f"lag p50 {f.lag_p50_s * 1000:.1f} p99 {f.lag_p99_s * 1000:.1f} ms"
    rate = ("" if f.requested_rate_per_s is None or f.achieved_rate_per_s is None else
            f"  {f.achieved_rate_per_s:.1f}/{f.requested_rate_per_s:.1f} req/s")
    cpu = "" if f.client_cpu_share is None else f"  CPU {f.client_cpu_share:.0%}"
    if f.warning:
        return f"{lag}{rate}{cpu}\n{f.warning}", "yellow"
    return f"{lag}{rate}{cpu}", None


def _prefix(view) -> tuple[str, str | None]:
    """The server's prefix cache: hit rate by its counters, and the cached tokens its responses reported."""
    parts = []
    if view.prefix_queries:
        parts.append(f"hits {view.prefix_hits / view.prefix_queries:.1%} ({view.prefix_hits:.0f} of "
                     f"{view.prefix_queries:.0f} tok)")
    if view.cached_tokens is not None:
        parts.append(f"cached {view.cached_tokens} of {view.prompt_tokens} prompt tok (usage)")
    if not view.prefix_queries and view.hit_rate is not None:  # SGLang's gauge, llama.cpp's cached prompt tokens
        source = "llamacpp:prompt_tokens_cached" if view.kind == "llama.cpp" else "sglang:cache_hit_rate"
        parts.insert(0, f"hits {view.hit_rate:.1%} ({source})")
    if not parts:
        return "not exposed (vllm:prefix_cache_hits, sglang:cache_hit_rate, usage.prompt_tokens_details)", "dim"
    return "  ".join(parts), None


def header_status(snap) -> Text:
    """The header's isolation cell for a target: the client cannot know the server's faults."""
    return Text(f" target {snap.server.url} ", style="bold #000000 on #87afd7")
