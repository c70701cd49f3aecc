"""Recordings: JSON Lines of typed events (kvtui/events.py), written and flushed line by line.

Line 1 is a header (format, version, kvtui/torch/transformers versions, scenario and its hash,
seed, model id and file hash, engine config, clock, which figures are measured and which modeled).
Then events, each with "type" and "t" (seconds on the run's clock): request.arrive, step,
request.first_token, request.finish, contamination, fault, timeline, marker. The last line is a
summary. A killed run's file reads back up to its last whole line. Version 2 is written; version 1
files read with the same types. recordings/README.md documents every field.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Iterator

import pydantic

from kvtui.events import FORMAT, READABLE_VERSIONS, VERSION, Header, Summary, parse_event

__all__ = ["FORMAT", "VERSION", "RecordingError", "RecordingWriter", "read_recording"]


class RecordingError(Exception):
    """A recording that cannot be read (missing, not a kvtui recording, unknown version, a bad line)."""


class RecordingWriter:
    """Appends events to a JSONL file, flushing (and fsyncing every `sync_every` lines) so a crash
    or kill loses at most the line being written.

    Raises:
        OSError: the file cannot be created (the caller turns it into a one-line error).
    """

    def __init__(self, path: str | Path, *, sync_every: int = 50) -> None:
        self.path = Path(path)
        if self.path.parent and not self.path.parent.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = open(self.path, "w", encoding="utf-8")
        self._lines = 0
        self.sync_every = sync_every

    def write(self, event) -> None:
        """Append one typed event (kvtui.events) as a line."""
        if self._file is None:
            return
        self._file.write(event.to_json() + "\n")
        self._file.flush()
        self._lines += 1
        if self._lines % self.sync_every == 0:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None


def read_recording(path: str | Path) -> tuple[Header, list, Summary | None, bool]:
    """Read a recording (version 1 or 2): (header, typed events, summary or None, truncated).

    A last line cut mid-write (killed run) is dropped and `truncated` is True.

    Raises:
        RecordingError: the file is missing, empty, not a kvtui recording, a newer version, or a
            whole line that does not match its event type (named by line number).
    """
    path = Path(path)
    if not path.is_file():
        raise RecordingError(f"{path}: no such recording; record one with: kvtui run SCENARIO --headless --record {path}")
    header, events, summary, truncated = None, [], None, False
    for number, line in _lines(path):
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            truncated = True
            break
        if number == 1:
            header = _header(path, data)
            continue
        try:
            event = parse_event(data)
        except pydantic.ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise RecordingError(f"{path}:{number}: not a valid {data.get('type', '?')!r} event "
                                 f"({where}: {first['msg']})") from None
        if isinstance(event, Summary):
            summary = event
        else:
            events.append(event)
    if header is None:
        raise RecordingError(f"{path}: empty recording")
    return header, events, summary, truncated or summary is None


def _header(path: Path, data) -> Header:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise RecordingError(f"{path}:1: not a kvtui recording (no \"format\": \"{FORMAT}\" header)")
    if data.get("version", 0) not in READABLE_VERSIONS:
        raise RecordingError(f"{path}:1: recording version {data.get('version')} is not one this kvtui reads "
                             f"({', '.join(map(str, READABLE_VERSIONS))}); upgrade kvtui")
    try:
        return Header.model_validate(data)
    except pydantic.ValidationError as e:
        raise RecordingError(f"{path}:1: bad header ({e.errors()[0]['msg']})") from None


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield number, line
