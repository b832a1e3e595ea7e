"""The tests' fork server: Python processes at the cost of a fork, not of importing torch and Lightning.

Each ``gradsync`` process a test starts (the launcher, torchrun, torchrun's workers) spends ~6-8 s of CPU on
this kind of machine importing torch, Lightning, torchmetrics (which imports transformers and scipy) and
jsonargparse before it does anything, and the suite starts a few hundred. This server imports all of that
once, then serves requests from ``forkserver_python.py`` (an executable that behaves like ``python``, see
there): for each it forks a *supervisor*, which forks the process that runs the command and reports its
exit status back.

The command's process is a new process in a session of its own, with the requester's environment, working
directory, umask, standard streams, ``sys.argv``, ``sys.path`` (``PYTHONPATH`` included), a fresh
``__main__``, buffering (``-u``, ``$PYTHONUNBUFFERED``) and OpenMP thread count, and ``sys.executable`` is
the requester's executable, so what it starts (torchrun, torchrun's workers) is forked here too. It ends as
an interpreter ends: non-daemon threads joined, ``atexit`` run, streams flushed; a ``SystemExit``, an
uncaught exception or a ``KeyboardInterrupt`` gives the exit status the interpreter would. When the
requester dies (SIGKILL cannot be relayed), the supervisor kills the command's process group.

What it cannot reproduce is refused, and the requester runs the real interpreter instead: a start-up
variable of Python's or of the C library's (``PYTHONWARNINGS``, ``PYTHONHASHSEED``, ``LD_*`` ...) that
differs from the server's (glibc's malloc tunables ``MALLOC_MMAP_THRESHOLD_`` and the like are set with
``mallopt``, as glibc sets them from the environment), another user, another network namespace (each has a server of
its own, started by the first requester in it: ``ip netns exec``). What stays different from a fresh interpreter: modules imported here keep what they read from the
environment at import time, processes share this server's hash seed, and the interpreter is not finalized
at exit (the tests of exit-time behaviour start real interpreters).

Run as ``python tests/forkserver.py SOCKET [--idle-exit SECONDS]``; ``tests/cli_process.py`` starts the
one for the tests' own network namespace.
"""

import json
import os
import select
import signal
import socket
import struct
import sys

STARTUP_VARS = ("PYTHONWARNINGS", "PYTHONHASHSEED", "PYTHONOPTIMIZE", "PYTHONDONTWRITEBYTECODE", "PYTHONSAFEPATH",
                "PYTHONNOUSERSITE", "PYTHONUTF8", "PYTHONIOENCODING", "PYTHONHOME", "PYTHONDEVMODE",
                "PYTHONFAULTHANDLER", "PYTHONMALLOC", "PYTHONINTMAXSTRDIGITS", "PYTHONSTARTUP", "PYTHONVERBOSE",
                "PYTHONINSPECT", "PYTHONNODEBUGRANGES", "PYTHONPLATLIBDIR", "PYTHONTRACEMALLOC")
STARTUP_PREFIXES = ("MALLOC_", "GLIBC_", "LD_")
# glibc's malloc variables that mallopt() sets to the same effect in a running process
MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_TOP_PAD_": -2, "MALLOC_MMAP_THRESHOLD_": -3,
           "MALLOC_MMAP_MAX_": -4, "MALLOC_ARENA_MAX": -8}

# What the processes the tests start import: gradsync's CLI and everything under it, torchrun.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.run", "lightning", "lightning.pytorch", "jsonargparse",
           "yaml", "numpy", "gradsync.cli.main", "gradsync.platform.run", "gradsync.platform.launch",
           "gradsync.platform.trainer_args", "gradsync.recipes", "gradsync.strategies")


def write_shim(folder: str, real_python: str) -> str:
    """The ``python`` that forks from the servers whose sockets are in ``folder``."""
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "forkserver_python.py")) as f:
        source = f.read().replace("@REAL_PYTHON@", real_python).replace("@FORKSERVER@", os.path.abspath(__file__))
    path = os.path.join(folder, "python")
    with open(path + ".tmp", "w") as f:
        f.write(f"#!{real_python} -IS\n{source}")
    os.chmod(path + ".tmp", 0o755)
    os.replace(path + ".tmp", path)
    return path


def _recv_request(conn: socket.socket) -> tuple:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    if len(data) < 4:
        raise ValueError("short request")
    (size,) = struct.unpack("!I", data[:4])
    body = data[4:]
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ValueError("short request")
        body += chunk
    return json.loads(body), fds


def _refusal(req: dict, base_env: dict) -> str:
    env = req["env"]
    startup = set(STARTUP_VARS) | {k for k in (*env, *base_env) if k.startswith(STARTUP_PREFIXES)}
    differ = sorted(k for k in startup if env.get(k) != base_env.get(k)
                    and not (k in MALLOPT and env.get(k, "").isdigit()))
    if differ:
        return "start-up variables differ: " + ", ".join(differ)
    if req["uid"] != os.getuid():
        return "another user"
    if req["netns"] != os.stat("/proc/self/ns/net").st_ino:
        return "another network namespace"
    return ""


