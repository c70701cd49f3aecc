"""The command line's consoles, one-line messages and exit codes, shared by every command.

Exit codes: 0 as expected, 1 contamination (or an expected one not found where a fault acted), 2 bad input,
3 runtime error, 4 an expected detection not found where no fault that was on ever acted (the run tested
nothing); a run stopped by a signal exits 128 + its number (130 SIGINT, 143 SIGTERM).
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.markup import escape

out = Console(width=None if sys.stdout.isatty() else 120)
err = Console(stderr=True)

EXIT_OK, EXIT_CONTAMINATION, EXIT_BAD_INPUT, EXIT_RUNTIME, EXIT_INERT = 0, 1, 2, 3, 4


def say(label: str, text: str) -> None:
    """One line on stderr: `error: text`, `warning: text` or `note: text`. User text is shown as
    written: control characters escaped (\\n, \\x1b), rich markup characters taken literally."""
    from kvtui.scenario.errors import printable

    style = {"error": "bold red", "warning": "yellow", "note": "yellow"}.get(label, "bold")
    err.print(f"[{style}]{label}:[/] {escape(printable(text))}", highlight=False, soft_wrap=True)


def fail(message: str, code: int = EXIT_BAD_INPUT) -> None:
    """Print one line to stderr and exit with `code` (2 bad input, 3 runtime error)."""
    say("error", message)
    raise typer.Exit(code)


def fail_unwritable(record, e: OSError) -> None:
    """The one line (exit 2) for a --record path the recording cannot be written to."""
    fail(f"{record}: cannot write the recording ({e.strerror or e}); choose another --record path")
