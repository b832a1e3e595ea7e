"""An executable that behaves like ``python`` for the tests, and is a fork of the test fork server.

``tests/forkserver.py`` writes this file, with a ``#!<the real interpreter> -IS`` line on top. Started as
``python [-u] -m MODULE ...``, ``python [-u] -c CODE ...`` or ``python [-u] SCRIPT ...`` with
``$GRADSYNC_FORKSERVER`` naming the servers' folder, it hands the server of its network namespace its
command line, environment, working directory and standard streams (starting that server first when there
is none: ``ip netns exec`` puts the benchmarks' nodes in namespaces of their own); the server forks a
process that runs the command; this process relays signals to it (to its process group) and exits as it
exited. Anything else (another interpreter flag, more open descriptors than the three standard streams, a
server that does not answer) runs the real interpreter in its place, so this file is always a correct
``python``.
"""

import fcntl
import json
import os
import signal
import socket
import struct
import sys
import time

REAL_PYTHON = "@REAL_PYTHON@"  # filled in by tests/forkserver.py
FORKSERVER = "@FORKSERVER@"


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


def socket_path(folder: str) -> str:
    """The socket of the server for this process's network namespace."""
    return os.path.join(folder, f"netns-{os.stat('/proc/self/ns/net').st_ino}.socket")


def _server_alive(path: str) -> bool:
    """A server holds a lock on ``<socket>.lock`` for as long as it lives (the socket file may be stale)."""
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _start_server(path: str) -> None:
    """A server for this namespace, detached; it leaves after 5 idle minutes. Of two started at once,
    the second finds the lock taken and leaves."""
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork() == 0:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.execv(REAL_PYTHON, [REAL_PYTHON, FORKSERVER, path, "--idle-exit", "300"])
        os._exit(0)
    os.waitpid(pid, 0)


def _connect(folder: str):
    path = socket_path(folder)
    started = False
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)  # while the server imports, the request waits in its backlog
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            if not started and not _server_alive(path):
                _start_server(path)
                started = True
            time.sleep(0.02)
        except OSError:
            sock.close()
            return None
    return None


def main() -> None:
    folder = os.environ.get("GRADSYNC_FORKSERVER")
    parsed = _parse(sys.argv[1:])
    if not folder or parsed is None or not _only_standard_streams():
        _real()
    unbuffered, mode, target, args = parsed
    sock = _connect(folder)
    if sock is None:
        _real()
    umask = os.umask(0)
    os.umask(umask)
    request = json.dumps({
        "mode": mode, "target": target, "args": args, "unbuffered": unbuffered, "env": dict(os.environ),
        "cwd": os.getcwd(), "umask": umask, "executable": os.path.abspath(sys.argv[0]),
        "uid": os.getuid(), "netns": os.stat("/proc/self/ns/net").st_ino,
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
