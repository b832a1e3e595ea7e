"""Multi-node launch: two nodes on one machine, SLURM variable mapping, copy-paste launch commands."""

import json
import os
import subprocess
import sys

import cli_process
import pytest

from gradsync.cli.main import main
from gradsync.platform.launch import LaunchConfig, first_host, inside_launcher, slurm_task, torchrun_args
from harness import free_port


def test_two_nodes_on_localhost_train_and_agree(tmp_path):
    port = free_port()
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(var, None)
    procs = [cli_process.popen(
        [sys.executable, "-m", "gradsync.cli.main", "fit", "--recipe", "digits", "--strategy", "sync",
         "--accelerator", "cpu", "--devices", "1", "--nnodes", "2", "--node-rank", str(rank),
         "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-steps", "10",
         "--strategy.timeout_seconds", "120", "--output-dir", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for rank in (0, 1)]
    try:
        logs = [p.communicate(timeout=200)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["num_nodes"] == 2
    assert summary["global_step"] == 10 and summary["params_agree"] is True
    assert "[node 1] step 10/10" in logs[1], logs[1][-2000:]  # every node shows that it trains
    assert "[node 1]" not in logs[0] and "step 10/10" in logs[0]


SLURM_ENV = {
    "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "8",
    "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "4", "SLURM_PROCID": "6", "SLURM_LOCALID": "2",
    "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]",
}


def test_slurm_variables_map_to_ranks_and_address():
    task = slurm_task(SLURM_ENV)
    assert (task.rank, task.local_rank, task.world_size, task.local_world_size) == (6, 2, 8, 4)
    assert (task.node_rank, task.num_nodes) == (1, 2)
    assert task.master_addr == "gpu07"
    assert task.master_port == 15000 + 4242  # derived from the job id: every task agrees without talking
    assert slurm_task({**SLURM_ENV, "MASTER_PORT": "23456"}).master_port == 23456
    assert slurm_task(SLURM_ENV, master_port=30000).master_port == 30000   # flag > environment
    assert inside_launcher(SLURM_ENV)
    assert not inside_launcher({k: v for k, v in SLURM_ENV.items() if k != "SLURM_STEP_ID"})  # sbatch script


def test_a_step_on_part_of_the_allocation_takes_its_own_nodes_and_tasks():
    """A replica group's step (``srun --nodes=1 --ntasks=2`` inside a three-node allocation): its rendezvous is
    on its own first node, with its own two tasks."""
    step = {**SLURM_ENV, "SLURM_JOB_NUM_NODES": "3", "SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_NTASKS_PER_NODE": "4",
            "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": "gpu09",
            "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0"}
    task = slurm_task(step)
    assert (task.rank, task.local_rank, task.world_size, task.local_world_size) == (1, 1, 2, 2)
    assert (task.node_rank, task.num_nodes, task.master_addr) == (0, 1, "gpu09")


@pytest.mark.parametrize("nodelist, host", [("gpu[07-08]", "gpu07"), ("node1,node2", "node1"),
                                            ("a[3,5-9],b1", "a3"), ("single", "single")])
def test_first_host_of_nodelist(nodelist, host):
    assert first_host(nodelist) == host


def test_launch_precedence_flag_env_default():
    env = {"MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "1234", "NODE_RANK": "1"}
    assert LaunchConfig(nnodes=2).resolved(env).master_addr == "10.1.1.1"
    assert LaunchConfig(nnodes=2, master_addr="10.9.9.9").resolved(env).master_addr == "10.9.9.9"
    cfg = LaunchConfig(nnodes=2).resolved({})
    assert (cfg.master_addr, cfg.master_port, cfg.node_rank) == ("127.0.0.1", 29500, 0)
    assert LaunchConfig(nnodes=2).resolved(env).node_rank == 1
    args = torchrun_args(LaunchConfig(nnodes=2, nproc_per_node=4, rdzv_backend="c10d").resolved({}))
    assert args[args.index("--rdzv-endpoint") + 1] == "127.0.0.1:29500" and "--node-rank" not in args


def test_print_launch_gives_per_node_torchrun_and_sbatch(capsys, monkeypatch):
    for var in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):  # other tests' processes may have set them
        monkeypatch.delenv(var, raising=False)
    assert main(["fit", "--recipe", "digits", "--devices", "4", "--nnodes", "2", "--master-addr", "10.0.0.1",
                 "--max-steps", "100", "--print-launch"]) == 0
    out = capsys.readouterr().out
    assert "--node-rank 0 --master-addr 10.0.0.1 --master-port 29500" in out
    assert "--node-rank 1 --master-addr 10.0.0.1" in out
    assert "#SBATCH --nodes=2" in out and "#SBATCH --ntasks-per-node=4" in out
    srun = [line for line in out.splitlines() if line.startswith("srun ")][0]
    assert "--master-addr" not in srun and "--print-launch" not in srun and "--max-steps 100" in srun


def test_several_nodes_without_a_master_address_are_warned_in_one_line(capsys, monkeypatch):
    for var in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert main(["fit", "--recipe", "digits", "--nnodes", "2", "--print-launch"]) == 0
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("gradsync: warning: --nnodes 2 without --master-addr"), err
    assert main(["fit", "--recipe", "digits", "--nnodes", "2", "--master-addr", "10.0.0.1", "--print-launch"]) == 0
    assert capsys.readouterr().err == ""


def test_a_node_whose_node_zero_never_comes_fails_in_one_line(capsys, monkeypatch):
    for var in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        monkeypatch.delenv(var, raising=False)
    port = free_port()
    assert main(["fit", "--recipe", "digits", "--accelerator", "cpu", "--nnodes", "2", "--node-rank", "1",
                 "--master-addr", "127.0.0.1", "--master-port", str(port), "--timeout", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"node 0 did not answer at 127.0.0.1:{port} within 2 s" in err, err


def test_torchrun_output_holds_back_only_a_rendezvous_timeout_traceback():
    import io

    from gradsync.platform.launch import TorchrunOutput

    worker = ["Traceback (most recent call last):\n", '  File "train.py", line 3, in <module>\n',
              "    main()\n", "ValueError: bad batch\n"]
    agent = ["Traceback (most recent call last):\n", '  File "run.py", line 9, in _rendezvous\n',
             "    store.wait()\n", "\n", "During handling of the above exception, another exception occurred:\n",
             "\n", "Traceback (most recent call last):\n", '  File "run.py", line 12, in main\n',
             "torch.distributed.DistStoreError: Timed out after 9 seconds waiting for clients. 1/2 clients joined.\n"]
    sink = io.StringIO()
    out = TorchrunOutput(sink)
    for line in ["step 1\n", *worker, "W1204 a log line\n", *agent, "after\n"]:
        out.feed(line)
    out.close()
    assert sink.getvalue() == "".join(["step 1\n", *worker, "W1204 a log line\n", "after\n"])
    assert out.rendezvous_timeout == agent[-1].strip()
    cut = TorchrunOutput(sink := io.StringIO())  # a traceback cut short by the process dying is not lost
    for line in worker[:2]:
        cut.feed(line)
    cut.close()
    assert sink.getvalue() == "".join(worker[:2]) and cut.rendezvous_timeout is None


def test_torchrun_output_shows_a_worker_user_error_once_and_drops_torchruns_report():
    import io

    from gradsync.platform.launch import TorchrunOutput

    report = ["E1205 08:51:52 api.py:1002] failed (exitcode: 2) local_rank: 0\n",
              "Traceback (most recent call last):\n", '  File "run.py", line 9, in main\n',
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n", "=====\n"]
    sink = io.StringIO()
    out = TorchrunOutput(sink)
    for line in ["step 1\n", "gradsync: error: set --strategy.x true\n", "[rank1]:gradsync: error: set "
                 "--strategy.x true\n", *report]:
        out.feed(line)
    out.close()
    assert sink.getvalue() == "step 1\ngradsync: error: set --strategy.x true\n"
    assert out.worker_error == "set --strategy.x true" and out.only_user_error
    # a worker that died otherwise (exit status 17) keeps torchrun's report, which names it
    died = ["E1205 api.py:1002] failed (exitcode: 17) local_rank: 2\n", "  exitcode  : 17 (pid: 9)\n"]
    out = TorchrunOutput(sink := io.StringIO())
    for line in ["gradsync: error: lost contact with rank 2\n", "[rank1]:gradsync: error: lost contact with rank 2\n",
                 *died]:
        out.feed(line)
    out.close()
    assert sink.getvalue() == "gradsync: error: lost contact with rank 2\n" + "".join(died)
    assert not out.only_user_error
    # two ranks' copies run together on one line (they share torchrun's stderr): shown once, whole
    for lines in (["gradsync: error: set --strategy.x truegradsync: error: set --strategy.x true\n", "\n"],
                  ["gradsync: error: set --strat[rank1]:gradsync: error: set --strategy.x true\n", "egy.x true\n"]):
        out = TorchrunOutput(sink := io.StringIO())
        for line in [*lines, *report]:
            out.feed(line)
        out.close()
        assert sink.getvalue() == "gradsync: error: set --strategy.x true\n" and out.only_user_error
    # under --max-restarts the next attempt is streamed, not held
    out = TorchrunOutput(sink := io.StringIO())
    for line in ["gradsync: error: lost contact\n", "W api.py] Worker group FAILED. 2/3 attempts left; will restart "
                 "worker group\n", "step 1\n"]:
        out.feed(line)
    assert sink.getvalue().endswith("will restart worker group\nstep 1\n") and out.worker_error is None


def test_a_worker_takes_the_run_its_launcher_parsed(tmp_path, capsys, monkeypatch):
    # One pass: the launcher parses the flags, resolves recipe and strategy, and hands the run to its
    # workers; a worker started with the same arguments takes it instead of parsing them again.
    from gradsync.cli.main import parse_run
    from gradsync.platform.launch import SPEC_ENV, hand_over, handed_over

    for var in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        monkeypatch.delenv(var, raising=False)
    argv = ["--recipe", "digits", "--devices", "2", "--max-steps", "5", "--print-launch"]
    spec = parse_run("fit", argv)
    spec.launch.nproc_per_node = 7  # a mark no parse of argv could make
    env = hand_over(spec, ["fit", *argv], tmp_path)
    assert handed_over(["fit", *argv], env) is None  # not started by a launcher: parse here
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert handed_over(["fit", *argv[:-1]], env) is None  # other arguments: not this run
    monkeypatch.setenv(SPEC_ENV, env[SPEC_ENV])
    assert main(["fit", *argv]) == 0
    assert "1 node(s) x 7 process(es)" in capsys.readouterr().out  # the handed-over run, not a new parse
    monkeypatch.setenv(SPEC_ENV, str(tmp_path / "gone.pkl"))
    assert main(["fit", *argv]) == 0
    assert "1 node(s) x 2 process(es)" in capsys.readouterr().out  # no file: the worker parses itself


def test_what_the_launcher_hands_over_is_what_a_worker_would_parse(tmp_path):
    # validation in the launcher must not change the run it hands over (jsonargparse rewrote a
    # --callbacks+ value in place, and workers got a config where a callback belonged)
    import pickle

    from gradsync.cli.main import parse_run, validate_spec

    argv = ["--recipe", "digits", "--devices", "2", "--callbacks+", "lightning.pytorch.callbacks.LearningRateMonitor",
            "--gradient-clip-val", "0.5", "--strategy", "compressed", "--strategy.codec", "topk"]
    spec = parse_run("fit", argv)
    validate_spec(spec)
    assert pickle.loads(pickle.dumps(spec)) == parse_run("fit", argv)
