"""`gradsync doctor`: versions, environment without secrets, a real all-reduce across the group."""

import os
import sys

import cli_process
import pytest
import torch

from gradsync.cli.doctor import relevant_environment


def test_environment_is_relevant_and_redacted():
    env = {"NCCL_IB_HCA": "mlx5_0", "NCCL_SOCKET_IFNAME": "ib0", "WANDB_API_KEY": "s3cr3t", "HF_TOKEN": "t0k3n",
           "MASTER_ADDR": "10.0.0.1", "HOME": "/root", "SLURM_PROCID": "3"}
    out = relevant_environment(env)
    assert out["NCCL_IB_HCA"] == "mlx5_0" and out["MASTER_ADDR"] == "10.0.0.1" and out["SLURM_PROCID"] == "3"
    assert out["WANDB_API_KEY"] == "<redacted>"
    assert "HF_TOKEN" not in out and "HOME" not in out
    assert "s3cr3t" not in repr(out)


@pytest.mark.timeout(120)
def test_doctor_checks_an_allreduce_across_two_processes():
    """Two processes check gloo here, and on a 1-GPU machine too (auto: NCCL only when each local
    process has a GPU of its own); tests/gpu checks NCCL where there is a GPU."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_API_KEY": "s3cr3t-doctor", "NCCL_DEBUG": "WARN"}
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    r = cli_process.run([sys.executable, "-m", "gradsync.cli.main", "doctor", "--devices", "2", "--size-mb", "1"],
                       capture_output=True, text=True, timeout=100, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "torch       2." in r.stdout and "NCCL_DEBUG=WARN" in r.stdout
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    assert f"all-reduce  2 process(es), backend {backend}: sum correct" in r.stdout
    assert "s3cr3t-doctor" not in r.stdout + r.stderr
