"""gradsync against the reference implementations it claims to equal, at matched settings.

``local_sgd`` against torch's own post-local SGD: DDP with ``post_localSGD_hook`` (synchronous
gradients for the first W steps, local ones after) and ``PeriodicModelAverager`` after every
optimizer step, on the batches each gradsync rank trained on, from the same initial model.

The averager averages at its calls number ``warmup_steps``, ``warmup_steps + period``, ... — so with
the warm-up W of its documentation (``warmup_steps == start_localSGD_iter``) its first average
follows optimizer step W + 1, H - 1 steps before gradsync's (after step W + H, a full period of
local steps). The matched setting is the averager's ``warmup_steps = W + H - 1``
(docs/strategies/local-sgd.md).
"""

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from gradsync.recipes import DigitsClassifier, DigitsData
from gradsync.strategies import LocalSGDStrategy
from harness import fit, max_abs_diff, run_gloo

pytestmark = pytest.mark.timeout(120)


def model():
    L.seed_everything(0, verbose=False)
    return DigitsClassifier(lr=0.1, momentum=0.9)


class RecordBatches(Callback):
    """The batches this rank trained on, in order."""

    def __init__(self, out):
        self.out, self.batches = Path(out), []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append([t.clone() for t in batch])

    def on_train_end(self, trainer, pl_module):
        torch.save(self.batches, self.out / f"batches{trainer.global_rank}.pt")


def torch_post_local_sgd(rank, world, batches, start, period, warmup, averager_warmup):
    """torch's post-local SGD on ``batches[rank]``: DDP + post_localSGD_hook + PeriodicModelAverager."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
        PostLocalSGDState, post_localSGD_hook,
    )
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.nn.parallel import DistributedDataParallel

    net = DigitsClassifier(lr=0.1, momentum=0.9)
    net.load_state_dict(start)
    ddp = DistributedDataParallel(net)
    # a subgroup of one rank each: after the warm-up every rank keeps its own gradient
    alone, _ = dist.new_subgroups(group_size=1)
    ddp.register_comm_hook(PostLocalSGDState(process_group=None, subgroup=alone, start_localSGD_iter=warmup),
                           post_localSGD_hook)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    averager = PeriodicModelAverager(period=period, warmup_steps=averager_warmup)
    for x, y in batches[rank]:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        averager.average_parameters(net.parameters())
    assert dist.get_world_size() == world
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("period, warmup", [(4, 0), (3, 2)])
def test_local_sgd_equals_torch_post_local_sgd(tmp_path, period, warmup):
    steps = 4 * period + warmup  # ends on a round: the end of fit adds none
    start = model().state_dict()
    ranks = fit(model(), DigitsData(batch_size=16), strategy=LocalSGDStrategy(period=period, warmup_steps=warmup),
                devices=2, max_steps=steps, out=tmp_path / "gradsync", callbacks=(RecordBatches(tmp_path),))
    batches = [torch.load(tmp_path / f"batches{r}.pt") for r in (0, 1)]
    assert len(batches[0]) == steps and not torch.equal(batches[0][0][0], batches[1][0][0])
    matched = run_gloo(torch_post_local_sgd, 2, batches, start, period, warmup, warmup + period - 1, tmp=tmp_path)
    for r in (0, 1):
        diff = max_abs_diff(ranks[r]["params"], matched[r])
        assert diff <= 1e-6, f"rank {r}: gradsync local_sgd differs from torch's post-local SGD by {diff}"
    assert max_abs_diff(matched[0], start) > 1e-3  # it trained
    # the averager's documented warm-up (equal to start_localSGD_iter) averages H - 1 steps earlier
    documented = run_gloo(torch_post_local_sgd, 2, batches, start, period, warmup, warmup, tmp=tmp_path)
    assert max_abs_diff(ranks[0]["params"], documented[0]) > 1e-4
