"""Request traces: CSV rows `timestamp,prompt_tokens,output_tokens` (seconds, tokens, tokens).

A header line naming the three columns (any order) is optional; without one the columns are taken in
that order. Blank lines and lines starting with `#` are skipped. Timestamps may be absolute (epoch
seconds) or relative: arrivals are measured from the first row. They must not decrease.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path

from kvtui.scenario.base import MAX_PLANNED, MAX_SECONDS
from kvtui.scenario.errors import Problem
from kvtui.scenario.lengths import MAX_TOKENS

COLUMNS = ("timestamp", "prompt_tokens", "output_tokens")
MAX_TRACE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class TraceRow:
    timestamp: float  # seconds
    prompt_tokens: int  # tokens
    output_tokens: int  # tokens


def resolve(path: str, base_dir: Path | None) -> Path:
    """`path` as written in a scenario, relative to the scenario file's folder (or cwd)."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else (base_dir or Path.cwd()) / p


def read_trace(path: str, base_dir: Path | None) -> list[TraceRow]:
    """Read and check a trace file.

    Raises:
        Problem: missing/unreadable file or a bad row, naming `path` and the row's line number.
    """
    full = resolve(path, base_dir)
    try:
        if full.stat().st_size > MAX_TRACE_BYTES:
            raise Problem(f"trace file {path} is over {MAX_TRACE_BYTES >> 20} MiB", "use a shorter trace")
        text = full.read_text(encoding="utf-8")
    except (OSError, ValueError, UnicodeError) as e:
        if isinstance(e, Problem):
            raise
        why = "not found" if isinstance(e, FileNotFoundError) else f"cannot be read ({type(e).__name__})"
        raise Problem(f"trace file {path} {why} (looked at {full})",
                      "give a path relative to the scenario file, e.g. traces/small.csv") from None
    rows: list[TraceRow] = []
    order = COLUMNS
    for lineno, cells in enumerate(csv.reader(io.StringIO(text)), start=1):
        cells = [c.strip() for c in cells]
        if not cells or not any(cells) or cells[0].startswith("#"):
            continue
        if not rows and order is COLUMNS and not _is_number(cells[0]):
            if sorted(c.lower() for c in cells) != sorted(COLUMNS):
                raise Problem(f"{path} line {lineno}: header {cells} is not {','.join(COLUMNS)}",
                              f"write the header as {','.join(COLUMNS)} or leave it out")
            order = tuple(c.lower() for c in cells)
            continue
        rows.append(_row(path, lineno, cells, order, rows[-1].timestamp if rows else None))
        if len(rows) > MAX_PLANNED:
            raise Problem(f"{path} has over {MAX_PLANNED} rows", "use a shorter trace")
    if not rows:
        raise Problem(f"trace file {path} has no rows", f"add rows `{','.join(COLUMNS)}`, e.g. 0.0,128,32")
    return rows


def _is_number(cell: str) -> bool:
    try:
        float(cell)
        return True
    except ValueError:
        return False


def _row(path: str, lineno: int, cells: list[str], order: tuple, last_ts: float | None) -> TraceRow:
    where = f"{path} line {lineno}"
    if len(cells) != 3:
        raise Problem(f"{where}: {len(cells)} columns", f"write 3: {','.join(order)}")
    values = dict(zip(order, cells))
    try:
        ts = float(values["timestamp"])
        prompt, output = int(values["prompt_tokens"]), int(values["output_tokens"])
    except ValueError:
        raise Problem(f"{where}: not numbers: {','.join(cells)}",
                      "timestamp is seconds (a number), token counts are whole numbers") from None
    if not math.isfinite(ts) or ts < 0 or ts > 1e11:
        raise Problem(f"{where}: timestamp {ts} out of range", "use seconds >= 0")
    if not (1 <= prompt <= MAX_TOKENS and 1 <= output <= MAX_TOKENS):
        raise Problem(f"{where}: token counts must be in 1..{MAX_TOKENS}", "fix the row's token counts")
    if last_ts is not None and ts < last_ts:
        raise Problem(f"{where}: timestamp {ts} is before the previous row's {last_ts}",
                      "sort the trace by timestamp")
    if last_ts is not None and ts - last_ts > MAX_SECONDS:
        raise Problem(f"{where}: gap of {ts - last_ts:.0f} s", f"keep gaps under {MAX_SECONDS:.0f} s")
    return TraceRow(ts, prompt, output)
