"""Structure the code must keep: short functions where the engine's plan is read, no dead code
(ruff with pyflakes and a complexity limit), and every committed recording valid and replayable."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
MAX_FUNCTION_LINES = 40


def _long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_engine_and_session_functions_stay_short():
    files = sorted((ROOT / "kvtui" / "engine").glob("*.py")) + [ROOT / "kvtui" / "session.py"]
    assert [f for path in files for f in _long_functions(path)] == []


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


FORBIDDEN_FOR_CORE = ("kvtui.tui", "kvtui.serve", "kvtui.target", "kvtui.cli")


def _imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `path`, at any depth (function-level ones too);
    relative imports resolved against `package` (the file's), `from X import Y` counted as X and X.Y."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def test_engine_detectors_and_events_import_nothing_from_the_ui_server_target_or_cli():
    files = sorted((ROOT / "kvtui" / "engine").glob("*.py")) + sorted((ROOT / "kvtui" / "detect").glob("*.py")) \
        + [ROOT / "kvtui" / "events.py"]
    assert len(files) > 15
    bad = [f"{path.relative_to(ROOT)}:{line} imports {name}" for path in files
           for line, name in _imported_modules(path, ".".join(path.relative_to(ROOT).parts[:-1]))
           if name in FORBIDDEN_FOR_CORE or name.startswith(tuple(m + "." for m in FORBIDDEN_FOR_CORE))]
    assert bad == []


def test_the_import_check_sees_function_level_and_relative_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from ..tui import app\n    import kvtui.cli\n    from kvtui import serve\n")
    names = [name for _, name in _imported_modules(probe, "kvtui.engine")]
    assert {"kvtui.tui", "kvtui.tui.app", "kvtui.cli", "kvtui.serve"} <= set(names)


# package -> the packages its modules may not import (any depth, function-level and TYPE_CHECKING ones too)
NOT_IMPORTED_BY = {
    "tui": ("kvtui.target", "kvtui.serve", "kvtui.cli"),  # the dashboard reads events and snapshots only
    "target": ("kvtui.tui", "kvtui.cli"),  # HTTP only: clients, sessions, servers
    "serve": ("kvtui.target", "kvtui.cli"),
}


@pytest.mark.parametrize("package", sorted(NOT_IMPORTED_BY))
def test_imports_run_down_the_layers(package):
    """The dashboard imports nothing of target/ (its target views live in tui/), target/ nothing of the
    dashboard or the CLI, serve/ nothing of target/ or the CLI: no import runs back up."""
    forbidden = NOT_IMPORTED_BY[package]
    files = sorted((ROOT / "kvtui" / package).glob("*.py"))
    assert len(files) > 5
    bad = [f"{path.relative_to(ROOT)}:{line} imports {name}" for path in files
           for line, name in _imported_modules(path, f"kvtui.{package}")
           if name in forbidden or name.startswith(tuple(m + "." for m in forbidden))]
    assert bad == []
