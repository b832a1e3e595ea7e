"""The catalog the CLI answers from without importing torch: the same names, classes and
descriptions as the real registries."""

import importlib

from gradsync import catalog


def _load(path):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_recipes_match_the_real_classes():
    from gradsync.recipes import RECIPES

    assert list(catalog.RECIPES) == list(RECIPES)
    for name, (model, data, text) in catalog.RECIPES.items():
        assert _load(model) is RECIPES[name].model and _load(data) is RECIPES[name].data
        assert text == RECIPES[name].description


def test_strategies_match_the_real_classes():
    from gradsync.strategies import STRATEGIES

    assert list(catalog.STRATEGIES) == list(STRATEGIES)
    for name, (path, text) in catalog.STRATEGIES.items():
        assert _load(path) is STRATEGIES[name]
        assert text == STRATEGIES[name].describe()
