"""Structure the code must keep: short functions where the engine's plan is read, no dead code
(ruff with pyflakes and a complexity limit), and every committed recording valid and replayable."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
MAX_FUNCTION_LINES = 40


def _long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_engine_and_session_functions_stay_short():
    files = sorted((ROOT / "kvtui" / "engine").glob("*.py")) + [ROOT / "kvtui" / "session.py"]
    assert [f for path in files for f in _long_functions(path)] == []



SESSION_MAX_METHODS = 25
SESSION_MAX_LINES = 350
# what left the Session for kvtui/run/ (clock.py, engine_setup.py, timeline.py, controls.py, intake.py)
MOVED_OUT = {"_check_clock", "pause_clock", "resume_clock", "hold_for_wall", "_make_engine", "_engine_config",
             "_cost_model", "_adapters", "reload_adapter", "_apply_timeline", "_note_unapplied_timeline",
             "set_fault", "scale_arrival_rate", "burst", "submit_external", "abort_external", "call_external",
             "_drain_external"}


def test_the_session_is_the_loop_only():
    """kvtui/session.py's Session keeps the run loop (timeline, due arrivals, intake, step, observers,
    controls) and no more: at most 25 methods and 350 lines, the file too; the clock, the engine's setup,
    the timeline, the live controls and serve's queue live in kvtui/run/ (the detector attributes are
    checked by tests/run/test_observers.py)."""
    path = ROOT / "kvtui" / "session.py"
    tree = ast.parse(path.read_text())
    (session,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Session"]
    methods = [n.name for n in session.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert len(methods) <= SESSION_MAX_METHODS, methods
    assert session.end_lineno - session.lineno + 1 <= SESSION_MAX_LINES
    assert len(path.read_text().splitlines()) <= SESSION_MAX_LINES
    assert MOVED_OUT.isdisjoint(methods) and {"__init__", "step_once", "run", "close"} <= set(methods)

def test_ruff_finds_nothing():
    ruff = shutil.which("ruff") or shutil.which("ruff", path=str(Path(sys.executable).parent))
    if ruff is None:
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    out = subprocess.run([ruff, "check", "kvtui", "tests"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_recordings_readme_lists_every_event_type_and_field():
    from kvtui.events import EVENT_TYPES, EVIDENCE

    readme = (ROOT / "recordings" / "README.md").read_text()
    missing = [f"{kind}" for kind in EVENT_TYPES if f"`{kind}`" not in readme]
    for kind, model in list(EVENT_TYPES.items()) + list(EVIDENCE.items()):
        missing += [f"{kind}.{name}" for name, field in model.model_fields.items()
                    if f"`{field.alias or name}`" not in readme and f"`{name}`" not in readme]
    assert missing == []


def test_committed_recordings_validate_and_replay_to_their_summaries():
    """Every line of every recording matches its event type, and replaying the events gives the summary
    the live run wrote (every field it wrote)."""
    from kvtui.cli import replay_summary
    from kvtui.record import read_recording

    paths = sorted((ROOT / "recordings").glob("*.jsonl"))
    assert len(paths) >= 12
    for path in paths:
        header, events, summary, truncated = read_recording(path)
        assert not truncated and summary is not None, path.name
        replayed = replay_summary(header, events, summary)
        written = summary.model_dump(exclude_unset=True)
        assert {k: v for k, v in replayed.model_dump().items() if k in written} == written, path.name




def test_no_module_uses_what_the_oldest_python_pyproject_allows_lacks():
    """pyproject says requires-python >=3.10, and Python 3.10's enum has no StrEnum (added in 3.11): importing
    a module that takes it fails there before anything runs. Typed names are `(str, Enum)` with `__str__`
    and `__format__` giving the value (kvtui.model_kinds.ModelKind, FaultName, SkipReason)."""
    assert 'requires-python = ">=3.10"' in (ROOT / "pyproject.toml").read_text()
    since_311 = {"enum": {"StrEnum", "ReprEnum"}, "typing": {"Self", "LiteralString", "Never", "assert_never"}}
    found = []
    for path in sorted((ROOT / "kvtui").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module in since_311:
                found += [f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{a.name}" for a in node.names
                          if a.name in since_311[node.module]]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.attr in since_311.get(node.value.id, ()):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value.id}.{node.attr}")
    assert found == []


def test_module_names_under_tests_are_unique():
    """pytest's default (prepend) import mode imports a test folder's modules by their bare names, so two
    files of one name in different folders under tests/ are one module: a second helper module of one name
    in a room folder would shadow the first for every test that imports it, and they fail with ImportError.
    Each name appears once; conftest.py is the exception, one per room folder (pytest loads each by its path,
    clearing the last `conftest` from sys.modules first), which is why nothing imports a conftest."""
    names: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if "__snapshots__" not in path.parts and path.name != "conftest.py":
            names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in names.items() if len(paths) > 1} == {}


def test_nothing_imports_a_conftest():
    """With a conftest.py in tests/ and in room folders (tests/remote/conftest.py), the module `conftest` is
    whichever pytest loaded last, so `from conftest import smollm2_available` read the wrong one; what tests
    share beside fixtures lives in tests/helpers.py."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) else []
            if "conftest" in names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []
