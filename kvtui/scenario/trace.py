"""Request traces: arrival times, prompt and output lengths (and, for Mooncake, shared prefixes).

Layouts (`arrivals.format`):
  - `csv` (kvtui's own): rows `timestamp,prompt_tokens,output_tokens` (seconds, tokens, tokens). A header
    line naming the three columns (any order) is optional; without one the columns are taken in that order.
    Blank lines and lines starting with `#` are skipped. At most MAX_TRACE_BYTES.
  - `mooncake`: JSON Lines, one object per request with `timestamp` (milliseconds), `input_length`,
    `output_length` (tokens) and optional `hash_ids`: the prompt's blocks, each id one block of
    `hash_block_size` tokens (512 in Mooncake's traces); two requests whose hash_ids start alike share that
    prefix of their prompts.
  - `burstgpt`: BurstGPT's CSV, header `Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type`
    (seconds, -, tokens, tokens, tokens, -); rows with 0 response tokens (BurstGPT's failed requests) are
    left out, as its `without_fails` files leave them out.
  - `azure`: the Azure LLM inference trace's CSV, header `TIMESTAMP,ContextTokens,GeneratedTokens`
    (`2023-11-16 18:15:46.6805900`, a UTC date and time; tokens, tokens).

Timestamps may be absolute or relative: arrivals are measured from the first row. They must not decrease.
The real traces are large: of mooncake, burstgpt and azure files the first MAX_PLANNED rows are read.
Every problem is a Problem naming the file, the line and the column.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from kvtui.scenario.base import MAX_PLANNED, MAX_SECONDS
from kvtui.scenario.errors import Problem
from kvtui.scenario.lengths import MAX_TOKENS

COLUMNS = ("timestamp", "prompt_tokens", "output_tokens")
MAX_TRACE_BYTES = 16 * 1024 * 1024
LAYOUTS = ("csv", "mooncake", "burstgpt", "azure")
MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in Mooncake's published traces
BURSTGPT_COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MAX_HASH_IDS = 100_000  # hash ids of one request


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace.

    Attributes:
        timestamp: seconds (absolute or relative; arrivals count from the first row's).
        prompt_tokens, output_tokens: its prompt length and max new tokens (tokens).
        hash_ids: Mooncake: its prompt's block hash ids, in order; None: the layout has none.
    """

    timestamp: float  # seconds
    prompt_tokens: int  # tokens
    output_tokens: int  # tokens
    hash_ids: tuple[int, ...] | None = None


