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
