"""The conformance table: a rich table on the terminal, JSON (`--json PATH`) and Markdown
(`--markdown PATH`) for docs."""

from __future__ import annotations

import json
from pathlib import Path

from kvtui.conformance.base import CheckResult

STYLE = {"pass": "green", "fail": "bold red", "n/a": "yellow"}


def counts(results: list[CheckResult]) -> dict[str, int]:
    """{"pass": n, "fail": n, "n/a": n}."""
    return {v: sum(r.verdict == v for r in results) for v in ("pass", "fail", "n/a")}


def print_table(results: list[CheckResult], target: str, console) -> None:
    """One row per check: class, verdict, what was sent, figures, evidence (or the n/a reason)."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"conformance of {target}", title_justify="left", show_lines=True)
    for column, ratio in (("class", 2), ("verdict", 1), ("sent", 4), ("figures", 4), ("evidence / why n/a", 4)):
        table.add_column(column, ratio=ratio, overflow="fold")
    for r in results:
        table.add_row(escape(r.title), f"[{STYLE[r.verdict]}]{r.verdict}[/]", escape(r.sent), escape(r.figures),
                      escape(r.evidence or "-"))
    c = counts(results)
    table.caption = f"{c['pass']} pass, {c['fail']} fail, {c['n/a']} not applicable"
    console.print(table)


def to_json(results: list[CheckResult], target: str, label: str | None = None, server: dict | None = None) -> dict:
    """The results as a JSON document: target, label, server (kvtui.remote.identity.ServerIdentity.as_dict:
    name, version, source, server_header; None when not asked), counts, one object per check."""
    return {"target": target, "label": label, "server": server, "counts": counts(results),
            "checks": [r.as_dict() for r in results]}


def write_json(path: Path, results: list[CheckResult], target: str, label: str | None = None,
               server: dict | None = None) -> None:
    """Write to_json to `path`.

    Raises:
        OSError: the file cannot be written.
    """
    Path(path).write_text(json.dumps(to_json(results, target, label, server), indent=2) + "\n")


def _cell(text: str) -> str:
    return (text or "-").replace("|", "\\|").replace("\n", " ")


def server_line(server: dict) -> str:
    """One line naming the server (a ServerIdentity.as_dict), e.g. 'server: vLLM 0.32.0 (name: /v1/models
    owned_by; version: GET /version)', or 'server: not identified (nothing said)'."""
    said = " ".join(str(server[part]) for part in ("name", "version") if server.get(part)) or "not identified"
    return f"server: {said} ({server.get('source') or 'nothing said'})"


def markdown(results: list[CheckResult], heading: str | None = None, server: dict | None = None) -> str:
    """A Markdown table: class, verdict, figures, evidence (what was sent is in docs/conformance.md), under
    `### heading` and, with `server` (a ServerIdentity.as_dict, as --json has it), server_line()."""
    lines = [f"### {heading}", ""] if heading else []
    lines += [server_line(server), ""] if server is not None else []
    lines += ["| class | verdict | figures | evidence / why n/a |", "|---|---|---|---|"]
    lines += [f"| {_cell(r.title)} | **{r.verdict}** | {_cell(r.figures)} | {_cell(r.evidence)} |" for r in results]
    return "\n".join(lines) + "\n"


def write_markdown(path: Path, results: list[CheckResult], heading: str | None = None,
                   server: dict | None = None) -> None:
    """Write markdown() to `path`.

    Raises:
        OSError: the file cannot be written.
    """
    Path(path).write_text(markdown(results, heading, server))
