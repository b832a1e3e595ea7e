"""Moved: the parameter server's rule is :mod:`gradsync.algorithms.param_server`, its transport :mod:`gradsync.comm.ps`."""

raise ImportError("gradsync.strategies.ps_server moved: from gradsync.algorithms.param_server import ShardState, "
                  "split_shards; from gradsync.comm.ps import PSClient, ServerThread, ServerError")
