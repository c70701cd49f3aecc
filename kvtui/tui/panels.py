"""Panels as pure functions: (Snapshot, width, height) -> a Rich renderable. No Textual here.

Colour is never the only carrier of meaning (NO_COLOR turns the screen monochrome): a leak is also
written `LEAK`, a reused slot `↻`, a free slot `free`, isolation `ON`/`OFF`; in the block map a
shared block shows its reference count, a cached free block `░`, a free block `·`.
"""

from __future__ import annotations

import re
import textwrap

from rich.console import Group
from rich.table import Table
from rich.text import Text

from kvtui.tui import server_panels
from kvtui.tui.draw import LEAK_STYLE, RED, SPARKS, bar, clean, color, ms, sparkline
from kvtui.tui.snapshot import BlockView, RequestView, SlotView, Snapshot, StateSlotView

PACE_SHOWN_BELOW = 0.95  # the header says the paced clock's pace when it runs slower than this
SHORT_KINDS = {"cross_request": "cross", "cross_tenant": "tenant", "corruption": "corrupt"}  # narrow panel


# -- header --------------------------------------------------------------------------------------
def _status_line(snap: Snapshot, mode: str) -> Text:
    """The header's right part: mode, isolation state (ON, or OFF with the faults) and leak count."""
    tail = Text(f" {mode} ", style="bold reverse" if mode.startswith(("PAUSED", "DONE", "END", "CLOSING")) else "bold")
    tail.append("  ")
    if snap.server is not None:
        tail.append_text(server_panels.header_status(snap))
    elif snap.isolation_on:
        tail.append(" isolation ON ", style="bold #000000 on #5fd75f")
    else:
        tail.append(f" isolation OFF: {', '.join(snap.active_faults)} ", style="bold #ffffff on #c00000")
    if snap.leaks:
        tail.append(f"  LEAKS {snap.leaks}", style=LEAK_STYLE)
    return tail


def header(snap: Snapshot | None, mode: str, width: int) -> Text:
    """One line: scenario, [model, dtype, clock, layout when they fit], step, elapsed, the paced clock's
    pace when it runs behind real time ("0.6x real time"), mode, isolation state (ON, or OFF with the
    active faults), leak count. Where the line is short, the details go first, then the step number,
    then the words of the pace ("0.6x"), so the mode, the isolation state and the leaks always fit."""
    text = Text().append(" kvtui ", style="bold reverse")  # (a Text's own style would cover all it holds)
    if snap is None or snap.clock == "?":  # no header yet: the model or tokenizer is still loading
        return text.append(f"  {mode}  loading…")
    text.append(f" {snap.scenario} ", style="bold")
    details = ("· {snap.model} {snap.dtype} · {snap.clock} clock · {snap.layout} ", "· {snap.model} · {snap.clock} ",
               "· {snap.model} ", "· {short} ", "")
    clock = ((f" step {max(snap.step, 0)} · {snap.t:.1f} s  ", f" {snap.t:.1f} s  ") if snap.server is None
             else (f" {snap.t:.1f} s  ",))
    behind = snap.pace is not None and snap.pace < PACE_SHOWN_BELOW  # the paced clock fell behind real time
    paces = (f"{snap.pace:.1f}x real time", f"{snap.pace:.1f}x") if behind else ("",)
    status = _status_line(snap, mode)
    short = snap.model.rstrip("/").rsplit("/", 1)[-1]  # a served model's id is often a folder path
    choices = [(d.format(snap=snap, short=short), c, p) for c in clock for p in paces for d in details]
    choices.sort(key=lambda x: (paces.index(x[2]), clock.index(x[1])))  # the pace's words kept longest
    for detail, time, pace in choices + [("", clock[-1], paces[-1])]:
        if text.cell_len + len(detail) + len(time) + (len(pace) + 2 if pace else 0) + status.cell_len <= width:
            break
    text.append(detail).append(time)
    if pace:
        text.append(pace, style="bold #000000 on #edc948").append("  ")
    text.append_text(status)
    text.truncate(width)
    return text


