"""Imports only go down: an ast pass over kvtui/ (function-level imports included, since a lazy import is
still a dependency) finds no import circle between modules or between rooms, and none running back up.

The rooms, bottom to top (docs/architecture.md draws them):
- the core: kvtui/__init__, config, faults, memory, models/, engine/, events, detect/, scenario/, record,
  metrics, summary, pacing, calibrate: none of them imports a run, a front end or the CLI;
- the run spine and the local session, the audits;
- the front ends: target/ (HTTP clients and servers), serve/ (the OpenAI-compatible server), tui/ (the
  dashboard): tui/ imports no target/ or serve/ (the dashboard reads events and snapshots only), target/ no
  tui/ or serve/ (HTTP only), serve/ no target/;
- bench/ and the CLI on top: nothing imports the CLI.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "kvtui"

CORE = {"kvtui", "config", "faults", "memory", "models", "engine", "events", "detect", "scenario", "record",
        "metrics", "summary", "pacing", "calibrate"}
FRONT_ENDS = {"target", "serve", "tui"}
# room -> rooms it must never import (beside the general rules below)
FORBIDDEN = {
    # events.py is the vocabulary under everything: the engine returns its StepEvent, events imports no engine
    "engine": {"detect", "scenario", "record", "metrics", "summary"},
    "events": {"engine", "detect", "scenario", "models", "record", "metrics", "summary"},
    "tui": {"target", "serve"},
    "target": {"tui", "serve"},
    "serve": {"target"},
}


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every .py under kvtui/ (a package is its __init__)."""
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def imported(mods: dict[str, Path], name: str, path: Path) -> set[str]:
    """The kvtui modules `name` imports anywhere in its file (top level, functions, TYPE_CHECKING blocks)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in mods:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {resolve(a.name) for a in node.names if a.name.split(".")[0] == "kvtui"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            if base.split(".")[0] == "kvtui":
                found |= {resolve(f"{base}.{a.name}") for a in node.names}
    return found - {None, name}


def room(module: str) -> str:
    """kvtui.engine.paged -> engine; kvtui.events -> events; kvtui -> kvtui."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "kvtui"


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = module_files()
    return {name: imported(mods, name, path) for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_ast_pass_sees_lazy_and_relative_imports(tmp_path):
    """The pass itself: function-level, relative and `from kvtui import X` imports are all edges."""
    mods = module_files()
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from ..tui import app\n    import kvtui.cli.run\n    from kvtui import serve\n")
    assert imported(mods, "kvtui.engine.probe", probe) == {"kvtui.tui.app", "kvtui.cli.run", "kvtui.serve"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_between_modules(graph):
    found = cycles(graph)
    assert found == [], "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_import_circle_between_rooms(graph):
    rooms = {}
    for module, targets in graph.items():
        rooms.setdefault(room(module), set()).update(room(t) for t in targets if room(t) != room(module))
    found = cycles(rooms)
    assert found == [], "rooms importing each other: " + "; ".join(" <-> ".join(c) for c in found)


def test_imports_only_go_down(graph):
    upward = []
    for module, targets in graph.items():
        here = room(module)
        for target in targets:
            there = room(target)
            if there == here:
                continue
            if there == "cli" or (here in CORE and there not in CORE) or there in FORBIDDEN.get(here, ()):
                upward.append(f"{module} -> {target}")
            if here in FRONT_ENDS and there == "bench":
                upward.append(f"{module} -> {target}")
    assert upward == [], "imports running back up:\n" + "\n".join(sorted(upward))
