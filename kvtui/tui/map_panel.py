"""The block map panel (key `m`): whose KV is where. A pure function of the snapshot's KVMapView.

The grid has one cell per KV block (paged) or slot (slots) in id order, coloured by the owner's tenant
(by the owner when the run has one tenant); a hybrid's state slots follow as a band of their own, then
the encoder cache's entries and the KV offload tier's blocks as bands of counts (they name no owner).
Below, one line per owner: its cells, tenant, adapter, age (steps it has held them), last reuse (steps
since a prefix hit handed one over), and the fault that acted there and the detector that fired there.

Colour is never the only carrier of meaning: `!` marks a cell a fault acted on, `*` one a detector fired
on, a digit a block shared by that many, `░` a cached free block, `·` a free one; the owner is written in
the list below the grid.
"""

from __future__ import annotations

from rich.console import Group
from rich.text import Text

from kvtui.tui.draw import LEAK_STYLE, RED, color
from kvtui.tui.snapshot import MapCell, Snapshot

WIDE = 80  # from this width the list shows every column (tenant, adapter, reuse, previous owner)


def glyph(c: MapCell, width: int = 1) -> Text:
    """One cell `width` columns wide: `!` a fault acted, `*` a detector fired, a digit its holders when
    shared, else blank, on the owner's (tenant's) colour; free: `░` cached, `·` not (a marked free cell keeps
    its mark, in red)."""
    mark = "!" if c.fault else "*" if c.detector else ""
    if c.owner is None:
        return Text((mark or ("░" if c.cached else "·")).ljust(width), style=f"bold {RED}" if mark else "dim")
    shared = str(c.shared) if 1 < c.shared < 10 else "+" if c.shared >= 10 else ""
    return Text((mark or shared or " ").ljust(width), style=f"bold #000000 on {color(c.color)}")


def _grid(cells, width: int, rows: int) -> list[Text]:
    """The cells in lines of `width`: three columns a cell (two drawn, a gap) where that fits in `rows`
    lines, else one."""
    if not cells:
        return []
    wide = len(cells) * 3 <= max(width, 1) * rows
    per_line = max(width // (3 if wide else 1), 1)
    lines = []
    for start in range(0, len(cells), per_line):
        line = Text()
        for c in cells[start:start + per_line]:
            line.append_text(glyph(c, 2 if wide else 1))
            if wide:
                line.append(" ")
        lines.append(line)
    if len(lines) > rows:
        lines = lines[:max(rows - 1, 0)] + [Text(f"… {len(cells) - (rows - 1) * per_line} more", style="dim")]
    return lines


def _ranges(indices: list[int]) -> str:
    """3,4,5,9 -> "3-5,9"."""
    parts, start = [], None
    for i, x in enumerate(indices):
        if start is None:
            start = x
        if i + 1 == len(indices) or indices[i + 1] != x + 1:
            parts.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ",".join(parts)


def owner_lines(view, width: int) -> list[Text]:
    """One line per owner, marked owners first, then the newest: its cells, tenant and adapter (wide),
    age, last reuse (wide), and the fault and detector marks."""
    groups: dict[str, list[MapCell]] = {}
    bands: dict[str, tuple[list[int], list[int]]] = {}  # owner -> (its KV cells, its state slots)
    for band, cells in enumerate((view.cells, view.state)):
        for c in cells:
            if c.owner is not None:
                groups.setdefault(c.owner, []).append(c)
                bands.setdefault(c.owner, ([], []))[band].append(c.index)
    wide = width >= WIDE
    tenants = any(c.tenant for c in view.cells + view.state)  # columns only where the run has them
    adapters = any(c.adapter for c in view.cells + view.state)
    order = sorted(groups, key=lambda o: (not any(c.fault or c.detector for c in groups[o]),
                                          min(c.age if c.age is not None else 1 << 30 for c in groups[o]), o))
    lines = []
    for owner in order:
        cells = groups[owner]
        kv, state = map(sorted, bands[owner])
        first = cells[0]
        line = Text().append(f" {owner} ", style=f"bold #000000 on {color(first.color)}")
        where = f" {view.unit}s {_ranges(kv)}" if kv else ""
        where += f" state {_ranges(state)}" if state else ""
        line.append(f"{where:<18}" if wide else where)
        if wide and (tenants or adapters):
            line.append(f" {first.tenant or '-':<9}" * tenants + f" {first.adapter or '-':<9}" * adapters, style="dim")
        elif first.tenant or first.adapter:
            line.append(" " + " ".join(x for x in (first.tenant, first.adapter) if x), style="dim")
        ages = [c.age for c in cells if c.age is not None]
        line.append(f" age {max(ages) if ages else '-'}")
        reuses = [c.reused for c in cells if c.reused is not None]
        if wide and reuses:
            line.append(f" reused {min(reuses)} ago")
        previous = sorted({c.previous for c in cells if c.previous and c.previous != owner})
        if wide and previous:
            line.append(f" was {','.join(previous)}", style="dim")
        faults = sorted({c.fault for c in cells if c.fault})
        detectors = sorted({c.detector for c in cells if c.detector})
        if faults:
            line.append(" ").append(f"!{','.join(faults)}", style=LEAK_STYLE)
        if detectors:
            line.append(" ").append(f"*{','.join(detectors)}", style=f"bold {RED}")
        line.truncate(width)
        lines.append(line)
    return lines


def _bands(view, width: int) -> list[Text]:
    """The state slots' grid line, and the encoder cache and the offload tier as counts with a strip."""
    lines = []
    if view.state:
        line = Text("state ", style="bold")
        for c in view.state:
            line.append_text(glyph(c))
        lines.append(line)
    if view.encoder is not None:
        entries, capacity, held = view.encoder
        strip = "█" * held + "▒" * max(entries - held, 0) + "·" * max(capacity - entries, 0)
        lines.append(Text("encoder ", style="bold").append(strip[:max(width - 30, 4)])
                     .append(f" {entries}/{capacity} entries, {held} held", style="dim"))
    if view.tier is not None:
        held, capacity = view.tier
        strip = "▒" * held + "·" * max(capacity - held, 0)
        lines.append(Text("tier ", style="bold").append(strip[:max(width - 24, 4)])
                     .append(f" {held}/{capacity} blocks", style="dim"))
    return lines


def kv_map(snap: Snapshot, width: int, height: int) -> Group | Text:
    """The block map panel (see the module docstring) in `width` x `height` cells: the grid in at most half
    the height, the bands, a legend, then as many owner lines as fit."""
    view = snap.kv_map
    if view is None:
        return Text("the block map shows kvtui's own engine (a target server's blocks are not visible)"
                    if snap.server is not None else "no blocks yet", style="dim")
    bands = _bands(view, width)
    grid = _grid(view.cells, width, max(height // 2 - len(bands), 1))
    held = sum(1 for c in view.cells if c.owner)
    legend = Text(f"{held}/{len(view.cells)} {view.unit}s held: ! fault acted, * detector fired"
                  + (", 2 shared by 2, ░ cached" if view.unit == "block" else "") + ", · free", style="dim")
    legend.truncate(width)
    top = grid + bands + [legend]
    owners = owner_lines(view, width)
    room = max(height - len(top), 0)
    if len(owners) > room:
        owners = owners[:max(room - 1, 0)] + [Text(f"… {len(owners) - max(room - 1, 0)} more owners", style="dim")]
    return Group(*top, *owners[:room])
