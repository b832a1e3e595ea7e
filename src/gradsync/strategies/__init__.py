"""gradsync strategies: Lightning ``Strategy`` plugins, one idea per file.

Importing this package registers every strategy in Lightning's ``StrategyRegistry`` by its short
name, so ``L.Trainer(strategy="sync")`` works in plain Lightning code.
"""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from gradsync.strategies.base import GradsyncStrategy
from gradsync.strategies.accumulate import AccumulateStrategy
from gradsync.strategies.sync import SyncStrategy
from gradsync.strategies.compressed import CompressedStrategy
from gradsync.strategies.local_sgd import LocalSGDStrategy
from gradsync.strategies.diloco import DiLoCoStrategy
from gradsync.strategies.async_ps import AsyncPSStrategy

#: Every gradsync strategy, by registry name. One name per idea; variants are options.
STRATEGIES: dict[str, type[GradsyncStrategy]] = {cls.strategy_name: cls for cls in (SyncStrategy, AccumulateStrategy, LocalSGDStrategy, DiLoCoStrategy, CompressedStrategy, AsyncPSStrategy)}

import warnings  # noqa: E402

# The periodic strategies pass broadcast_buffers=False on purpose (see gradsync.platform.quiet): the
# deprecation torch prints for it, once per process, is not for the user to act on.
warnings.filterwarnings("ignore", message=r"`broadcast_buffers` is deprecated")
for _cls in STRATEGIES.values():
    _cls.register_strategies(StrategyRegistry)

__all__ = ["STRATEGIES", "AccumulateStrategy", "AsyncPSStrategy", "CompressedStrategy", "DiLoCoStrategy",
           "GradsyncStrategy", "LocalSGDStrategy", "SyncStrategy"]
