"""``python -m gradsync.cli.elastic TORCHRUN_ARGS -- GRADSYNC_ARGS``: ``gradsync GRADSYNC_ARGS`` under torchrun's
elastic agent with forked workers (:func:`gradsync.platform.launch.run_elastic`). The launcher runs it in
place of torchrun for ``--fault-tolerance`` jobs and reads its output as torchrun's."""

import sys

from gradsync.cli.main import elastic_worker
from gradsync.platform.launch import run_elastic


def main(argv: list[str]) -> int:
    split = argv.index("--")
    return run_elastic(argv[split + 1:], argv[:split], elastic_worker)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
