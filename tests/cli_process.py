"""``gradsync`` commands for the tests, at the cost of the command rather than of Python's start-up.

Every ``python -m gradsync.cli.main fit ...`` a test runs spends ~5-8 s on this kind of machine importing
torch, Lightning, torchmetrics (which imports transformers and scipy) and jsonargparse before the
command does anything, and the suite runs dozens. :func:`run` is :func:`subprocess.run` with one
difference: such a command is forked from a *template* process that imported all of that once. The child
is a new process (its own session, environment, working directory, ``sys.path`` from ``PYTHONPATH``,
standard streams) that calls the same ``gradsync.cli.main.main`` the console script calls, and the
launcher's workers are started by torchrun as real, fresh interpreters. The template has run nothing but
imports (no threads, no torch work), so forking it is safe.

Anything the template cannot reproduce falls back to a real ``subprocess.run``: another interpreter or
module, ``input=``, or a start-up variable of Python's (``PYTHONWARNINGS``, ``PYTHONHASHSEED`` ...) that
differs from the template's. Timeouts kill the command's whole process group.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any, Optional, Sequence

_PREFIX = [sys.executable, "-m", "gradsync.cli.main"]

# Read by the interpreter at start-up, so a child of the template cannot change them (nor can it change
# the C library's and the dynamic loader's: MALLOC_*, GLIBC_*, LD_*).
_STARTUP_VARS = ("PYTHONWARNINGS", "PYTHONHASHSEED", "PYTHONOPTIMIZE", "PYTHONDONTWRITEBYTECODE", "PYTHONSAFEPATH",
                 "PYTHONNOUSERSITE", "PYTHONUTF8", "PYTHONIOENCODING", "PYTHONUNBUFFERED", "PYTHONHOME",
                 "PYTHONDEVMODE", "PYTHONFAULTHANDLER", "PYTHONMALLOC", "PYTHONINTMAXSTRDIGITS")

_TEMPLATE = r"""
import json, os, sys
requests = os.fdopen(int(sys.argv[1]), "r")
replies = os.fdopen(int(sys.argv[2]), "w", buffering=1)
base_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]

import atexit, jsonargparse, lightning, torch, yaml
import gradsync.cli.main as cli
import gradsync.platform.run, gradsync.platform.launch, gradsync.platform.trainer_args, gradsync.recipes

def child(req):
    os.setsid()
    requests.close(); replies.close()
    os.chdir(req["cwd"])
    os.environ.clear(); os.environ.update(req["env"])
    extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.getcwd(), *extra, *base_path]   # as `python -m` in that directory sets it
    sys.argv = [cli.__file__, *req["argv"]]
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["stdout"], os.O_WRONLY),
                            (2, req["stderr"], os.O_WRONLY)):
        f = os.open(path, flags); os.dup2(f, fd); os.close(f)
    code = 1
    try:
        code = cli.main(req["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback; traceback.print_exc()
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code or 0)

for line in requests:
    req = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        child(req)
    replies.write(json.dumps({"pid": pid}) + "\n")
    _, status = os.waitpid(pid, 0)
    replies.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")
"""


class _Template:
    def __init__(self) -> None:
        req_r, self._req_w = os.pipe()
        self._rep_r, rep_w = os.pipe()
        self.env = dict(os.environ)
        self.proc = subprocess.Popen([sys.executable, "-c", _TEMPLATE, str(req_r), str(rep_w)], pass_fds=(req_r, rep_w),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=self.env,
                                     start_new_session=True)
        os.close(req_r)
        os.close(rep_w)
        self._buf = b""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _reply(self, timeout: Optional[float]) -> Optional[dict]:
        while b"\n" not in self._buf:
            ready, _, _ = select.select([self._rep_r], [], [], timeout)
            if not ready:
                return None
            chunk = os.read(self._rep_r, 4096)
            if not chunk:
                raise RuntimeError("the gradsync template process died")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def run(self, argv: Sequence[str], env: dict, cwd: str, stdout: str, stderr: str, timeout: Optional[float]) -> int:
        os.write(self._req_w, (json.dumps({"argv": list(argv), "env": env, "cwd": cwd, "stdout": stdout,
                                           "stderr": stderr}) + "\n").encode())
        pid = self._reply(None)["pid"]
        done = self._reply(timeout)
        if done is None:  # SIGTERM first: torchrun stops its workers (each in a session of its own) on it
            for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, None)):
                try:
                    os.killpg(pid, sig)
                except ProcessLookupError:
                    pass
                if self._reply(wait) is not None:
                    break
            raise subprocess.TimeoutExpired(argv, timeout)
        return done["code"]

    def close(self) -> None:
        if self.alive():
            os.close(self._req_w)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


_template: Optional[_Template] = None
_lock = threading.Lock()


def _get_template() -> _Template:
    global _template
    if _template is None or not _template.alive():
        _template = _Template()
        atexit.register(_template.close)
    return _template


def _forkable(cmd: Sequence[str], env: dict, kwargs: dict) -> bool:
    if list(cmd[:3]) != _PREFIX or kwargs.get("input") is not None or os.environ.get("GRADSYNC_TESTS_NO_TEMPLATE"):
        return False
    base = _template.env if _template is not None and _template.alive() else os.environ
    startup = set(_STARTUP_VARS) | {k for k in (*env, *base) if k.startswith(("MALLOC_", "GLIBC_", "LD_"))}
    return all(env.get(k) == base.get(k) for k in startup)


def run(cmd: Sequence[str], *, env: Optional[dict] = None, cwd: Any = None, timeout: Optional[float] = None,
        capture_output: bool = False, text: bool = False, check: bool = False,
        **kwargs: Any) -> subprocess.CompletedProcess:
    """:func:`subprocess.run` of ``cmd``; a ``gradsync`` command is forked from the template (see above).
    A forked command's output is always captured."""
    cmd = [str(c) for c in cmd]
    env = dict(os.environ if env is None else env)
    if not _forkable(cmd, env, kwargs):
        return subprocess.run(cmd, env=env, cwd=cwd, timeout=timeout, capture_output=capture_output, text=text,
                              check=check, **kwargs)
    with _lock, tempfile.TemporaryDirectory(prefix="gradsync-cli-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        open(out, "w").close()
        open(err, "w").close()
        code = _get_template().run(cmd[3:], env, os.path.abspath(cwd or os.getcwd()), out, err, timeout)
        mode = "r" if text else "rb"
        with open(out, mode) as f_out, open(err, mode) as f_err:
            stdout, stderr = f_out.read(), f_err.read()
    result = subprocess.CompletedProcess(cmd, code, stdout, stderr)
    if check:
        result.check_returncode()
    return result
