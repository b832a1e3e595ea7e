"""The communication ledger lives in :mod:`gradsync.comm.ledger`; this name is kept for existing imports."""

from gradsync.comm.ledger import COLLECTIVES, CommLedger, Totals, fp32_allreduce_bytes, wire_bytes

__all__ = ["COLLECTIVES", "CommLedger", "Totals", "fp32_allreduce_bytes", "wire_bytes"]
