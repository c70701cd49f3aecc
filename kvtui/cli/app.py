"""kvtui command line: run, serve, replay, validate, bench, model, sweep.

Each command lives in its own module of this package (run, replay, validate, faults, audit, serve,
model, bench), the `--target` paths of run and audit in target; console helpers and exit codes in
console, options several commands share in options, input loading in inputs, the end of a headless
run in finish. This module makes the Typer app and the console entry point.
"""

from __future__ import annotations

import os
import re

import typer

from kvtui.cli.audit import audit
from kvtui.cli.bench import bench, calibrate_cmd
from kvtui.cli.conformance import conformance
from kvtui.cli.console import EXIT_BAD_INPUT, EXIT_OK, say
from kvtui.cli.faults import faults
from kvtui.cli.model import model_cmd
from kvtui.cli.replay import replay
from kvtui.cli.run import run
from kvtui.cli.serve import serve
from kvtui.cli.sweep import sweep
from kvtui.cli.validate import validate
from kvtui.names import did_you_mean

app = typer.Typer(
    name="kvtui",
    help="Terminal load simulator for LLM batching, with a real PyTorch + transformers engine inside.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)


def _short_help(command) -> str:
    """The first paragraph of a command's docstring as one line: typer's list keeps the docstring's first line
    break, which cut every multi-line summary in `kvtui --help` mid-sentence."""
    paragraph = (command.__doc__ or "").strip().split("\n\n")[0]
    return " ".join(line.strip() for line in paragraph.splitlines())


for _name, _command in (("run", run), ("replay", replay), ("validate", validate), ("faults", faults),
                        ("audit", audit), ("serve", serve), ("model", model_cmd), ("bench", bench),
                        ("calibrate", calibrate_cmd), ("conformance", conformance), ("sweep", sweep)):
    app.command(_name, short_help=_short_help(_command))(_command)  # in the order `kvtui --help` lists them


_NOT_ONE_OF = re.compile(r"'(?P<value>[^']*)' is not one of (?P<choices>'[^']*'(?:, '[^']*')*)")


def with_suggestion(message: str) -> str:
    """A choice option's error ("'stale_slots' is not one of 'shared_cache', ...", as typer words it) with
    the closest choice named after the value: "'stale_slots' (did you mean 'stale_slot'?) is not one of ..."."""
    found = _NOT_ONE_OF.search(message)
    if found is None:
        return message
    hint = did_you_mean(found["value"], re.findall(r"'([^']*)'", found["choices"]))
    return message[:found.end("value") + 1] + hint + message[found.end("value") + 1:]


def main() -> int:
    """Console entry point. A rejected option or argument is one line on stderr and exit 2."""
    try:  # typer vendors click since 0.24
        from typer._click import exceptions as click_errors
    except ImportError:  # pragma: no cover - older typer on the real click
        from click import exceptions as click_errors

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        code = app(standalone_mode=False)
    except click_errors.NoArgsIsHelpError as e:
        typer.echo(e.ctx.get_help() if e.ctx else "", err=True)
        return EXIT_BAD_INPUT
    except click_errors.UsageError as e:
        command = f"kvtui {e.ctx.info_name}" if e.ctx and e.ctx.parent else "kvtui"
        message = with_suggestion(e.format_message().replace("Value error, ", ""))
        say("error", f"{message} (see `{command} --help`)")
        return EXIT_BAD_INPUT
    except (typer.Abort, KeyboardInterrupt):  # a second Ctrl-C while a run was stopping
        say("error", "interrupted")
        return 130
    return code if isinstance(code, int) else EXIT_OK