# -- slot map ------------------------------------------------------------------------------------
def _slot_cell(slot: SlotView, cell: int) -> Text:
    if slot.owner is None:
        label = f"{slot.index:>3} free"
        if slot.previous_owner:
            label += f" (was {slot.previous_owner})"
        return Text(label[:cell].ljust(cell), style="dim")
    mark = "↻" if slot.just_reused else " "
    fill = slot.cache_len / slot.capacity if slot.capacity else 0.0
    head = f"{slot.index:>3} {slot.owner}{mark}"
    if slot.audio and cell >= 40:  # a speech request: its clip
        head += f" {slot.audio.removesuffix('.wav')[:18]}"
    elif slot.image and cell >= 40:  # an image request: its picture
        head += f" img:{slot.image.removesuffix('.png')[:14]}"
    tail = f" {slot.cache_len}"
    width = max(cell - len(head) - len(tail) - 1, 2)
    text = Text().append(f"{head} ", style=f"bold black on {color(slot.color)}")
    text.append(bar(fill, width), style=color(slot.color))
    text.append(tail, style="bold" if slot.just_reused else "")
    return text


# -- recurrent-state slots (hybrid models) ------------------------------------------------------------
def _state_cell(s: StateSlotView) -> Text:
    if s.owner is None:
        return Text(f"{s.index} free", style="dim")
    text = Text(f"{s.index} ").append(s.owner, style=f"bold black on {color(s.color)}")
    return text.append(f" @{s.checkpoint if s.checkpoint is not None else '-'}")


def state_strip(snap: Snapshot, width: int) -> Text:
    """A hybrid's recurrent-state slots beside its KV: "state slots (owner @checkpoint) 2/8 · 0 r003 @48 · 1 r005
    @- · 6 free": each slot in use with its index, owner (coloured) and the positions of the owner's last state
    checkpoint (`-`: none yet); the free slots counted (dim)."""
    used = [s for s in snap.state_slots if s.owner]
    text = Text(f"state slots (owner @checkpoint) {len(used)}/{len(snap.state_slots)}", style="bold")
    for s in used:
        text.append(" · ").append_text(_state_cell(s))
    if len(used) < len(snap.state_slots):
        text.append(f" · {len(snap.state_slots) - len(used)} free", style="dim")
    return text


