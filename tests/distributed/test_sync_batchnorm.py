"""GlobalBatchNorm (``--sync-batchnorm`` on CPU/gloo): N ranks, each with its part of a batch, compute
what one BatchNorm computes on the whole batch: outputs, gradients and running statistics."""

import pytest
import torch

from gradsync.strategies.sync_batchnorm import GlobalBatchNorm, GlobalSyncBatchNorm
from harness import run_gloo

pytestmark = pytest.mark.timeout(120)

TOL = 1e-5  # the same sums in another order (float32)


def batch(dims: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (12, 5) if dims == 2 else (12, 5, 3, 4)
    return torch.randn(*shape, generator=g) * 3 + 1, torch.randn(*shape, generator=g)


def layer(dims: int) -> torch.nn.Module:
    torch.manual_seed(1)
    bn = torch.nn.BatchNorm1d(5) if dims == 2 else torch.nn.BatchNorm2d(5)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    return bn


def two_steps(bn: torch.nn.Module, x: torch.Tensor, w: torch.Tensor) -> dict:
    x = x.clone().requires_grad_(True)
    out = None
    for _ in range(2):
        out = bn(x)
        (out * w).sum().backward()
    return {"out": out.detach(), "x_grad": x.grad, "weight_grad": bn.weight.grad, "bias_grad": bn.bias.grad,
            "running_mean": bn.running_mean, "running_var": bn.running_var}


def part(rank: int, world: int, dims: int) -> dict:
    x, w = batch(dims)
    rows = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
    bn = GlobalSyncBatchNorm().apply(torch.nn.Sequential(layer(dims)))[0]
    assert isinstance(bn, GlobalBatchNorm)
    return two_steps(bn, x[rows], w[rows])


@pytest.mark.parametrize("world, dims", [(2, 2), (3, 4)])
def test_ranks_compute_one_batchnorm_over_the_global_batch(tmp_path, world, dims):
    x, w = batch(dims)
    whole = two_steps(layer(dims), x, w)
    parts = run_gloo(part, world, dims, tmp=tmp_path)
    n = len(x) // world
    for rank, got in enumerate(parts):
        rows = slice(rank * n, (rank + 1) * n)
        assert torch.allclose(got["out"], whole["out"][rows], atol=TOL)
        # the input's gradient is the whole batch's (the statistics' gradient crosses ranks); a parameter's
        # gradient on a rank is its part's share, as DDP then sums (here: all-reduces) them
        assert torch.allclose(got["x_grad"], whole["x_grad"][rows], atol=TOL)
        assert torch.equal(got["running_mean"], parts[0]["running_mean"])  # every rank alike, exactly
        assert torch.allclose(got["running_mean"], whole["running_mean"], atol=TOL)
        assert torch.allclose(got["running_var"], whole["running_var"], atol=TOL)
    assert torch.allclose(sum(p["weight_grad"] for p in parts), whole["weight_grad"], atol=1e-4)
    assert torch.allclose(sum(p["bias_grad"] for p in parts), whole["bias_grad"], atol=1e-4)


def test_revert_gives_back_plain_batchnorm_with_the_trained_state():
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.BatchNorm1d(5))
    plugin = GlobalSyncBatchNorm()
    swapped = plugin.apply(model)
    assert isinstance(swapped[1], GlobalBatchNorm)
    swapped[1].running_mean.fill_(2.0)
    back = plugin.revert(swapped)
    assert not isinstance(back[1], GlobalBatchNorm)
    assert isinstance(back[1], torch.nn.modules.batchnorm._BatchNorm)
    assert torch.equal(back[1].running_mean, torch.full((5,), 2.0))
