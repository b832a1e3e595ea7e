"""Lightning's own demo modules train under every gradsync strategy from a plain ``L.Trainer``, as a
user would pass them: ``BoringModel`` with ``BoringDataModule`` (no ``batch_size``, a dict loss), and
``LightningTransformer`` with a small random-token DataModule (no ``self.log``, SGD without momentum)."""

import pytest
import torch
import lightning as L
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
from lightning.pytorch.demos.transformer import LightningTransformer
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from gradsync.strategies import STRATEGIES
from harness import fit, max_abs_diff

pytestmark = pytest.mark.timeout(120)

# period 3 over 4 steps: the ranks agree only if the final, partial period is averaged too
OPTIONS = {"local_sgd": {"period": 3}, "diloco": {"period": 3}}
#: Strategies whose ranks hold the same weights after the last step (async_ps' workers read the
#: servers at their own times; the others average every step or at the final round).
AGREE = {"sync", "accumulate", "compressed", "local_sgd", "diloco"}


class FinalParams(Callback):
    """Each rank's weights when ``fit`` returns: after the strategy's own ``on_train_end`` (local SGD's
    and DiLoCo's final round), which Lightning calls after the callbacks' ``on_train_end``."""

    def __init__(self, out):
        self.out = out

    def on_fit_end(self, trainer, pl_module):
        torch.save({k: v.detach().clone() for k, v in pl_module.state_dict().items()},
                   self.out / f"final{trainer.global_rank}.pt")


class Tokens(L.LightningDataModule):
    """64 random sequences of 16 tokens from a vocabulary of 64, next-token targets."""

    def train_dataloader(self):
        x = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.roll(-1, dims=1)), batch_size=4, shuffle=True)


class OfflineTransformer(LightningTransformer):
    def prepare_data(self) -> None:  # the demo downloads WikiText2; this one trains on Tokens
        pass


def _check(ranks, start, name, steps, out):
    assert [r["global_step"] for r in ranks] == [steps, steps]
    final = [torch.load(out / f"final{r}.pt") for r in (0, 1)]
    moved = max(float((final[0][k].float() - start[k].float()).abs().max()) for k in start)
    assert moved > 0 and all(torch.isfinite(v.float()).all() for v in final[0].values())
    if name in AGREE:
        assert max_abs_diff(final[0], final[1]) == 0.0, f"{name}: ranks differ after fit"


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_boring_model_trains_under_every_strategy(tmp_path, name):
    torch.manual_seed(0)
    model = BoringModel()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    ranks = fit(model, BoringDataModule(), strategy=STRATEGIES[name](**OPTIONS.get(name, {})), devices=2,
                max_steps=4, out=tmp_path, use_distributed_sampler=True, callbacks=(FinalParams(tmp_path),))
    _check(ranks, start, name, 4, tmp_path)


@pytest.mark.parametrize("name", ["sync", "compressed", "diloco"])
def test_lightning_transformer_trains_on_random_tokens(tmp_path, name):
    torch.manual_seed(0)
    model = OfflineTransformer(vocab_size=64)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    ranks = fit(model, Tokens(), strategy=STRATEGIES[name](**OPTIONS.get(name, {})), devices=2, max_steps=4,
                out=tmp_path, use_distributed_sampler=True, callbacks=(FinalParams(tmp_path),))
    _check(ranks, start, name, 4, tmp_path)
