"""``--fault-tolerance torchft`` as the command line sees it: the replica group's configuration, torchft's
environment names the flags fall back to, and the import of the ``ft`` extra (one line without it).
The machinery is :mod:`gradsync.comm.managed`; the strategies that use it say so in
``enable_fault_tolerance``."""

from gradsync.comm.managed import (LIGHTHOUSE_ENV, NUM_REPLICA_GROUPS_ENV, REPLICA_GROUP_ENV, FaultToleranceConfig,
                                   import_torchft)

__all__ = ["FaultToleranceConfig", "LIGHTHOUSE_ENV", "NUM_REPLICA_GROUPS_ENV", "REPLICA_GROUP_ENV", "import_torchft"]
