"""An executable that behaves like ``python`` for the tests, and is a fork of the test fork server.

``tests/forkserver.py`` writes this file, with a ``#!<the real interpreter> -IS`` line on top, next to its
socket. Started as ``python [-u] -m MODULE ...``, ``python [-u] -c CODE ...`` or ``python [-u] SCRIPT
...`` with ``$GRADSYNC_FORKSERVER`` naming the server's socket, it hands the server its command line,
environment, working directory and standard streams; the server forks a process that runs the command;
this process relays signals to it (to its process group) and exits as it exited. Anything else (another
interpreter flag, more open descriptors than the three standard streams, no server) runs the real
interpreter in its place, so this file is always a correct ``python``.
"""

import json
import os
import signal
import socket
import struct
import sys

REAL_PYTHON = "@REAL_PYTHON@"  # filled in by tests/forkserver.py


def _real() -> None:
    os.execv(REAL_PYTHON, [REAL_PYTHON, *sys.argv[1:]])


def _parse(args: list) -> object:
    unbuffered = False
    for i, arg in enumerate(args):
        if arg == "-u":
            unbuffered = True
        elif arg in ("-m", "-c"):
            if i + 1 >= len(args):
                return None
            return unbuffered, ("module" if arg == "-m" else "command"), args[i + 1], args[i + 2:]
        elif arg.startswith("-"):
            return None  # any other interpreter option: the real interpreter
        else:
            return unbuffered, "script", arg, args[i + 1:]
    return None  # interactive


def _only_standard_streams() -> bool:
    listing = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in os.listdir(listing):
            fd = int(name)
            if fd > 2 and fd != listing:
                try:
                    if os.readlink(f"/proc/self/fd/{fd}").startswith("/proc/"):
                        continue  # the listing itself
                except OSError:
                    continue
                return False  # descriptors passed on purpose (pass_fds): the real interpreter keeps them
    finally:
        os.close(listing)
    try:
        for fd in (0, 1, 2):
            os.fstat(fd)
    except OSError:
        return False
    return True


def _lines(sock: socket.socket):
    buf = b""
    while True:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield json.loads(line)
        chunk = sock.recv(4096)
        if not chunk:
            return
        buf += chunk


def main() -> None:
    path = os.environ.get("GRADSYNC_FORKSERVER")
    parsed = _parse(sys.argv[1:])
    if not path or parsed is None or not _only_standard_streams():
        _real()
    unbuffered, mode, target, args = parsed
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        _real()
    umask = os.umask(0)
    os.umask(umask)
    request = json.dumps({
        "mode": mode, "target": target, "args": args, "unbuffered": unbuffered, "env": dict(os.environ),
        "cwd": os.getcwd(), "umask": umask, "executable": os.path.abspath(sys.argv[0]),
        "uid": os.getuid(), "netns": os.stat("/proc/self/ns/net").st_ino,
        "mntns": os.stat("/proc/self/ns/mnt").st_ino,
    }).encode()
    socket.send_fds(sock, [struct.pack("!I", len(request)) + request], [0, 1, 2])
    replies = _lines(sock)
    first = next(replies, None)
    if first is None or "real" in first:
        sock.close()
        _real()
    pid = first["pid"]

    def relay(signum, frame):
        try:
            os.killpg(pid, signum)
        except OSError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, relay)
    done = next(replies, None)
    code = 1 if done is None else done["status"]
    if code < 0:  # killed by a signal: die of the same one, as the command did
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


if __name__ == "__main__":
    main()
