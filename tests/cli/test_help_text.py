"""`kvtui --help` and every command's --help keep what their sources say: no summary cut at the docstring's
first line break, no paragraph broken at the source's line breaks, no choice list wrapped mid-word, and no
word lost to the help renderer (markdown would eat `<R>` as an HTML tag)."""

from __future__ import annotations

import inspect
import re

import pytest
import typer.core
import typer.main
from typer.testing import CliRunner

from kvtui.cli.app import app

COMMANDS = ("run", "replay", "validate", "faults", "audit", "serve", "model", "bench", "calibrate",
            "conformance", "sweep")


def _help(*args: str, width: int) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": str(width), "NO_COLOR": "1"},
                                terminal_width=width)
    assert result.exit_code == 0, result.output
    return result.output


def _one_line(text: str) -> str:
    """The help with its box borders gone and its lines joined: the words as a reader meets them."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


def test_command_list_keeps_each_summary_whole():
    out = _help(width=200)
    row = next(line for line in out.splitlines() if "│ run " in line)
    assert "With --target, drive a real inference server (vLLM, SGLang, llama.cpp, TGI) over HTTP" in row


def test_a_paragraph_is_rewrapped_not_broken_at_the_source_line_breaks():
    lines = [line.strip() for line in _help("run", width=200).splitlines()]
    assert not any(line in ("and", "(the") for line in lines), lines[:20]
    assert any("or a fault on and expect: {contamination: detected} but nothing detected" in line
               for line in lines)


@pytest.mark.parametrize("command", COMMANDS)
def test_no_choice_list_wraps_mid_word(command):
    out = _help(command, width=100)
    broken = [line for line in out.splitlines() if re.search(r"<(?!=)[^>\s]*(\s{2,}|│|$)", line.rstrip())]
    assert broken == []


@pytest.mark.parametrize("command", COMMANDS)
def test_every_word_of_the_help_texts_reaches_the_screen(command):
    click_command = typer.main.get_command(app).commands[command]
    texts = [inspect.cleandoc(click_command.help or "")]
    texts += [p.help for p in click_command.params if isinstance(p, typer.core.TyperOption) and p.help]
    shown = _one_line(_help(command, width=250))
    missing = [word for text in texts for word in text.replace("`", "").replace("\\[", "[").split()
               if word.strip(".,;:()") and word.strip(".,;:()") not in shown]
    assert missing == []
