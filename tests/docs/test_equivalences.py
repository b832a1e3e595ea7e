"""Every test docs/reference/equivalences.md names exists (a renamed or deleted test fails here)."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference" / "equivalences.md"


def test_every_named_test_exists():
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", PAGE.read_text())
    assert len(named) >= 15, named
    for path, name in named:
        tree = ast.parse((ROOT / path).read_text())
        tests = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name in tests, f"equivalences.md names {path}::{name}, which does not exist"


def test_every_row_names_a_test():
    table = [line for line in PAGE.read_text().splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(table) >= 14
    for row in table:
        assert "`tests/" in row.split("|")[3], f"a claim without a test: {row}"