def _streams(unbuffered: bool) -> None:
    import io

    enc, errors = sys.stdout.encoding, sys.stdout.errors
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.open(0, "rb", closefd=False), encoding=enc, errors=errors)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        tty = os.isatty(fd)
        raw = io.open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)
        stream = io.TextIOWrapper(raw, encoding=enc, errors="backslashreplace" if fd == 2 else errors,
                                  line_buffering=(fd == 2 or tty) and not unbuffered, write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _exit_status(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _run(req: dict, fds: list, base_env: dict, base_path: list) -> None:
    """The command's own process: never returns."""
    import atexit
    import runpy
    import threading
    import types

    os.setsid()
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(req["cwd"])
    os.umask(req["umask"])
    env = req["env"]
    os.environ.clear()
    os.environ.update(env)
    _streams(req["unbuffered"] or bool(env.get("PYTHONUNBUFFERED")))
    sys.executable = req["executable"]
    tunables = {k: int(env[k]) for k in MALLOPT if env.get(k) != base_env.get(k)}
    if tunables:
        import ctypes

        libc = ctypes.CDLL(None)
        for name, value in tunables.items():
            libc.mallopt(MALLOPT[name], value)
    if env.get("OMP_NUM_THREADS") != base_env.get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0))))
    extra = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    mode, target, args = req["mode"], req["target"], req["args"]
    code = 0
    interrupted = False
    try:
        if mode == "module":
            sys.path[:] = [os.getcwd(), *extra, *base_path]
            sys.argv = ["-m", *args]
            sys.modules.pop(target, None)  # runs as __main__ only, as under `python -m`
            runpy._run_module_as_main(target, alter_argv=True)
        elif mode == "command":
            sys.path[:] = ["", *extra, *base_path]
            sys.argv = ["-c", *args]
            exec(compile(target, "<string>", "exec"), main.__dict__)
        else:
            sys.path[:] = [os.path.dirname(os.path.realpath(target)), *extra, *base_path]
            sys.argv = [target, *args]
            main.__file__ = target
            with open(target, "rb") as f:
                source = f.read()
            exec(compile(source, target, "exec"), main.__dict__)
    except SystemExit as exc:
        code = _exit_status(exc)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        interrupted = True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    except SystemExit as exc:
        code = _exit_status(exc)
    except BaseException:
        code = code or 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        if interrupted:  # as the interpreter does: die of SIGINT
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


def _supervise(conn: socket.socket, req: dict, fds: list, base_env: dict, base_path: list) -> None:
    """Forks the command, tells the requester its pid, reports its exit status; never returns."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        conn.close()
        _run(req, fds, base_env, base_path)
    for fd in fds:
        os.close(fd)
    conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
    done = os.pidfd_open(pid)
    watched = [conn, done]
    while True:
        ready, _, _ = select.select(watched, [], [])
        if done in ready:
            break
        try:
            alive = conn.recv(64)
        except OSError:
            alive = b""
        if not alive:  # the requester died (SIGKILL): so does the command
            watched.remove(conn)
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
    _, status = os.waitpid(pid, 0)
    try:
        conn.sendall((json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n").encode())
    except OSError:
        pass
    os._exit(0)


def serve(sock_path: str, idle_exit: float = 0.0) -> None:
    import fcntl
    import gc
    import importlib

    lock = os.open(sock_path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:  # held while this server lives: a socket file without it is stale
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return  # another server serves this socket
    if os.path.exists(sock_path):
        os.unlink(sock_path)
    base_env = dict(os.environ)
    pythonpath = [p for p in base_env.get("PYTHONPATH", "").split(os.pathsep) if p]
    base_path = [p for p in sys.path[1:] if p not in pythonpath and os.path.abspath(p) not in pythonpath]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(256)  # requests wait in the backlog while the imports run
    for name in PRELOAD:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # what the imports made stays in pages the forks share
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    while True:
        if idle_exit and not select.select([listener], [], [], idle_exit)[0]:
            os.unlink(sock_path)
            return
        conn, _ = listener.accept()
        fds: list = []
        try:
            req, fds = _recv_request(conn)
            why = _refusal(req, base_env) if len(fds) == 3 else "not three standard streams"
        except (OSError, ValueError, KeyError):
            for fd in fds:
                os.close(fd)
            conn.close()
            continue
        if why:
            try:
                conn.sendall((json.dumps({"real": why}) + "\n").encode())
            except OSError:
                pass
        else:
            sys.stdout.flush()
            sys.stderr.flush()
            if os.fork() == 0:
                listener.close()
                os.close(lock)
                _supervise(conn, req, fds, base_env, base_path)
        for fd in fds:
            os.close(fd)
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1], float(sys.argv[3]) if sys.argv[2:3] == ["--idle-exit"] else 0.0)
