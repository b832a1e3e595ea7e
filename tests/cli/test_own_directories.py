"""Two nodes that share no filesystem: each writes to its own --output-dir, resumes from it, and either
one's directory exports the whole model. Two "nodes" of two processes each on this machine, sharded
inside the node (FSDP2, HSDP across), as the sites of a cross-site run are."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import cli_process
from gradsync.cli.export import export
from gradsync.errors import GradsyncError
from harness import free_port

pytestmark = pytest.mark.timeout(300)

JOB = ["fit", "--recipe", "digits", "--strategy", "sync", "--strategy.shard", "node", "--accelerator", "cpu",
       "--devices", "2", "--strategy.timeout_seconds", "120", "--checkpoint-every", "3"]


def _env():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    for var in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(var, None)
    return env


def two_nodes(dirs, max_steps, *extra):
    port = free_port()
    procs = [cli_process.popen([sys.executable, "-m", "gradsync.cli.main", *JOB, "--nnodes", "2", "--node-rank",
                                str(node), "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-steps",
                                str(max_steps), "--output-dir", str(dirs[node]), *extra],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
             for node in (0, 1)]
    try:
        logs = [p.communicate(timeout=200)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [p.returncode for p in procs], logs


def shard_folders(run_dir):
    ranks = run_dir / "checkpoints" / "last.ckpt.ranks"
    return sorted(f"{p.parent.name.split('-')[0]}/{p.name}" for p in ranks.glob("shards-*/node*"))


def test_nodes_with_their_own_directories_resume_and_export(tmp_path):
    dirs = [tmp_path / "site0", tmp_path / "site1"]
    codes, logs = two_nodes(dirs, 6)
    assert codes == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    # each site holds a manifest and a whole replica of its own, and only its own; older folders are gone
    for node, run_dir in enumerate(dirs):
        assert (run_dir / "checkpoints" / "last.ckpt").is_file()
        assert shard_folders(run_dir) == [f"shards/node{node}"], shard_folders(run_dir)
    # either site's directory exports the whole model, the same one (replicas are equal under sync)
    _, model0 = export(str(dirs[0]))
    _, model1 = export(str(dirs[1]))
    assert model0.keys() == model1.keys() and all(torch.equal(model0[k], model1[k]) for k in model0)
    # a site whose replica was not completely written: one line naming what is missing
    broken = tmp_path / "broken"
    shutil.copytree(dirs[1], broken)
    next((broken / "checkpoints" / "last.ckpt.ranks").glob("shards-*/node1/.metadata")).unlink()
    with pytest.raises(GradsyncError, match=r"no complete replica under .* \(node1, none with its .metadata\)"):
        export(str(broken))

    # each site resumes from its own directory
    codes, logs = two_nodes(dirs, 10, "--resume", "auto")
    assert codes == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    summary = json.loads((dirs[0] / "summary.json").read_text())
    assert summary["resumed_from_step"] == 6 and summary["global_step"] == 10 and summary["params_agree"] is True
    resumed = export(str(dirs[1]))[1]

    # == the same 10 steps uninterrupted (the two nodes played by one launcher's four processes)
    whole = tmp_path / "whole"
    r = cli_process.run([sys.executable, "-m", "gradsync.cli.main", *JOB[:-2], "--devices", "4",
                         "--strategy.procs_per_node", "2", "--max-steps", "10", "--output-dir", str(whole)],
                        capture_output=True, text=True, timeout=200, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    uninterrupted = export(str(whole))[1]
    diff = max((resumed[k] - uninterrupted[k]).abs().max().item() for k in uninterrupted)
    assert diff <= 1e-6, diff
    assert max((resumed[k] - model1[k]).abs().max().item() for k in model1) > 1e-4  # the resumed run moved on

    # a site that lost its checkpoint cannot silently start over while the other resumes
    shutil.rmtree(dirs[1] / "checkpoints")
    codes, logs = two_nodes(dirs, 12, "--resume", "auto")
    assert codes[0] != 0 and codes[1] != 0
    line = [x for x in logs[0].splitlines() if x.startswith("gradsync: error:")][-1]
    assert "--resume: the processes would resume from different checkpoints (rank 0 from step 10" in line, line
    assert "rank 2 from no checkpoint" in line, line
