"""Recordings: JSON Lines of typed events (kvtui/events.py), written and flushed line by line.

Line 1 is a header (format, version, kvtui/torch/transformers versions, scenario and its hash,
seed, model id and file hash, engine config, clock, which figures are measured and which modeled).
Then events, each with "type" and "t" (seconds on the run's clock): request.arrive, step,
request.first_token, request.finish, contamination, fault, timeline, marker. The last line is a
summary. A killed run's file reads back up to its last whole line. Version 3 is written; version 1
and 2 files read with the same types (their step lines mapped onto today's names, see
kvtui.events.parse_event). recordings/README.md documents every field.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Iterator

import pydantic

from kvtui.events import FORMAT, READABLE_VERSIONS, VERSION, Header, RecordingFailed, Summary, parse_event

__all__ = ["FORMAT", "VERSION", "RecordingError", "RecordingWriter", "check_unlocked", "describe_os_error",
           "read_recording"]


class RecordingError(Exception):
    """A recording that cannot be read (missing, not a kvtui recording, unknown version, a bad line)."""


class RecordingWriter:
    """Appends events to a JSONL file, flushing (and fsyncing every `sync_every` lines) so a crash
    or kill loses at most the line being written.

    The file is created with mode 0600 (a recording holds every prompt and answer) and, when it is a
    regular file, held under an exclusive advisory lock (flock) while it is written: a second writer
    given the same path is refused at start instead of interleaving its lines with the first's.

    A write that fails later (disk full, file too large, I/O error) never raises: the writer stops
    there, keeps the cause in `error` and the count of whole lines in `lines`, and calls `on_error`
    once, so a run or a server goes on without its recording.

    Raises:
        OSError: the file cannot be created or opened for writing (the caller turns it into a one-line
            error); errno EAGAIN, its strerror saying so, when another writer holds the file's lock.
    """

    def __init__(self, path: str | Path, *, sync_every: int = 50,
                 on_error: Callable[[RecordingWriter], None] | None = None, background_sync: bool = False) -> None:
        self.path = Path(path)
        if self.path.parent and not self.path.parent.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None
        self._file, self._syncable = _open_locked(self.path)
        self.lines = 0
        self.sync_every = sync_every
        self.error: OSError | None = None
        self.on_error = on_error
        # fsync in a thread of its own (a target run's load: a disk that takes milliseconds to sync must not
        # hold up the sending loop); its failure is reported at the next write, from the writing thread
        self._syncer = _Syncer() if background_sync and self._syncable else None

    @property
    def failed(self) -> bool:
        """A write failed: nothing more is written (see `error`)."""
        return self.error is not None

    def write(self, event) -> None:
        """Append one typed event (kvtui.events) as a line; after a failed write, nothing."""
        if self._file is None:
            return
        try:
            if self._syncer is not None and self._syncer.error is not None:
                raise self._syncer.error
            self._file.write(event.to_json() + "\n")
            self._file.flush()
            if self._syncable and (self.lines + 1) % self.sync_every == 0:
                if self._syncer is not None:
                    self._syncer.request(self._file.fileno())
                else:
                    os.fsync(self._file.fileno())
        except OSError as e:
            self._fail(e)
            return
        self.lines += 1

    def close(self) -> None:
        """Flush, fsync and close (releasing the lock); a failure here is kept in `error` too."""
        if self._file is None:
            return
        try:
            if self._syncer is not None:
                self._syncer.stop()
                if self._syncer.error is not None:
                    raise self._syncer.error
            self._file.flush()
            if self._syncable:
                os.fsync(self._file.fileno())
        except OSError as e:
            self._fail(e)
            return
        self._release()

    def failed_event(self, t: float) -> RecordingFailed:
        """The RecordingFailed event a session gives its listeners after a failed write, at time `t`
        (seconds on the run's clock)."""
        return RecordingFailed(t=t, path=str(self.path), lines=self.lines, error=describe_os_error(self.error))

    def describe_error(self) -> str:
        """One line: the file, where it stopped and the cause, e.g. 'runs/a.jsonl: recording stopped
        after 120 lines: No space left on device (ENOSPC)'; "" when nothing failed."""
        if self.error is None:
            return ""
        return f"{self.path}: recording stopped after {self.lines} lines: {describe_os_error(self.error)}"

    def _fail(self, e: OSError) -> None:
        self.error = e
        self._release()
        if self.on_error is not None:
            self.on_error(self)

    def _release(self) -> None:
        if self._syncer is not None:
            self._syncer.stop()
        file, self._file = self._file, None
        try:
            file.close()  # closing the descriptor releases the flock
        except OSError:  # the buffered tail cannot be written either: the descriptor is closed regardless
            pass


class _Syncer:
    """One daemon thread that fsyncs a descriptor when asked (a request while one runs is folded into
    the next); the first failure is kept in `error`."""

    def __init__(self) -> None:
        self.error: OSError | None = None
        self._fd: int | None = None
        self._wake = threading.Condition()
        self._stopped = False
        self._busy = False
        self._thread: threading.Thread | None = None

    def request(self, fd: int) -> None:
        with self._wake:
            self._fd = fd
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvtui-fsync", daemon=True)
                self._thread.start()
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while self._fd is None and not self._stopped:
                    self._wake.wait()
                if self._fd is None:
                    return
                fd, self._fd, self._busy = self._fd, None, True
            try:
                os.fsync(fd)
            except OSError as e:
                self.error = self.error or e
            finally:
                with self._wake:
                    self._busy = False
                    self._wake.notify_all()

    def stop(self) -> None:
        """Wait for a sync in progress (and one asked for), then end the thread."""
        with self._wake:
            self._stopped = True
            self._wake.notify_all()
            while self._busy or (self._fd is not None and self._thread is not None and self._thread.is_alive()):
                self._wake.wait(0.1)
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def describe_os_error(e: OSError) -> str:
    """'No space left on device (ENOSPC)': the system's text and the errno name."""
    name = errno.errorcode.get(e.errno or 0)
    text = e.strerror or str(e) or type(e).__name__
    return f"{text} ({name})" if name else text


def _open_locked(path: Path) -> tuple[IO[str], bool]:
    """Open `path` for writing, created 0600; a regular file is locked (flock, exclusive, not waiting)
    before it is emptied, so a refused second writer leaves the first one's lines alone. Returns the
    file and whether it is a regular file (only those are locked, emptied and fsynced; a pipe or a
    device such as /dev/stdout is written as it is)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
        if regular:
            _lock(fd)
            os.ftruncate(fd, 0)
            with contextlib.suppress(OSError):  # a file another user owns keeps its mode
                os.fchmod(fd, 0o600)
        return open(fd, "w", encoding="utf-8", closefd=True), regular
    except BaseException:
        os.close(fd)
        raise


def check_unlocked(path: str | Path) -> None:
    """Raise the writer's OSError (errno EAGAIN) now when another writer holds `path`'s lock; nothing
    when the file is absent, not a regular file, or free. Changes nothing in the file."""
    try:
        fd = os.open(path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return  # absent or not writable: creating it reports that
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            _lock(fd)
    finally:
        os.close(fd)


def _lock(fd: int) -> None:
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no advisory lock
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise OSError(errno.EAGAIN, "another process is writing this recording (it holds the file's lock); "
                                    "wait for it to finish") from None
    except OSError as e:  # a file system without flock (some network mounts): write unlocked
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
            raise


def read_recording(path: str | Path) -> tuple[Header, list, Summary | None, bool]:
    """Read a recording (version 1, 2 or 3): (header, typed events, summary or None, truncated).

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
            if header is None:  # not even a header: not a recording (a scenario file, most likely)
                raise RecordingError(_not_json(path, number)) from None
            truncated = True
            break
        if number == 1:
            header = _header(path, data)
            continue
        try:
            event = parse_event(data, *((header.version, header.engine) if header else ()))
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


def _not_json(path: Path, number: int) -> str:
    """Why a file whose first line is not JSON is no recording: a scenario file says how to run it."""
    import yaml

    try:
        scenario = yaml.safe_load(path.read_text(encoding="utf-8", errors="replace"))
    except yaml.YAMLError:
        scenario = None
    if path.suffix in (".yaml", ".yml") or isinstance(scenario, dict) and {"name", "arrivals", "prompts"} & set(scenario):
        return (f"{path} is a scenario file, not a recording: run it with `kvtui run {path}` (add --headless "
                f"--record runs/NAME.jsonl to record a run that kvtui replay plays)")
    return f"{path}:{number}: not a kvtui recording (not JSON; a recording is JSON Lines, a header first)"


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


def restart_path(record: str | Path | None, generation: int) -> Path | None:
    """Recording path of restart `generation` (a dashboard's `r`, a served engine's restart): the given
    path first, then NAME.restartN.jsonl beside it; None without a recording."""
    if record is None:
        return None
    record = Path(record)
    return record if generation == 0 else record.with_name(f"{record.stem}.restart{generation}{record.suffix}")
