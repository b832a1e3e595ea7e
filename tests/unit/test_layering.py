"""The direction of imports (DESIGN.md), read from the source: a layer never reaches up.

    cli -> platform (and catalog, errors) -> strategies, recipes -> lightning, torch
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
    # the CLI reaches strategies, recipes and the layers under them only through platform
    ("cli", ("gradsync.strategies", "gradsync.recipes", "gradsync.algorithms", "gradsync.comm")),
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


def _module_graph() -> dict[str, set[str]]:
    """gradsync module -> the gradsync modules it imports (lazy imports too). ``from pkg import sub``
    is an import of the submodule ``pkg.sub``; ``from pkg import name`` one of the package."""
    def name_of(path: Path) -> str:
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    paths = {name_of(p): p for p in SRC.rglob("*.py")}
    graph = {}
    for module, path in paths.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = {f"{node.module}.{a.name}" for a in node.names} & paths.keys()
                deps.update(subs)
                if len(subs) < len(node.names):
                    deps.add(node.module)
        graph[module] = {d for d in deps if d in paths and d != module}
    return graph


def test_no_import_cycle_between_gradsync_modules():
    graph, state, path, cycles = _module_graph(), {}, [], []

    def visit(module: str) -> None:
        state[module] = "open"
        path.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep)
        path.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert len(graph) > 40 and any("gradsync.platform.run" in deps for deps in graph.values())
    assert not cycles, cycles


@pytest.mark.parametrize("package", ["gradsync", "gradsync.strategies", "gradsync.comm", "gradsync.algorithms",
                                     "gradsync.recipes"])
def test_every_name_in_all_resolves(package):
    """``from PACKAGE import *`` works: no name in ``__all__`` raises or is missing."""
    import importlib

    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None, f"{package}.{name}"
    namespace: dict = {}
    exec(f"from {package} import *", namespace)
    assert set(module.__all__) <= set(namespace)


def test_the_ledger_is_reachable_from_the_top_level():
    import gradsync
    from gradsync.comm import CommLedger

    assert gradsync.CommLedger is CommLedger and hasattr(gradsync, "CommLedger")


#: Private names reached on objects other than self, outside strategies/lightning_private.py, that are
#: not Lightning's or torch's internals: gradsync's own, argparse's parser tables, torch's public base class.
NOT_INTERNALS = {
    ("platform/trainer_args.py", "_actions"), ("platform/trainer_args.py", "_option_string_actions"),  # argparse
    ("cli/main.py", "_actions"), ("cli/main.py", "_typehint"),  # argparse's table, jsonargparse's type of a flag
    ("recipes/data.py", "_skip"),  # gradsync's own sampler
    ("strategies/local_clip.py", "_pending"),  # gradsync's own hook state
    ("strategies/sync_batchnorm.py", "_BatchNorm"),  # torch's base of every BatchNorm (isinstance)
    ("strategies/compressed.py", "_normalize_weighted_gradients"),  # super(): gradsync's base
    ("strategies/compressed.py", "_unsupported_across_groups"),  # super(): gradsync's QuorumPerStep
    ("cli/main.py", "_exit"),  # os._exit: a failed elastic worker does not wait for threads stuck on a dead peer
    ("strategies/replicas.py", "_gradients_reduced"),  # super(): gradsync's base
    ("strategies/replicas.py", "_shards_cross"),  # super(): gradsync's NodeSharding
}


def _own_private_names() -> set:
    """Private names gradsync itself defines: methods, class attributes, and self._x it assigns."""
    own = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    for t in ast.walk(target):
                        if isinstance(t, ast.Attribute):
                            own.add(t.attr)
                        elif isinstance(t, ast.Name):
                            own.add(t.id)
    return {n for n in own if n.startswith("_")}


def test_lightning_and_torch_internals_are_reached_only_in_lightning_private():
    own = _own_private_names()
    found = set()
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(SRC))
        if rel == "strategies/lightning_private.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = None
            if isinstance(node, ast.Attribute):
                on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                # on self: a private name gradsync never defines is the base class's (Lightning's)
                name = None if on_self and node.attr in own else node.attr
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "setattr", "hasattr") \
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                name = node.args[1].value  # getattr(x, "_member")
            if isinstance(name, str) and name.startswith("_") and not name.startswith("__"):
                found.add((rel, name))
    assert found - NOT_INTERNALS == set(), "reach private members through strategies/lightning_private.py"
    assert NOT_INTERNALS <= found  # the allowance stays as small as the code
