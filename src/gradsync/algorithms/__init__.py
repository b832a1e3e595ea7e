"""``gradsync.algorithms``: *when* to communicate and what to do with the result. Pure torch, no Lightning.

* :mod:`~gradsync.algorithms.schedule` — the one owner of the optimizer-step count: warm-up,
  period, fragment offsets, delay;
* :mod:`~gradsync.algorithms.periodic` — local steps and a round every period, one
  :class:`~gradsync.algorithms.periodic.Round` per fragment (prepare / wait / land), hooked on the
  optimizer step, so it runs over DDP replicas, one process per replica, or any group it is given;
* payloads: :mod:`~gradsync.algorithms.local_sgd` (the mean, or the mean change through a lossy
  codec) and :mod:`~gradsync.algorithms.diloco` (an outer Nesterov step on the pseudo-gradient);
* :mod:`~gradsync.algorithms.state` — the registry where each piece of algorithm state is declared
  replicated, averaged or per rank, with one generic save / load / reshard.

Strategies (:mod:`gradsync.strategies`) configure and install these; :mod:`gradsync.comm` moves the bytes.
"""

from gradsync.algorithms.diloco import OuterStep, momentum_at
from gradsync.algorithms.layout import Layout, layer_key, strided_fragments
from gradsync.algorithms.local_sgd import LocalAverage
from gradsync.algorithms.periodic import PeriodicAveraging, Round
from gradsync.algorithms.schedule import Schedule
from gradsync.algorithms.state import StateRegistry

__all__ = ["Layout", "LocalAverage", "OuterStep", "PeriodicAveraging", "Round", "Schedule", "StateRegistry",
           "layer_key", "momentum_at", "strided_fragments"]
