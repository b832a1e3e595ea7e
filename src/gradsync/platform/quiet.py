"""Known-harmless start-up noise, filtered so the first screen of a run shows what a user needs.

Filtered, by exact message (nothing else is hidden):

* Lightning's "💡 Tip" lines advertising its cloud services;
* torch's deprecation of ``broadcast_buffers``: gradsync's periodic strategies pass
  ``broadcast_buffers=False`` on purpose, because ``forward_sync_buffers=False`` would still copy
  rank 0's buffers over each rank's own at start-up, after a resume restored rank-local buffers
  (``average_buffers=False``); ``init_sync_buffers`` does not exist yet;
* Lightning 2.6's use of torch's deprecated ``LeafSpec`` (a Lightning matter, harmless).

On every process but global rank 0, warnings raised inside torch and Lightning are not repeated:
rank 0 shows each once per run. Warnings from user code still show on every rank.
"""

from __future__ import annotations

import logging
import os
import warnings

_TIP = "💡 Tip:"
_installed = False


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_TIP)


def quiet_run() -> None:
    """Everything above, for a run started by the ``gradsync`` command (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    warnings.filterwarnings("ignore", message=r"`broadcast_buffers` is deprecated")  # (also gradsync.strategies)
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_DropTips())
    if int(os.environ.get("RANK", "0") or 0) != 0:
        warnings.filterwarnings("ignore", module=r"(torch|lightning|lightning_fabric|pytorch_lightning)(\.|$)")
