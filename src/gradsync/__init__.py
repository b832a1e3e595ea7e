"""gradsync: pluggable gradient-synchronization strategies for Lightning.

``import gradsync`` registers every strategy with Lightning, so ``L.Trainer(strategy="sync")``
works in plain Lightning code.
"""

from __future__ import annotations

__version__ = "0.1.0"

from gradsync.recipes import RECIPES, Recipe, RecipeData  # noqa: E402
from gradsync.strategies import STRATEGIES, CommLedger, GradsyncStrategy, SyncStrategy  # noqa: E402

__all__ = ["RECIPES", "STRATEGIES", "CommLedger", "GradsyncStrategy", "Recipe", "RecipeData", "SyncStrategy",
           "__version__"]