def resolve(path: str, base_dir: Path | None) -> Path:
    """`path` as written in a scenario, relative to the scenario file's folder (or cwd)."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else (base_dir or Path.cwd()) / p


def read_trace(path: str, base_dir: Path | None, layout: str = "csv") -> list[TraceRow]:
    """Read and check a trace file of one of LAYOUTS.

    Raises:
        Problem: missing/unreadable file or a bad row, naming `path`, the row's line number and, for a bad
            value, its column.
    """
    if layout not in LAYOUTS:
        raise Problem(f"unknown trace format {layout!r}", f"use one of {', '.join(LAYOUTS)}")
    full = resolve(path, base_dir)
    try:
        if layout == "csv":
            if full.stat().st_size > MAX_TRACE_BYTES:
                raise Problem(f"trace file {path} is over {MAX_TRACE_BYTES >> 20} MiB", "use a shorter trace")
            rows = _read_csv(path, full.read_text(encoding="utf-8"))
        else:
            with full.open(encoding="utf-8", newline="") as f:
                reader = {"mooncake": _read_mooncake, "burstgpt": _read_burstgpt, "azure": _read_azure}[layout]
                rows = reader(path, f)
    except (OSError, ValueError, UnicodeError) as e:
        if isinstance(e, Problem):
            raise
        why = "not found" if isinstance(e, FileNotFoundError) else f"cannot be read ({type(e).__name__})"
        raise Problem(f"trace file {path} {why} (looked at {full})",
                      "give a path relative to the scenario file, e.g. traces/small.csv") from None
    if not rows:
        raise Problem(f"trace file {path} has no rows", _EXAMPLES[layout])
    return rows


_EXAMPLES = {
    "csv": f"add rows `{','.join(COLUMNS)}`, e.g. 0.0,128,32",
    "mooncake": 'add lines like {"timestamp": 0, "input_length": 655, "output_length": 52, "hash_ids": [46, 47]}',
    "burstgpt": f"add a header {','.join(BURSTGPT_COLUMNS)} and rows like 5,ChatGPT,472,18,490,Conversation log",
    "azure": f"add a header {','.join(AZURE_COLUMNS)} and rows like 2023-11-16 18:15:46.6805900,4808,10",
}


def _read_csv(path: str, text: str) -> list[TraceRow]:
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
    return _checked(where, ts, prompt, output, last_ts)


def _checked(where: str, ts: float, prompt: int, output: int, last_ts: float | None,
             hash_ids: tuple[int, ...] | None = None, names: Sequence[str] = COLUMNS) -> TraceRow:
    """A TraceRow, its values checked (timestamp seconds, token counts in range, order)."""
    if not math.isfinite(ts) or ts < 0 or ts > 1e11:
        raise Problem(f"{where}, column {names[0]}: timestamp {ts} out of range", "use seconds >= 0")
    for name, value in ((names[1], prompt), (names[2], output)):
        if not 1 <= value <= MAX_TOKENS:
            raise Problem(f"{where}, column {name}: {value} tokens is not in 1..{MAX_TOKENS}",
                          "fix the row's token counts")
    if last_ts is not None and ts < last_ts:
        raise Problem(f"{where}, column {names[0]}: timestamp {ts} is before the previous row's {last_ts}",
                      "sort the trace by timestamp")
    if last_ts is not None and ts - last_ts > MAX_SECONDS:
        raise Problem(f"{where}, column {names[0]}: gap of {ts - last_ts:.0f} s",
                      f"keep gaps under {MAX_SECONDS:.0f} s")
    return TraceRow(ts, prompt, output, hash_ids)


def _whole(where: str, column: str, value, *, ok_float: bool = False) -> int | float:
    """`value` of `column` as a number (a whole one unless ok_float).

    Raises:
        Problem: not a finite number (or not a whole one), naming the line and the column."""
    kind = "a number" if ok_float else "a whole number"
    number = math.nan
    if not isinstance(value, bool) and isinstance(value, (int, float, str)):
        try:
            number = float(value)
        except (ValueError, OverflowError):
            pass
    if not math.isfinite(number) or (not ok_float and not number.is_integer()):
        raise Problem(f"{where}, column {column}: {value!r} is not {kind}", f"write {column} as {kind}")
    return number if ok_float else int(number)


MOONCAKE_NAMES = ("timestamp", "input_length", "output_length")


def _read_mooncake(path: str, lines: Iterator[str]) -> list[TraceRow]:
    rows: list[TraceRow] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path} line {lineno}"
        try:
            item = json.loads(line.strip())
        except json.JSONDecodeError as e:
            raise Problem(f"{where}, column {e.colno}: not JSON ({e.msg})",
                          "write one JSON object per line (Mooncake's JSON Lines)") from None
        if not isinstance(item, dict):
            raise Problem(f"{where}: a {type(item).__name__}, not an object", _EXAMPLES["mooncake"])
        for column in MOONCAKE_NAMES:
            if column not in item:
                raise Problem(f"{where}, column {column}: missing", _EXAMPLES["mooncake"])
        ts = _whole(where, "timestamp", item["timestamp"], ok_float=True) / 1000.0
        prompt = _whole(where, "input_length", item["input_length"])
        output = _whole(where, "output_length", item["output_length"])
        hash_ids = None
        if item.get("hash_ids") is not None:
            raw = item["hash_ids"]
            if not isinstance(raw, list) or len(raw) > MAX_HASH_IDS:
                raise Problem(f"{where}, column hash_ids: not a list of at most {MAX_HASH_IDS} ids",
                              "write hash_ids as a list of whole numbers, e.g. [46, 47]")
            hash_ids = tuple(_whole(where, "hash_ids", h) for h in raw)
        rows.append(_checked(where, ts, prompt, output, rows[-1].timestamp if rows else None, hash_ids,
                             MOONCAKE_NAMES))
        if len(rows) >= MAX_PLANNED:
            break
    return rows


def _header(path: str, reader, wanted: Sequence[str], layout: str) -> dict[str, int]:
    """The header row's column positions of `wanted` (skipping blank lines).

    Raises:
        Problem: no header, or a wanted column missing from it."""
    for cells in reader:
        if not any(c.strip() for c in cells):
            continue
        names = [c.strip() for c in cells]
        missing = [w for w in wanted if w not in names]
        if missing:
            raise Problem(f"{path} line {reader.line_num}, column {missing[0]}: missing from the header {names}",
                          _EXAMPLES[layout])
        return {w: names.index(w) for w in wanted}
    return {}


def _cells(path: str, lines, layout: str, wanted: Sequence[str]) -> Iterator[tuple[str, dict[str, str]]]:
    """(where, {column: cell}) for each data row of a CSV with a header naming `wanted` among its columns."""
    reader = csv.reader(lines)
    columns = _header(path, reader, wanted, layout)
    if not columns:
        return
    for cells in reader:
        if not any(c.strip() for c in cells):
            continue
        where = f"{path} line {reader.line_num}"
        if len(cells) <= max(columns.values()):
            short_of = next(w for w in wanted if columns[w] >= len(cells))
            raise Problem(f"{where}, column {short_of}: missing ({len(cells)} cells)", _EXAMPLES[layout])
        yield where, {w: cells[i].strip() for w, i in columns.items()}


def _read_burstgpt(path: str, lines) -> list[TraceRow]:
    names = ("Timestamp", "Request tokens", "Response tokens")
    rows: list[TraceRow] = []
    for where, cells in _cells(path, lines, "burstgpt", names):
        ts = _whole(where, "Timestamp", cells["Timestamp"], ok_float=True)
        prompt = _whole(where, "Request tokens", cells["Request tokens"])
        output = _whole(where, "Response tokens", cells["Response tokens"])
        if output == 0:  # a failed request (BurstGPT's README): left out, as in its without_fails files
            continue
        rows.append(_checked(where, ts, prompt, output, rows[-1].timestamp if rows else None, None, names))
        if len(rows) >= MAX_PLANNED:
            break
    return rows


def azure_seconds(where: str, text: str) -> float:
    """An Azure trace TIMESTAMP ('2023-11-16 18:15:46.6805900', UTC, any number of fraction digits) as epoch
    seconds.

    Raises:
        Problem: not such a date and time."""
    whole, _, fraction = text.partition(".")
    try:
        moment = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc)
        if fraction and not fraction.isdigit():
            raise ValueError(fraction)
    except ValueError:
        raise Problem(f"{where}, column TIMESTAMP: {text!r} is not a date and time",
                      "write it as 2023-11-16 18:15:46.6805900") from None
    return moment.timestamp() + (int(fraction) / 10 ** len(fraction) if fraction else 0.0)


def _read_azure(path: str, lines) -> list[TraceRow]:
    rows: list[TraceRow] = []
    for where, cells in _cells(path, lines, "azure", AZURE_COLUMNS):
        ts = azure_seconds(where, cells["TIMESTAMP"])
        prompt = _whole(where, "ContextTokens", cells["ContextTokens"])
        output = _whole(where, "GeneratedTokens", cells["GeneratedTokens"])
        rows.append(_checked(where, ts, prompt, output, rows[-1].timestamp if rows else None, None, AZURE_COLUMNS))
        if len(rows) >= MAX_PLANNED:
            break
    return rows


@dataclass(frozen=True)
class PrefixHits:
    """A trace's theoretical prefix reuse (AIPerf's figure): prompt tokens in blocks whose hash id, with every
    hash id before it in the same prompt, appeared in an earlier request, over all prompt tokens.

    Attributes:
        hit_tokens: tokens of each request's leading hash-id blocks already seen (a block's tokens:
            block_size, the last block's its remainder of the prompt), summed.
        prompt_tokens: the requests' prompt lengths, summed.
    """

    hit_tokens: int
    prompt_tokens: int

    @property
    def rate(self) -> float:
        """hit_tokens / prompt_tokens (0 without prompt tokens)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def theoretical_hits(requests: Sequence[tuple[tuple[int, ...] | None, int]], block_size: int) -> PrefixHits:
    """The theoretical prefix-hit figures of `requests` ((hash ids or None, prompt tokens), in arrival order)
    with an unbounded cache of `block_size`-token blocks: a request's leading hash ids seen in any earlier
    request count, up to its first unseen one (a block's key chains its prefix, as Mooncake's hash ids do).
    A request without hash ids shares nothing.
    """
    seen: set[int] = set()
    hits = total = 0
    for hash_ids, prompt_tokens in requests:
        total += prompt_tokens
        if not hash_ids:
            continue
        lead = 0
        for h in hash_ids:
            if h not in seen:
                break
            lead += 1
        hits += min(lead * block_size, prompt_tokens)
        seen.update(hash_ids)
    return PrefixHits(hits, total)


