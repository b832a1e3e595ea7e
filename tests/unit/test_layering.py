"""The direction of imports (DESIGN.md), read from the source: a layer never reaches up.

    cli -> platform -> strategies, recipes -> lightning, torch
                       strategies -> algorithms -> comm -> torch
"""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "gradsync"


def imports_of(package: str) -> dict[str, set[str]]:
    """module path -> the absolute module names it imports (at any depth: lazy imports count too)."""
    out = {}
    for path in sorted((SRC / package).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        out[str(path.relative_to(SRC))] = names
    return out


def _reaches(names: set[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if any(n == p or n.startswith(p + ".") for p in prefixes))


@pytest.mark.parametrize("package, forbidden", [
    ("comm", ("lightning", "pytorch_lightning", "gradsync.algorithms", "gradsync.strategies", "gradsync.platform",
              "gradsync.recipes", "gradsync.cli")),
    ("algorithms", ("lightning", "pytorch_lightning", "gradsync.strategies", "gradsync.platform", "gradsync.recipes",
                    "gradsync.cli")),
    ("strategies", ("gradsync.recipes", "gradsync.platform", "gradsync.cli")),
    ("recipes", ("gradsync.strategies", "gradsync.algorithms", "gradsync.cli")),
])
def test_a_layer_never_imports_the_layers_above_it(package, forbidden):
    bad = {module: _reaches(names, forbidden) for module, names in imports_of(package).items()}
    bad = {m: n for m, n in bad.items() if n}
    assert not bad, f"gradsync.{package} reaches up: {bad}"


def test_algorithms_and_comm_import_without_lightning():
    import subprocess
    import sys

    code = ("import sys, gradsync.algorithms, gradsync.comm; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
