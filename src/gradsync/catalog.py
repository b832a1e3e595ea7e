"""What the ``gradsync`` command can answer without importing torch or Lightning.

``gradsync --help``, ``gradsync list`` and the errors for an unknown command, recipe, strategy or
flag come from here, in a fraction of a second; the classes are imported only to run. A test keeps
these names and descriptions equal to the classes' own (tests/unit/test_catalog.py).

Strategies outside gradsync are found by class path (``--strategy my_pkg.MyStrategy``) or by a
registered name: a package declares an entry point in the group ``gradsync.strategies``, e.g. in
its ``pyproject.toml``::

    [project.entry-points."gradsync.strategies"]
    my_sync = "my_pkg.strategies:MySyncStrategy"
"""

from __future__ import annotations

from typing import Optional

#: recipe name -> (model class path, data class path, one-line description)
RECIPES: dict[str, tuple[str, str, str]] = {
    "digits": ("gradsync.recipes.digits.DigitsClassifier", "gradsync.recipes.digits.DigitsData",
               "Two 3x3 convolutions and a linear head; ~0.97 validation accuracy in a few hundred steps."),
    "chargpt": ("gradsync.recipes.chargpt.CharGPT", "gradsync.recipes.chargpt.CharData",
                "A GPT-style transformer over characters (default corpus: the Python standard library)."),
    "synthetic": ("gradsync.recipes.synthetic.SyntheticModel", "gradsync.recipes.synthetic.SyntheticData",
                  "An MLP of a chosen parameter count on generated data, for communication benchmarks."),
    "cifar10": ("gradsync.recipes.cifar10.Cifar10ResNet", "gradsync.recipes.cifar10.Cifar10Data",
                "ResNet-18 on CIFAR-10 from the python-pickle files (~94% test accuracy with a full schedule)."),
    "hf_causal_lm": ("gradsync.recipes.hf_causal_lm.HFCausalLM", "gradsync.recipes.hf_causal_lm.TextData",
                     "Any Hugging Face transformers causal LM from a config (GPT-2, Llama, ...), on text as bytes "
                     "(needs gradsync[hf])."),
}

#: strategy name -> (class path, one-line description)
STRATEGIES: dict[str, tuple[str, str]] = {
    "sync": ("gradsync.strategies.sync.SyncStrategy",
             "Synchronous data parallel: every step all ranks apply the mean of all ranks' gradients."),
    "accumulate": ("gradsync.strategies.accumulate.AccumulateStrategy",
                   "Synchronous DDP with gradient accumulation: one all-reduce per optimizer step of K micro-batches."),
    "local_sgd": ("gradsync.strategies.local_sgd.LocalSGDStrategy",
                  "Local SGD: train locally, average the parameters every `period` optimizer steps."),
    "diloco": ("gradsync.strategies.diloco.DiLoCoStrategy",
               "DiLoCo: local inner steps, outer Nesterov SGD on the averaged pseudo-gradient every `period` steps."),
    "compressed": ("gradsync.strategies.compressed.CompressedStrategy",
                   "Compressed all-reduce: gradients sent as fp16, bf16, int8, int4, sign, top-k, PowerSGD or sparse 2-bit."),
    "async_ps": ("gradsync.strategies.async_ps.AsyncPSStrategy",
                 "Asynchronous SGD through parameter-server shards, staleness bounded by `max_staleness`."),
}

ENTRY_POINT_GROUP = "gradsync.strategies"


def plugin_strategies() -> dict[str, str]:
    """Strategies other packages register by name: name -> ``module:Class`` (nothing is imported)."""
    from importlib.metadata import entry_points

    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name not in STRATEGIES}


def strategy_class_path(name: str) -> Optional[str]:
    """The import path of a strategy given by gradsync name, plugin name or ``module.Class``; None
    for any other name (which may still be a stock Lightning strategy such as ``ddp``)."""
    if name in STRATEGIES:
        return STRATEGIES[name][0]
    plugin = plugin_strategies().get(name)
    if plugin is not None:
        return plugin.replace(":", ".")
    if "." in name:
        return name
    return None
