"""Small LightningModules of the kinds users bring (none written for gradsync): one with a layer the
loss never uses, one with BatchNorm, one with manual optimization and two optimizers; and a plain
DataModule of random regression data. Used by tests/cli/test_ecosystem_modules.py through
``gradsync fit --model ecosystem_modules.X --data ecosystem_modules.RandomData`` and plain L.Trainer."""

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class RandomData(L.LightningDataModule):
    """256 samples of 8 features with a linear target; a plain DataLoader (Lightning shards it)."""

    def __init__(self, batch_size: int = 16):
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 8, generator=g)
        y = x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.5
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size, shuffle=True)


class UnusedLayer(L.LightningModule):
    """``self.unused`` takes no part in the loss: DDP fails at the second step without
    find_unused_parameters."""

    def __init__(self, lr: float = 0.05):
        super().__init__()
        self.lr = lr
        self.used = torch.nn.Linear(8, 1)
        self.unused = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.used(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class BatchNormNet(L.LightningModule):
    """A BatchNorm layer: its running statistics are buffers each rank computes from its own batches."""

    def __init__(self, lr: float = 0.05):
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                       torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class TwoOptimizers(L.LightningModule):
    """Manual optimization with two optimizers (as a GAN steps its generator and discriminator): each
    batch steps both, so Lightning's optimizer-step count grows by 2 per batch."""

    def __init__(self, lr: float = 0.05):
        super().__init__()
        self.automatic_optimization = False
        self.lr = lr
        self.a = torch.nn.Linear(8, 1)
        self.b = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_a, opt_b = self.optimizers()
        for opt, layer in ((opt_a, self.a), (opt_b, self.b)):
            loss = torch.nn.functional.mse_loss(layer(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        self.log("train_loss", loss)

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=self.lr), torch.optim.SGD(self.b.parameters(), lr=self.lr)
