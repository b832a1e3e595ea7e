"""The tests' fork server (tests/forkserver.py) runs a command as the interpreter would, or not at all.

Every forked command below first prints whether Lightning is already imported: only a fork of the server
has it before the command ran, so each test also shows which path the command took.
"""

import os
import signal
import subprocess
import sys
import time

import cli_process
import pytest

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(bool(os.environ.get("GRADSYNC_TESTS_NO_FORKSERVER")), reason="the fork server is off")]

FORKED = "import sys; print('forked' if 'lightning' in sys.modules else 'fresh', flush=True)\n"


def _py(*args, **kwargs):
    return cli_process.run([sys.executable, *args], capture_output=True, text=True, timeout=120, **kwargs)


def test_a_command_gets_its_arguments_environment_directory_streams_and_exit_status(tmp_path):
    code = FORKED + ("import os, sys\nprint(os.getcwd(), os.environ['FORK_PROBE'], sys.argv, sys.path[0] == '')\n"
                     "print('to stderr', file=sys.stderr)\nsys.exit(3)")
    r = _py("-c", code, "a b", "c", env={**os.environ, "FORK_PROBE": "seen"}, cwd=tmp_path)
    assert r.returncode == 3, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "forked"
    assert lines[1] == f"{tmp_path} seen ['-c', 'a b', 'c'] True"
    assert r.stderr == "to stderr\n"


def test_modules_and_scripts_run_as_main_with_their_own_path(tmp_path):
    (tmp_path / "probe_module.py").write_text(FORKED + "import sys\nprint(__name__, sys.argv[1:], sys.path[0])\n")
    r = _py("-m", "probe_module", "x", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.splitlines() == ["forked", f"__main__ ['x'] {tmp_path}"], r.stderr
    folder = tmp_path / "scripts"
    folder.mkdir()
    script = folder / "probe_script.py"
    script.write_text(FORKED + "import sys\nprint(__name__, __file__, sys.argv, sys.path[0])\n")
    r = _py(str(script), "y")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["forked", f"__main__ {script} {[str(script), 'y']} {folder}"]


def test_an_uncaught_exception_or_a_signal_ends_the_command_as_it_ends_the_interpreter():
    r = _py("-c", FORKED + "raise ValueError('boom')")
    assert r.returncode == 1 and r.stdout == "forked\n"
    assert "Traceback" in r.stderr and r.stderr.rstrip().endswith("ValueError: boom")
    r = _py("-c", FORKED + "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert r.returncode == -signal.SIGKILL and r.stdout == "forked\n"
    r = _py("-c", FORKED + "raise KeyboardInterrupt")
    assert r.returncode == -signal.SIGINT


def test_signals_reach_the_command_and_a_killed_requester_takes_it_along():
    code = FORKED + ("import os, signal, sys, time\n"
                     "signal.signal(signal.SIGTERM, lambda *a: (print('terminated', flush=True), sys.exit(7)))\n"
                     "print(os.getpid(), flush=True)\ntime.sleep(100)")
    proc = cli_process.popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "forked\n"
    proc.stdout.readline()
    proc.send_signal(signal.SIGTERM)  # to the requester, as torchrun signals its workers
    assert proc.wait(30) == 7 and proc.stdout.read() == "terminated\n"

    proc = cli_process.popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "forked\n"
    pid = int(proc.stdout.readline())
    proc.kill()  # SIGKILL cannot be relayed: the server's supervisor ends the command instead
    proc.wait(30)
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}")


def test_what_a_fork_cannot_reproduce_runs_the_real_interpreter():
    show = "import sys; print('forked' if 'lightning' in sys.modules else 'fresh')"
    assert _py("-X", "dev", "-c", show).stdout == "fresh\n"  # an interpreter option
    assert _py("-c", show, env={**os.environ, "PYTHONHASHSEED": "123"}).stdout == "fresh\n"  # a start-up variable
    # glibc's malloc tunables are set with mallopt in the fork; -u is unbuffered output there too
    tuned = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"}
    r = _py("-u", "-c", show + "\nimport sys, os; sys.stdout.write('unflushed'); os._exit(0)", env=tuned)
    assert r.stdout == "forked\nunflushed"