def _height(text: Text, width: int) -> int:
    """Lines `text` takes wrapped at `width` (a rough count: its length over the width)."""
    return max(-(-text.cell_len // max(width, 1)), 1)


def slot_map(snap: Snapshot, width: int, height: int) -> Text | Group:
    """One cell per slot: index, owner (coloured), fill bar of cache_len/capacity, cache_len; `↻`
    marks a slot reused within the last few steps; free slots dim. Falls back to one character per
    slot (fill height as ▁..█ in the owner's colour, · free) when the cells do not fit. A target
    server's run shows the server's own slots (kvtui/tui/server_panels.py). A hybrid model's recurrent-state
    slots follow (state_strip)."""
    if snap.server is not None:
        return server_panels.slot_map(snap, width, height)
    if not snap.slots:
        return Text("no slots yet", style="dim")
    if snap.state_slots:
        strip = state_strip(snap, width)
        return Group(_kv_slots(snap, width, max(height - _height(strip, width), 2)), strip)
    return _kv_slots(snap, width, height)


def _kv_slots(snap: Snapshot, width: int, height: int) -> Text | Group:
    cell = 26
    if len(snap.slots) <= height - 1:  # room for one slot per line: use the whole width
        cell, per_row = max(width - 1, 20), 1
    else:
        per_row = max(width // (cell + 1), 1)
    rows = -(-len(snap.slots) // per_row)
    if rows > height - 1 and width > 0:
        text = Text()
        for s in snap.slots:
            if s.owner is None:
                text.append("·", style="dim")
            else:
                level = min(len(SPARKS) - 1, int(s.cache_len / max(s.capacity, 1) * (len(SPARKS) - 1)))
                text.append("↻" if s.just_reused else SPARKS[level], style=f"bold {color(s.color)}")
        used = sum(1 for s in snap.slots if s.owner)
        return Group(Text(f"{used}/{len(snap.slots)} slots in use", style="bold"), text)
    lines = []
    for start in range(0, len(snap.slots), per_row):
        line = Text()
        for s in snap.slots[start:start + per_row]:
            line.append_text(_slot_cell(s, cell))
            line.append(" ")
        lines.append(line)
    used = sum(1 for s in snap.slots if s.owner)
    lines.append(Text(f"{used}/{len(snap.slots)} in use · {snap.slots[0].capacity} tokens per slot · ↻ just reused",
                      style="dim"))
    if snap.encoder is not None:
        lines.append(encoder_line(snap))
    return Group(*lines)


def encoder_line(snap: Snapshot) -> Text:
    """The encoder cache (a speech model's cross-attention K/V per audio, an image model's rows per
    picture): entries kept (of capacity), those running requests hold, hits and misses since the start,
    bytes held (kB below a megabyte)."""
    e = snap.encoder
    lookups = e.hits + e.misses
    rate = f"{e.hits / lookups:.0%}" if lookups else "-"
    size = f"{e.nbytes / 1e6:.1f} MB" if e.nbytes >= 1e6 else f"{e.nbytes / 1e3:.1f} kB"
    return Text(f"encoder cache {e.entries}/{e.capacity} entries · {e.referenced} held · hits {e.hits}/{lookups} "
                f"({rate}) · {size}", style="bold")


# -- block map (paged KV) ---------------------------------------------------------------------------
def _block_cell(b: BlockView, cell: int) -> Text:
    if b.refs == 0:
        return Text(("░" if b.cached else "·") * cell, style="dim")
    if b.refs == 1:
        return Text("█" * cell, style=color(b.color))
    mark = str(b.refs) if b.refs < 10 else "+"
    return Text(mark.ljust(cell), style=f"bold #000000 on {color(b.color)}")


def _paged_line(snap: Snapshot) -> Text:
    p = snap.paged
    used = sum(1 for b in snap.blocks if b.refs)
    shared = sum(1 for b in snap.blocks if b.refs > 1)
    cached = sum(1 for b in snap.blocks if b.cached)
    text = Text(f"{used}/{len(snap.blocks)} blocks in use · {shared} shared · {cached} cached free", style="bold")
    if p is not None:
        rate = f"{p.prefix_hits / p.prefix_queries:.0%}" if p.prefix_queries else "-"
        text.append(f"\nprefix hit rate {rate} ({p.prefix_hits}/{p.prefix_queries} tokens) · preemptions "
                    f"{p.preemptions}")
        if p.by_tenant:
            text.append(" · cross-tenant hits ")
            text.append(f"{p.cross_tenant_hits}", style=LEAK_STYLE if p.cross_tenant_hits else "")
        if p.offload is not None:
            hits, stores, held, capacity = p.offload
            text.append(f"\noffload tier: {hits} tokens restored · {stores} blocks stored · {held}/{capacity} held")
    return text


def block_map(snap: Snapshot, width: int, height: int) -> Group | Text:
    """Paged KV: one cell per block in block order, coloured by the request holding it (by its tenant
    when the run has tenants): `█` one holder, a digit the number of holders of a shared block (prefix
    caching), `░` a cached block no request holds (dimmed; evicted least recently used first), `·` a
    free one. Below: blocks in use / shared / cached, prefix hit rate, preemptions, cross-tenant hits, and a
    hybrid model's recurrent-state slots (state_strip)."""
    if not snap.blocks:
        return Text("no blocks yet", style="dim")
    strip = state_strip(snap, width) if snap.state_slots else None
    if strip is not None:
        height -= _height(strip, width)
    room = max(height - 3, 1) * max(width, 1)
    cell = 2 if len(snap.blocks) * 2 <= room and width >= 2 else 1
    per_row = max(width // cell, 1)
    lines = []
    for start in range(0, len(snap.blocks), per_row):
        line = Text()
        for b in snap.blocks[start:start + per_row]:
            line.append_text(_block_cell(b, cell))
        lines.append(line)
    keep = max(height - 3, 1)
    if len(lines) > keep:
        lines = lines[:keep - 1] + [Text(f"… {len(snap.blocks) - (keep - 1) * per_row} more blocks", style="dim")]
    size = f" · {snap.paged.block_size} tokens per block" if snap.paged and snap.paged.block_size else ""
    legend = Text(f"█ held · 2 shared by 2 · ░ cached free · · free{size}", style="dim")
    if snap.encoder is not None:
        return Group(*lines, _paged_line(snap), encoder_line(snap), legend)
    if strip is not None:
        return Group(*lines, _paged_line(snap), strip, legend)
    return Group(*lines, _paged_line(snap), legend)


# -- request table -------------------------------------------------------------------------------
def _status(r: RequestView) -> Text:
    if r.leaked:
        src = ",".join(r.leak_sources) or "?"
        return Text(f"LEAK←{src}", style=LEAK_STYLE)
    if "cross_tenant" in r.contamination:
        return Text("TENANT", style=LEAK_STYLE)
    if "cross_request" in r.contamination or "corruption" in r.contamination:
        return Text("TAINT" if "cross_request" in r.contamination else "CORRUPT", style=LEAK_STYLE)
    style = {"prefill": "bold yellow", "decode": "bold green", "waiting": "dim", "rejected": RED,
             "abort": RED}.get(r.status, "")
    return Text(r.status, style=style)


def window(text: str, phrase: str | None, width: int) -> str:
    """`width` cells of `text` showing `phrase` whole where it occurs (with up to PHRASE_CONTEXT
    characters before it), else its end; "…" marks text left out on either side."""
    if len(text) <= width:
        return text
    at = text.upper().find(phrase.upper()) if phrase else -1
    if at < 0:
        return "…" + text[-(width - 1):] if width > 1 else text[-width:]
    before = min(at, PHRASE_CONTEXT, max(width - len(phrase) - 2, 0))
    start = at - before
    lead = "…" if start > 0 and text[start] != "…" else ""
    piece = lead + text[start:start + width - len(lead)]
    if start + len(piece) - len(lead) < len(text) and piece[-1] != "…":
        piece = piece[:-1] + "…"
    return piece


def _answer(r: RequestView, width: int) -> Text:
    """The row's text in `width` cells: its tags first (dim: "lora:lora-a img:copper pen bias"), then the part
    around the passphrase it holds (another request's, highlighted as a leak, else its own in green),
    else the end of what it generated so far."""
    focus = clean(r.text_focus)
    held = [p for p in (*r.matched, r.passphrase) if p and p.upper() in focus.upper()]
    phrase = held[0] if held else None
    tags = f"[{r.sampling}] " if r.sampling and width > len(r.sampling) + 12 else ""
    shown = window(focus if phrase else clean(r.text_tail), phrase, max(width - len(tags), 1))
    text = Text(shown)
    # highlighted where the canary matched (ignoring case, as it matches): a leak, else the row's own
    for phrases, style in ((r.matched, LEAK_STYLE), ((r.passphrase,) if r.passphrase else (), "bold green")):
        for p in phrases:
            for m in re.finditer(re.escape(p), shown, re.IGNORECASE):
                text.stylize(style, m.start(), m.end())
    return Text(tags, style="dim cyan") + text if tags else text


# Columns besides id, status and text: (name, cells), left out in this order when the text would get
# fewer than TEXT_MIN cells (a passphrase, e.g. LANTERN-GINGER-90, and the words before it).
OPTIONAL_COLUMNS = ("slot", "TTFT", "bar", "p/g", "cache")
TEXT_MIN = 30
PHRASE_CONTEXT = 14  # characters shown before a passphrase: "passphrase is "


def _columns(snap: Snapshot, rows, width: int) -> tuple[set[str], int, int]:
    """Which optional columns fit, the cache bar's width and the text column's width (cells)."""
    bar_width = 6 if width >= 90 else 4
    widest = lambda header, values: max([len(header)] + [len(v) for v in values])  # noqa: E731
    cells = {"slot": widest("slot", [str(r.slot if r.slot is not None else f"{r.blocks}b") for r in rows]),
             "TTFT": widest("TTFT", [ms(r.ttft_s) for r in rows]), "bar": bar_width,
             "p/g": widest("p/g", [f"{r.prompt_tokens}/{r.generated_tokens}" for r in rows]), "cache": 5}
    fixed = widest("id", [r.id for r in rows]) + 1 + max([6] + [_status(r).cell_len for r in rows]) + 1
    shown = [c for c in OPTIONAL_COLUMNS if snap.server is None or c not in ("bar", "cache")]
    used = lambda cols: fixed + sum(cells[c] + (0 if c == "bar" else 1) for c in cols)  # noqa: E731
    while shown and width - used(shown) < TEXT_MIN:
        shown.pop(0)
    return set(shown), bar_width, max(width - used(shown), 8)


def request_table(snap: Snapshot, width: int, height: int) -> Table:
    """id, status (LEAK←source in red), slot, cache bar + length, prompt/generated tokens, TTFT, and the
    part of the answer that matters: around the passphrase it holds (another request's highlighted as a
    leak), else its end. As many rows as fit; where the panel is narrow, slot, TTFT, the cache bar,
    p/g and the cache length are left out, in that order, so the text keeps TEXT_MIN cells."""
    rows = snap.requests[:max(height - 1, 0)]
    shown, bar_width, text_width = _columns(snap, rows, width)
    table = Table(box=None, expand=True, padding=(0, 1, 0, 0), show_edge=False, header_style="bold")
    table.add_column("id", no_wrap=True)
    table.add_column("status", no_wrap=True, min_width=6)
    names = [c for c in ("slot", "cache", "p/g", "TTFT") if c in shown]
    for name in names:
        table.add_column(name, justify="left" if name == "cache" else "right", no_wrap=True)
    table.add_column("text", no_wrap=True, ratio=1, overflow="crop")
    for r in rows:
        fill = r.cache_len / r.capacity if r.capacity else 0.0
        cache = Text()
        if r.status != "waiting" and snap.server is None:
            if "bar" in shown:
                cache.append(bar(fill, bar_width), style=color(r.color))
            cache.append(f"{r.cache_len:>5}")
        cells = {"slot": str(r.slot) if r.slot is not None else f"{r.blocks}b" if r.blocks and r.active else "",
                 "cache": cache, "p/g": f"{r.prompt_tokens}/{r.generated_tokens}", "TTFT": ms(r.ttft_s)}
        table.add_row(Text(r.id, style=f"bold {color(r.color)}"), _status(r), *(cells[n] for n in names),
                      _answer(r, text_width))
    return table


# -- stats ---------------------------------------------------------------------------------------
def stats(snap: Snapshot, width: int, height: int) -> Text:
    """Prefill/decode tokens/s now and their history, padding ratio now and history, KV usage and
    slot occupancy, running/waiting counts, TTFT and TPOT p50/p95. A target server's run shows what
    the server exposes instead (kvtui/tui/server_panels.py)."""
    if snap.server is not None:
        return server_panels.stats(snap, width, height)
    spark_w = max(width - 30, 4)
    top = max(max(snap.prefill_history, default=0.0), max(snap.decode_history, default=0.0), 1.0)
    lines = [
        ("prefill", f"{snap.prefill_rate:8.0f} tok/s ", sparkline(snap.prefill_history, spark_w, top), "#f28e2b"),
        ("decode", f"{snap.decode_rate:8.0f} tok/s ", sparkline(snap.decode_history, spark_w, top), "#59a14f"),
        ("padding", f"{snap.padding_ratio:7.1%} q {snap.key_padding_ratio:4.0%} k ",
         sparkline(snap.padding_history, spark_w, max(max(snap.padding_history, default=0.0), 0.05)), "#b07aa1"),
        ("KV usage", f"{snap.kv_usage:7.1%}  {'seqs ' if snap.kv == 'paged' else 'slots'} {snap.occupancy:4.0%} ",
         sparkline(snap.kv_history, spark_w, max(max(snap.kv_history, default=0.0), 0.05)), "#4e79a7"),
    ]
    text = Text()
    for label, value, spark, style in lines:
        text.append(f"{label:<9}", style="bold").append(value).append(spark, style=style).append("\n")
    counts = (f"running {snap.running}  waiting {snap.waiting}  finished {snap.finished}  rejected {snap.rejected}"
              if width >= 62 else f"run {snap.running} wait {snap.waiting} done {snap.finished} rej {snap.rejected}")
    text.append("requests ", style="bold").append(counts + "\n")
    text.append("TTFT     ", style="bold").append(f"p50 {ms(snap.ttft.p50):>8}  p95 {ms(snap.ttft.p95):>8}\n")
    text.append("TPOT     ", style="bold").append(f"p50 {ms(snap.tpot.p50):>8}  p95 {ms(snap.tpot.p95):>8}")
    return text


# -- contamination -------------------------------------------------------------------------------
def flow_rows(snap: Snapshot) -> list:
    """The requests the attention-flow meter lists: those measured that are running or saw foreign keys."""
    return [r for r in snap.requests if r.attention_mass is not None and (r.active or r.attention_mass > 0)]


def contamination_inputs(snap: Snapshot) -> tuple:
    """Everything `contamination` draws from (the panel redraws when it changes)."""
    last = snap.contamination[-1] if snap.contamination else None
    return (snap.by_detector, snap.findings, snap.reference, len(snap.contamination), last,
            tuple((r.id, r.attention_mass) for r in flow_rows(snap)[:4]))


def _packed(items: list[str], width: int, first: int = 0) -> str:
    """`items` joined by " · ", broken onto new lines between items (never inside one, e.g. `canary 7`)
    to fit `width` cells; the first line has `first` cells taken already."""
    lines, used = [""], first
    for item in items:
        piece = item if not lines[-1] else f" · {item}"
        if lines[-1] and used + len(piece) > width:
            lines[-1] += " ·"
            lines.append(item)
            used = len(item)
        else:
            lines[-1] += piece
            used += len(piece)
    return "\n".join(lines)


def contamination(snap: Snapshot, width: int, height: int) -> Text:
    """Counts by detector and kind, the attention-flow meter (share of attention on other requests'
    keys) for up to 4 requests, and the latest detector reports (victim ← source, kind, evidence). In a
    short panel the newest report keeps its rows and the attention rows take what is left."""
    text = Text()
    if not snap.by_detector:
        text.append("no contamination detected\n", style="bold green")
    else:
        if snap.findings:
            text.append("findings ", style="bold").append(_packed([f"{k} {n}" for k, n in snap.findings], width, 9),
                                                          style=f"bold {RED}").append("\n")
        text.append("witnesses ", style="dim").append(_packed([f"{d} {n}" for d, n in snap.by_detector], width, 10))
        text.append("\n")
    if snap.reference is not None:
        checked, skipped, pending = snap.reference
        text.append(f"reference checked {checked}" + (f", skipped {skipped}" if skipped else "")
                    + (f", {pending} waiting" if pending else "") + "\n", style="dim")
    per_report = 1 if width >= 90 else 2
    # the newest report's rows are kept first: the attention rows (and their title) take what is left
    left = height - len(text.plain.splitlines()) - (per_report if snap.contamination else 0) - 1
    flows = flow_rows(snap)[:max(min(left, 4), 0)]
    if flows:
        text.append("attention on other requests' keys\n", style="dim")
        for r in flows:
            style = RED if r.attention_mass > 0 else "green"
            text.append(f"{r.id:>6} ").append(bar(r.attention_mass, 10), style=style)
            text.append(f" {r.attention_mass:.2f}\n")
    room = max(height - len(text.plain.splitlines()), 1)
    for c in list(snap.contamination)[-max(room // per_report, 1):]:
        step = "" if c.step is None or c.step < 0 else f"#{c.step} "  # -1: not made in a step (a target run)
        who = f"{c.victim or '?'} ← {c.source}" if c.source else f"{c.victim or '?'}"
        kind_style = f"bold {RED}" if c.kind in ("cross_request", "cross_tenant", "corruption") else "yellow"
        kind = c.kind if width >= 60 else SHORT_KINDS.get(c.kind, c.kind)
        line = Text(f"{step}{c.detector} ").append(kind, style=kind_style).append(f" {who} ", style="bold")
        evidence = Text(clean(c.evidence), style="dim")
        if line.cell_len + evidence.cell_len > width:  # narrow: evidence on its own line
            line.truncate(width)
            evidence = Text("  ").append_text(evidence)
            line.append("\n")
        line.append_text(evidence)
        for part in line.split("\n"):
            part.truncate(width)
            text.append_text(part).append("\n")
    text.rstrip()
    return text


# -- event log -----------------------------------------------------------------------------------
LOG_STYLES = {"fault": f"bold {RED}", "marker": "cyan", "timeline": "magenta", "reject": "yellow", "error": f"bold {RED}",
              "info": "green"}
LOG_SYMBOLS = {"fault": "⚑", "marker": "▸", "timeline": "⏱", "reject": "✗", "error": "!", "info": "·"}


def event_log(snap: Snapshot, width: int, height: int) -> Text:
    """The latest entries that fit whole: time, a symbol for the kind (⚑ fault, ▸ marker, ⏱ timeline,
    ✗ rejection, ! error), the text, wrapped at spaces onto indented continuation lines (a word longer
    than a line is cut; passphrases are not broken at their hyphens). An older entry that would not fit
    whole is left out rather than shown without its time; the newest alone, taller than the panel,
    shows its first `height` rows."""
    if not snap.log:
        return Text("no events yet (markers, timeline, faults, rejections)", style="dim")
    height = max(height, 1)
    rows: list[Text] = []
    indent = 9
    room = max(width - indent, 8)
    for line in reversed(list(snap.log)[-height:]):
        style = LOG_STYLES.get(line.kind, "")
        body = f"{LOG_SYMBOLS.get(line.kind, '·')} {clean(line.text)}"
        parts = textwrap.wrap(body, room, subsequent_indent="  ", break_on_hyphens=False) or [body[:room]]
        if rows and len(rows) + len(parts) > height:
            break
        rows[:0] = [Text().append(f"{line.t:7.1f}s " if n == 0 else " " * indent, style="dim" if n == 0 else "")
                    .append(part, style=style) for n, part in enumerate(parts)]
    return Text("\n").join(rows[:height])
