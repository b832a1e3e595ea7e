"""What a healing replica group receives and takes over, under each strategy a group runs: the module, the
inner optimizer's state, the scheduler's, the algorithm's shared state and the step counters. A group that
takes a donor's state at step 6 must then train exactly as the donor goes on to (same batches every step);
and the heal's byte count is every tensor of that state, those inside lists too.

The state crosses here through a file instead of torchft's transport (which the CLI kill tests drive):
what is tested is what the strategy hands over and what it loads.
"""

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset
from torch.utils._pytree import tree_leaves

from gradsync.comm.managed import Telemetry, _tensor_bytes
from gradsync.recipes import DigitsClassifier
from gradsync.strategies import DiLoCoStrategy, LocalSGDStrategy, SyncStrategy
from harness import fit, max_abs_diff

pytestmark = pytest.mark.timeout(120)

HEAL_AT, STEPS = 6, 11


class SameBatchEveryStep(L.LightningDataModule):
    """Each rank sees one fixed batch of its own at every step, so a group that heals at step 6 from
    batch 0 on sees what the donor sees from batch 6 on."""

    def train_dataloader(self):
        from sklearn.datasets import load_digits

        import torch.distributed as dist

        x, y = load_digits(return_X_y=True)
        rank = dist.get_rank() if dist.is_initialized() else 0
        rows = slice(16 * rank, 16 * rank + 16 - 4 * rank)  # ranks of different batch sizes
        x = torch.tensor(x[rows], dtype=torch.float32).reshape(-1, 1, 8, 8) / 16
        batch = (x, torch.tensor(y[rows]))
        return DataLoader(TensorDataset(*(t.repeat(STEPS, *[1] * (t.dim() - 1)) for t in batch)),
                          batch_size=len(batch[0]))


class GiveState(Callback):
    def __init__(self, folder) -> None:
        self.folder = folder

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == HEAL_AT:
            state = trainer.strategy._heal_state()
            torch.save(state, self.folder / f"state{trainer.global_rank}.pt")


class TakeState(Callback):
    def __init__(self, folder) -> None:
        self.folder = folder

    def on_train_start(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        state = torch.load(self.folder / f"state{trainer.global_rank}.pt", weights_only=False)
        strategy.replicas = SimpleNamespace(telemetry=Telemetry())  # (counts steps healed over)
        try:
            strategy._heal(state)
        finally:
            strategy.replicas = None
        trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed = HEAL_AT


def model(seed: int):
    L.seed_everything(seed, verbose=False)
    return DigitsClassifier(optimizer="adamw", lr=0.01, scheduler="cosine", warmup_steps=2, decay_steps=STEPS)


@pytest.mark.parametrize("make", [SyncStrategy, lambda: DiLoCoStrategy(period=4),
                                  lambda: LocalSGDStrategy(period=4)], ids=["sync", "diloco", "local_sgd"])
def test_a_healed_group_trains_as_its_donor(tmp_path, make):
    donor = fit(model(0), SameBatchEveryStep(), strategy=make(), devices=2, max_steps=STEPS, out=tmp_path / "donor",
                callbacks=(GiveState(tmp_path),))
    state = torch.load(tmp_path / "state0.pt", weights_only=False)
    assert state["global_step"] == HEAL_AT and state["optimizers"][0]["state"]  # AdamW moments, in a list
    healed = fit(model(1), SameBatchEveryStep(), strategy=make(), devices=2, max_steps=STEPS, out=tmp_path / "healed",
                 callbacks=(TakeState(tmp_path),))
    fresh = fit(model(1), SameBatchEveryStep(), strategy=make(), devices=2, max_steps=STEPS - HEAL_AT,
                out=tmp_path / "fresh")
    assert max_abs_diff(fresh[0]["params"], donor[0]["params"]) > 1e-3  # without the state, another run
    for r in range(2):
        assert healed[r]["global_step"] == STEPS
        assert max_abs_diff(healed[r]["params"], donor[r]["params"]) == 0.0, f"rank {r}"


def test_heal_bytes_count_every_tensor_of_the_state(tmp_path):
    fit(model(0), SameBatchEveryStep(), strategy=DiLoCoStrategy(period=4), devices=2, max_steps=STEPS,
        out=tmp_path / "donor", callbacks=(GiveState(tmp_path),))
    state = torch.load(tmp_path / "state1.pt", weights_only=False)
    tensors = [t for t in tree_leaves(state) if isinstance(t, torch.Tensor)]
    in_lists = [t for t in tree_leaves([state["optimizers"], state["algorithm"]]) if isinstance(t, torch.Tensor)]
    assert in_lists and sum(t.nbytes for t in in_lists) > sum(t.nbytes for t in tree_leaves(state["module"]))
    assert _tensor_bytes(state) == sum(t.numel() * t.element_size() for t in tensors)


def test_membership_figures_travel_with_the_checkpoint(make=SyncStrategy):
    """A group torchrun restarts resumes its ledger from its checkpoint, heal bytes included; its membership
    figures come back with it, so the summary's heals add up to the ledger's across the restart. (Every
    strategy of a group takes this from ReplicaGroupMember; diloco's own state needs a set-up run.)"""
    before = Telemetry(rounds=7, committed=6, participants=[3, 3, 2], failures_seen=1, heals=1, heal_seconds=0.4,
                       heal_bytes=8_600_000, steps_healed_over=12, uncommitted=1, quorum_seconds=2.5)
    saving = make()
    saving.replicas = SimpleNamespace(telemetry=before)
    state = saving.algorithm_state_dict()
    for joined in (False, True):  # restored before the group joins (a restart), or into a joined group
        restarted = make()
        restarted.replicas = SimpleNamespace(telemetry=Telemetry()) if joined else None
        restarted.load_algorithm_state_dict(state)
        after = restarted.replicas.telemetry if joined else Telemetry()
        if not joined:
            after.load_state_dict(restarted._restored_telemetry)  # what joining the group applies
        assert {k: v for k, v in after.summary().items() if k != "goodput"} == \
            {k: v for k, v in before.summary().items() if k != "goodput"}
