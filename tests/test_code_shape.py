"""The shape the code keeps (the developers' guide): modules of at most 500
lines and functions that fit a screen (at most 80 lines), in kvtrain/,
data_tools/, benchmarks/ and launch/. Read from the source with ast; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def _sources() -> list[Path]:
    return sorted(p for root in ("kvtrain", "data_tools", "benchmarks", "launch") for p in (REPO / root).rglob("*.py"))


def test_modules_are_at_most_500_lines():
    long = {str(p.relative_to(REPO)): n for p in _sources()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_functions_fit_a_screen():
    long = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(REPO)}:{node.name}"] = lines
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
