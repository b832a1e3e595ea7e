"""``gradsync lighthouse``: torchft's lighthouse, which the replica groups of ``--fault-tolerance torchft`` meet at.

    gradsync lighthouse --min-replicas 2 --port 29510
    gradsync fit ... --fault-tolerance torchft --lighthouse http://HOST:29510 --replica-group 0 --replica-groups 3

It forms the quorum of every round: at once when every group of the previous quorum asked again;
otherwise once ``--min-replicas`` groups asked, more than half of the groups heart-beating, waiting up to
``--join-timeout-ms`` for the others (a group silent for ``--heartbeat-timeout-ms`` is not waited for).
So ``--min-replicas`` is the fewest groups a round may average over: with as many as there are groups, the
others wait for a dead one to come back; one fewer lets them go on. Runs until interrupted.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
from typing import Optional, Sequence

from gradsync.platform.fault_tolerance import import_torchft


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gradsync lighthouse", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-replicas", "--min_replicas", type=int, required=True,
                   help="the fewest replica groups a round may average over (the first quorum waits for this "
                        "many); fewer than the number of groups, so the others go on when one dies")
    p.add_argument("--port", type=int, default=29510, help="TCP port to listen on (default 29510; 0: any free port)")
    p.add_argument("--bind", default=None,
                   help="address to listen on (default: the address this host's name resolves to, the one the "
                        "printed URL names; [::] for every interface)")
    # Longer than the heartbeat timeout: a dead group is not waited for once it is silent (2 s), while a live
    # one that is late (a busy machine) is, instead of being left out and healing a round later, losing its
    # local steps (faults benchmark, 1 s: a group that never died healed 8 times in 4 minutes).
    p.add_argument("--join-timeout-ms", "--join_timeout_ms", type=int, default=5000,
                   help="how long a quorum waits for heart-beating members of the previous one that have not asked "
                        "yet (default 5000; a silent group is not waited for)")
    p.add_argument("--heartbeat-timeout-ms", "--heartbeat_timeout_ms", type=int, default=2000,
                   help="a group silent this long is considered gone (default 2000)")
    p.add_argument("--address-file", "--address_file", default=None,
                   help="also write the lighthouse's address to this file once it listens")
    return p


def cmd_lighthouse(argv: Sequence[str], stop: Optional[threading.Event] = None) -> int:
    args = parser().parse_args(list(argv))
    if args.min_replicas < 1:
        print(f"gradsync: error: --min-replicas {args.min_replicas}: must be >= 1", file=sys.stderr)
        return 2
    if not 0 <= args.port < 65536:
        print(f"gradsync: error: --port {args.port}: must be a TCP port, 0..65535", file=sys.stderr)
        return 2
    if args.bind is None:
        try:  # the interface the printed address reaches, not every interface of the machine
            args.bind = socket.gethostbyname(socket.gethostname())
        except OSError as exc:
            print(f"gradsync: error: this host's name {socket.gethostname()} does not resolve ({exc}); give --bind "
                  "ADDRESS (the interface the replica groups reach)", file=sys.stderr)
            return 2
    import_torchft()
    from torchft.coordination import LighthouseServer

    try:
        server = LighthouseServer(bind=f"{args.bind}:{args.port}", min_replicas=args.min_replicas,
                                  join_timeout_ms=args.join_timeout_ms,
                                  heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    except Exception as exc:  # the port is taken, the address is not this machine's
        print(f"gradsync: error: --port {args.port}: the lighthouse cannot listen on {args.bind}:{args.port} "
              f"({str(exc).splitlines()[0][:200]}); choose another --port", file=sys.stderr)
        return 2
    address = server.address().replace("[::]", socket.gethostname()).replace("0.0.0.0", socket.gethostname())
    if args.address_file:
        from pathlib import Path

        tmp = Path(args.address_file).with_suffix(".tmp")
        tmp.write_text(address + "\n")
        tmp.replace(args.address_file)
    print(f"gradsync: lighthouse at {address}, first quorum at {args.min_replicas} replica group(s); pass "
          f"--fault-tolerance torchft --lighthouse {address} to every group (Ctrl-C stops it)", flush=True)
    stop = stop or threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return 0
