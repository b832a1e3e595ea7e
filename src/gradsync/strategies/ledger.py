"""Moved: the communication ledger is :mod:`gradsync.comm.ledger`."""

raise ImportError("gradsync.strategies.ledger moved to gradsync.comm.ledger: "
                  "from gradsync.comm.ledger import CommLedger, fp32_allreduce_bytes, wire_bytes")