@dataclass(frozen=True)
class TraceHitRow:
    """One row of a trace run's prefix-hit table (all requests, or one tenant's).

    Attributes:
        who: "all" or a tenant's name.
        theoretical: PrefixHits of the planned prompts' hash ids (an unbounded cache; a tenant's row: that
            tenant's requests alone, as a cache salted per tenant sees them).
        cached_tokens: prompt tokens the server said it took from its cache (`usage.prompt_tokens_details.
            cached_tokens`), summed over the answered requests; None: no answer said.
        prompt_tokens: prompt tokens the server counted for those requests (its usage), summed.
    """

    who: str
    theoretical: PrefixHits
    cached_tokens: int | None
    prompt_tokens: int

    def as_dict(self) -> dict[str, int | None]:
        """The summary's form: theoretical hit / prompt tokens, cached / server prompt tokens."""
        return {"trace_hit_tokens": self.theoretical.hit_tokens, "trace_prompt_tokens": self.theoretical.prompt_tokens,
                "cached_tokens": self.cached_tokens, "prompt_tokens": self.prompt_tokens}


def hit_table(requests: Sequence[tuple[str | None, tuple[int, ...] | None, int, int | None, int | None]],
              block_size: int) -> list[TraceHitRow]:
    """The prefix-hit rows of a trace run: "all", then one per tenant when there are several.

    Args:
        requests: per request in arrival order, (tenant, hash ids, planned prompt tokens, the prompt tokens the
            server's usage counted or None, the cached tokens it reported or None).
        block_size: tokens per hash id.
    """
    tenants = sorted({r[0] for r in requests if r[0] is not None})
    groups = [("all", list(requests))]
    if len(tenants) > 1:
        groups += [(t, [r for r in requests if r[0] == t]) for t in tenants]
    rows = []
    for who, members in groups:
        said = [r[4] for r in members if r[4] is not None]
        rows.append(TraceHitRow(who, theoretical_hits([(r[1], r[2]) for r in members], block_size),
                                sum(said) if said else None, sum(r[3] or 0 for r in members)))
    return rows
