"""``gradsync`` processes for the tests, at the cost of a fork rather than of Python's start-up.

:func:`python` is an executable that behaves like ``python`` and forks the command from the tests' fork
server (``tests/forkserver.py``), which imported torch, Lightning and gradsync once; the processes the
command starts (torchrun, its workers) get the same executable, so a whole ``gradsync fit`` under
torchrun pays no imports. :func:`run` and :func:`popen` are :func:`subprocess.run` and
:class:`subprocess.Popen` with ``sys.executable`` at the head of the command replaced by it; a command the
server cannot reproduce (see there) runs the real interpreter, and ``$GRADSYNC_TESTS_NO_FORKSERVER=1``
turns the whole thing off. A timeout sends SIGTERM to the command's process group (torchrun stops its
workers on it), then SIGKILL.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional, Sequence

import forkserver
import forkserver_python

_lock = threading.Lock()
_server: Optional[subprocess.Popen] = None
_python: Optional[str] = None
_folder: Optional[str] = None
_ENV = dict(os.environ)  # the server's: as the test session started, not as some test left it


def _start() -> None:
    """The server for this network namespace (requesters in others start theirs), and the ``python``."""
    global _server, _python, _folder
    _folder = tempfile.mkdtemp(prefix="gradsync-forkserver-")
    sock = forkserver_python.socket_path(_folder)
    _server = subprocess.Popen([sys.executable, forkserver.__file__, sock], stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, env=_ENV, start_new_session=True)
    _python = forkserver.write_shim(_folder, sys.executable)
    deadline = time.monotonic() + 30
    while not os.path.exists(sock):  # it binds before it imports: requests wait in its backlog
        if _server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the tests' fork server did not start")
        time.sleep(0.01)
    atexit.register(_stop, _server, _folder)


def _stop(server: subprocess.Popen, folder: str) -> None:
    server.terminate()
    try:
        server.wait(10)
    except subprocess.TimeoutExpired:
        server.kill()
    shutil.rmtree(folder, ignore_errors=True)


def python() -> str:
    """The forking ``python`` (the real one when the fork server is turned off)."""
    if os.environ.get("GRADSYNC_TESTS_NO_FORKSERVER"):
        return sys.executable
    with _lock:
        if _server is None or _server.poll() is not None:
            _start()
    return _python


def _command(cmd: Sequence[Any], env: Optional[dict]) -> tuple[list[str], dict]:
    cmd = [str(c) for c in cmd]
    env = dict(os.environ if env is None else env)
    exe = python()
    if cmd and cmd[0] == sys.executable and exe != sys.executable:
        cmd[0] = exe
        env["GRADSYNC_FORKSERVER"] = _folder
    return cmd, env


def use_for_sys_executable(monkeypatch: Any) -> None:
    """For code under test that starts ``sys.executable`` itself (the benchmarks): for this test, that is
    the forking ``python``."""
    exe = python()
    if exe != sys.executable:
        monkeypatch.setenv("GRADSYNC_FORKSERVER", _folder)
        monkeypatch.setattr(sys, "executable", exe)


def popen(cmd: Sequence[Any], *, env: Optional[dict] = None, **kwargs: Any) -> subprocess.Popen:
    """:class:`subprocess.Popen`, forked from the server when ``cmd`` starts with ``sys.executable``."""
    cmd, env = _command(cmd, env)
    return subprocess.Popen(cmd, env=env, **kwargs)


def stop(proc: subprocess.Popen, wait: float = 10.0) -> None:
    """SIGTERM to ``proc``'s process group, SIGKILL after ``wait`` seconds."""
    for sig, timeout in ((signal.SIGTERM, wait), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout)
            return
        except subprocess.TimeoutExpired:
            continue


def run(cmd: Sequence[Any], *, env: Optional[dict] = None, cwd: Any = None, timeout: Optional[float] = None,
        capture_output: bool = False, text: bool = False, check: bool = False, input: Any = None,
        **kwargs: Any) -> subprocess.CompletedProcess:
    """:func:`subprocess.run`, forked from the server when ``cmd`` starts with ``sys.executable``; the
    command runs in a session of its own, and a timeout stops its whole process group."""
    cmd, env = _command(cmd, env)
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with subprocess.Popen(cmd, env=env, cwd=cwd, text=text, start_new_session=True, **kwargs) as proc:
        try:
            stdout, stderr = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(proc)
            proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout) from None
        except BaseException:
            stop(proc, 1.0)
            raise
    result = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if check:
        result.check_returncode()
    return result
