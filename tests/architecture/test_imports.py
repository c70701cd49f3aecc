"""Imports only go down: an ast pass over kvtui/ (function-level imports included, since a lazy import is
still a dependency) finds no import circle between modules or between rooms, and none running back up.

Every room has a rank (docs/architecture.md, "Rooms"); a module may import its own room and rooms of a
lower rank only. So engine/, detect/ and events.py import none of tui/, serve/, remote/ or the CLI; the
dashboard (tui/) imports no remote/ or serve/ (it reads events and snapshots); remote/ imports no tui/;
nothing imports the CLI. A new room fails the test until it is given a rank here and in the doc.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PACKAGE = ROOT / "kvtui"

RANK = {
    "names": -1,  # the did-you-mean rule: imports nothing of kvtui, so every room may use it
    "model_kinds": -1,  # ModelKind: the fault catalogue and the model registry both read it
    "kvtui": 0, "config": 0, "faults": 0, "memory": 0,  # plain facts: names, defaults, bounds
    "events": 1,  # the event types every room speaks (the engine returns its StepEvent)
    "models": 2, "engine": 3,
    "request": 3.5,  # PlannedRequest: the request shape scenarios build and serve, remote and run read
    "detect": 4, "scenario": 4, "calibrate": 4, "pacing": 4,
    "metrics": 5, "record": 5, "summary": 5, "audit_timing": 5,
    "run": 6,  # the run spine: sink, event builders, verdict, noninterference audit
    "session": 7,  # the local run loop
    "audit": 8, "remote": 8,  # the local audit; the client that drives remote servers
    "tui": 9,  # the dashboard
    "serve": 10,  # the OpenAI-compatible server (its --dashboard opens the dashboard)
    "bench": 11, "conformance": 11,  # benchmarks; every isolation audit against one server (starts kvtui serve)
    "cli": 12,
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


def test_every_room_has_a_rank(graph):
    assert sorted({room(m) for m in graph} - set(RANK)) == []


def test_imports_only_go_down(graph):
    upward = sorted(f"{module} -> {target}" for module, targets in graph.items() for target in targets
                    if room(target) != room(module) and RANK.get(room(target), 99) >= RANK.get(room(module), -1))
    assert upward == [], "imports running back up (or sideways between rooms of one rank):\n" + "\n".join(upward)
