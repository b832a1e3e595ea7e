"""Lightning's own demo modules train under every gradsync strategy from a plain ``L.Trainer``, as a
user would pass them: ``BoringModel`` with ``BoringDataModule`` (no ``batch_size``, a dict loss), and
``LightningTransformer`` with a small random-token DataModule (no ``self.log``, SGD without momentum)."""

import pytest
import torch
import lightning as L
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
from lightning.pytorch.demos.transformer import LightningTransformer
from torch.utils.data import DataLoader, TensorDataset

from gradsync.strategies import STRATEGIES
from harness import fit, max_abs_diff

pytestmark = pytest.mark.timeout(120)

OPTIONS = {"local_sgd": {"period": 2}, "diloco": {"period": 2}}
#: Strategies whose ranks hold the same weights after the last step (async_ps' workers read the
#: servers at their own times; the others average every step or at the final round).
AGREE = {"sync", "accumulate", "compressed", "local_sgd", "diloco"}


class Tokens(L.LightningDataModule):
    """64 random sequences of 16 tokens from a vocabulary of 64, next-token targets."""

    def train_dataloader(self):
        x = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.roll(-1, dims=1)), batch_size=4, shuffle=True)


class OfflineTransformer(LightningTransformer):
    def prepare_data(self) -> None:  # the demo downloads WikiText2; this one trains on Tokens
        pass


def _check(ranks, start, name, steps):
    assert [r["global_step"] for r in ranks] == [steps, steps]
    moved = max(float((ranks[0]["params"][k].float() - start[k].float()).abs().max()) for k in start)
    assert moved > 0 and all(torch.isfinite(v.float()).all() for v in ranks[0]["params"].values())
    if name in AGREE:
        assert max_abs_diff(ranks[0]["params"], ranks[1]["params"]) == 0.0, f"{name}: ranks differ after fit"


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_boring_model_trains_under_every_strategy(tmp_path, name):
    torch.manual_seed(0)
    model = BoringModel()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    ranks = fit(model, BoringDataModule(), strategy=STRATEGIES[name](**OPTIONS.get(name, {})), devices=2,
                max_steps=4, out=tmp_path, use_distributed_sampler=True)
    _check(ranks, start, name, 4)


@pytest.mark.parametrize("name", ["sync", "compressed", "diloco"])
def test_lightning_transformer_trains_on_random_tokens(tmp_path, name):
    torch.manual_seed(0)
    model = OfflineTransformer(vocab_size=64)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    ranks = fit(model, Tokens(), strategy=STRATEGIES[name](**OPTIONS.get(name, {})), devices=2, max_steps=4,
                out=tmp_path, use_distributed_sampler=True)
    _check(ranks, start, name, 4)
