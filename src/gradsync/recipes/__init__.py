"""gradsync recipes: LightningModules and DataModules that users run and subclass.

Recipes never import strategies: any recipe runs under any strategy.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradsync.recipes.base import ClassifierRecipe, Recipe, RecipeData
from gradsync.recipes.chargpt import CharData, CharGPT
from gradsync.recipes.cifar10 import Cifar10Data, Cifar10ResNet
from gradsync.recipes.digits import DigitsClassifier, DigitsData
from gradsync.recipes.hf_causal_lm import HFCausalLM, TextData  # (transformers is imported when one is built)
from gradsync.recipes.synthetic import SyntheticData, SyntheticModel


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
    "chargpt": RecipeEntry(CharGPT, CharData),
    "synthetic": RecipeEntry(SyntheticModel, SyntheticData),
    "cifar10": RecipeEntry(Cifar10ResNet, Cifar10Data),
    "hf_causal_lm": RecipeEntry(HFCausalLM, TextData),
}

__all__ = ["RECIPES", "ClassifierRecipe", "Recipe", "RecipeData", "RecipeEntry", "DigitsClassifier", "DigitsData", "CharGPT", "CharData",
           "SyntheticModel", "SyntheticData", "Cifar10ResNet", "Cifar10Data", "HFCausalLM", "TextData"]
