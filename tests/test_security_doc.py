"""SECURITY.md names, for every threat, the test that covers it: each name must exist.

A reference is ``file.py::test_name`` (a parametrised case may follow in brackets), or
``::test_name`` for another test of the file named just before it in the same cell.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        n.name
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name.startswith("test_")
    }


def test_every_test_named_in_the_threat_model_exists() -> None:
    text = (ROOT / "SECURITY.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and "test_" in line]
    assert len(rows) >= 25
    checked = 0
    for row in rows:
        cells = row.split(" | ")
        cell = cells[-1]
        current: str | None = None
        for m in re.finditer(r"`([^`]+)`", cell):
            ref = m.group(1)
            if ref.startswith("["):  # a parametrised case of the test named before it
                continue
            file_part, _, name = ref.partition("::")
            if file_part:
                if "*" in file_part:
                    assert list((ROOT / "tests").glob(file_part)), ref
                    continue
                path = ROOT / file_part if "/" in file_part else ROOT / "tests" / file_part
                assert path.is_file(), f"{ref}: no such file"
                current = file_part
            if name:
                assert current is not None, f"{ref}: which file?"
                bare = name.split("[")[0]
                assert bare in _tests(ROOT / "tests" / current), f"{current}::{bare} is not a test"
                checked += 1
    assert checked >= 25
