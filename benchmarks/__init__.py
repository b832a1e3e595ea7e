"""gradsync benchmarks: side-by-side measurements reported as ratios.

    python -m benchmarks codecs|allreduce|overhead|slowlink|all [--quick] [--out DIR]

Each suite writes ``DIR/<suite>.md`` (a table), ``DIR/<suite>.json`` and ``DIR/<suite>.png``;
``python -m benchmarks all`` also regenerates ``benchmarks/RESULTS.md`` from them.
"""

import os

# Suites fork worker processes (Lightning's fork launcher, torch.multiprocessing): a parent whose
# OpenMP pool has already run would hand its children a locked pool. One thread per process also
# keeps 2-process runs from oversubscribing small machines. Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")
