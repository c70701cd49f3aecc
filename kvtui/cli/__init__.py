"""kvtui's command line (Typer): `kvtui.cli:main` is the console script, `python -m kvtui.cli` runs it too.
The commands live in this package's modules (see kvtui/cli/app.py)."""

from kvtui.cli.app import app, main
from kvtui.cli.finish import verdict
from kvtui.cli.replay import replay_summary

__all__ = ["app", "main", "replay_summary", "verdict"]
