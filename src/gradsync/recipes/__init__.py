"""gradsync recipes: LightningModules and DataModules that users run and subclass.

Recipes never import strategies: any recipe runs under any strategy.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradsync.recipes.base import Recipe, RecipeData
from gradsync.recipes.digits import DigitsClassifier, DigitsData


@dataclass(frozen=True)
class RecipeEntry:
    """A named pair of model and data classes."""

    model: type
    data: type

    @property
    def description(self) -> str:
        return (self.model.__doc__ or self.model.__name__).strip().splitlines()[0]


#: Every recipe, by the name ``--recipe`` takes.
RECIPES: dict[str, RecipeEntry] = {
    "digits": RecipeEntry(DigitsClassifier, DigitsData),
}

__all__ = ["RECIPES", "Recipe", "RecipeData", "RecipeEntry", "DigitsClassifier", "DigitsData"]
