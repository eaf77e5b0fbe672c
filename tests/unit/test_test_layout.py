"""Test modules share helpers through `tests/support` (and the few support modules beside them),
never by importing one another or the conftest: a test module is free to change without breaking
another's imports, and a reader finds every shared helper in one place."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _imported(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return names


def test_no_test_module_imports_another_test_module_or_the_conftest() -> None:
    wrong = {}
    for path in sorted(TESTS.rglob("*.py")):
        bad = [
            name
            for name in _imported(path)
            if name.startswith("tests.") and (name.rsplit(".", 1)[-1].startswith("test_") or name.endswith("conftest"))
        ]
        if bad:
            wrong[str(path.relative_to(TESTS))] = bad
    assert wrong == {}, f"move what these share into tests/support: {wrong}"
