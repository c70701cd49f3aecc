"""Recording format v1: JSON Lines, one event per line, written and flushed line by line.

Line 1 is a header (format, version, kvtui/torch/transformers versions, scenario and its hash,
seed, model id and file hash, engine config, clock, which figures are measured and which modeled).
Then events, each with "type" and "t" (seconds on the run's clock): request.arrive, step,
request.first_token, request.finish, timeline, marker. The last line is a summary. A killed run's
file reads back up to its last whole line. recordings/README.md documents every field.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import IO, Iterator

from kvtui.engine.report import StepReport

FORMAT = "kvtui-recording"
VERSION = 1


class RecordingError(Exception):
    """A recording that cannot be read (missing, not a kvtui recording, unknown version)."""


def step_event(report: StepReport) -> dict:
    """The `step` event for a StepReport (finished requests get their own request.finish events)."""
    data = asdict(report)
    data.pop("finished")
    data["running"] = [
        {"id": r["request_id"], "slot": r["slot"], "cache_len": r["cache_len"], "q": r["query_tokens"],
         "token": r["new_token_id"], "phase": r["phase"]}
        for r in data["running"]
    ]
    data["t"] = data.pop("end_s")
    data["type"] = "step"
    return data


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

    def write(self, event: dict) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(event, ensure_ascii=False, separators=(",", ":")) + "\n")
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


def read_recording(path: str | Path) -> tuple[dict, list[dict], dict | None, bool]:
    """Read a recording: (header, events, summary or None, truncated).

    A last line cut mid-write (killed run) is dropped and `truncated` is True.

    Raises:
        RecordingError: the file is missing, empty, not a kvtui recording, or a newer version.
    """
    path = Path(path)
    if not path.is_file():
        raise RecordingError(f"{path}: no such recording; record one with: kvtui run SCENARIO --headless --record {path}")
    header, events, summary, truncated = None, [], None, False
    for number, line in _lines(path):
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            truncated = True
            break
        if number == 1:
            if event.get("format") != FORMAT:
                raise RecordingError(f"{path}:1: not a kvtui recording (no \"format\": \"{FORMAT}\" header)")
            if event.get("version", 0) > VERSION:
                raise RecordingError(f"{path}:1: recording version {event.get('version')} is newer than this "
                                     f"kvtui reads ({VERSION}); upgrade kvtui")
            header = event
        elif event.get("type") == "summary":
            summary = event
        else:
            events.append(event)
    if header is None:
        raise RecordingError(f"{path}: empty recording")
    return header, events, summary, truncated or summary is None


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield number, line
