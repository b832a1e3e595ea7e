"""gradsync: pluggable gradient-synchronization strategies for Lightning.

``import gradsync`` registers every strategy with Lightning, so ``L.Trainer(strategy="sync")``
works in plain Lightning code, whichever of the two is imported first.

The import itself is cheap: torch and Lightning load only when something needs them (a strategy,
a recipe, a run), so the ``gradsync`` command answers ``--help``, ``list`` and bad flags at once.
If Lightning is not imported yet, the strategies register the moment it is.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "RECIPES": "gradsync.recipes", "Recipe": "gradsync.recipes", "RecipeData": "gradsync.recipes",
    "STRATEGIES": "gradsync.strategies", "CommLedger": "gradsync.comm",
    "GradsyncStrategy": "gradsync.strategies", "SyncStrategy": "gradsync.strategies",
}

__all__ = ["RECIPES", "STRATEGIES", "CommLedger", "GradsyncStrategy", "Recipe", "RecipeData", "SyncStrategy",
           "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gradsync' has no attribute {name!r}")


class _RegisterWithLightning(importlib.abc.MetaPathFinder):
    """Runs ``import gradsync.strategies`` (which registers the strategies) right after the
    ``lightning`` package has finished importing."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "lightning":
            return None
        _remove_hook()
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module: Any) -> None:
            exec_module(module)
            importlib.import_module("gradsync.strategies")

        spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


def _remove_hook() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _RegisterWithLightning)]


if "lightning" in sys.modules:
    importlib.import_module("gradsync.strategies")
elif not any(isinstance(f, _RegisterWithLightning) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWithLightning())
