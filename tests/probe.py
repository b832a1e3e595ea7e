"""A LightningModule and DataModule gradsync did not write: an ordinary DataLoader, no sharding of
its own, no logging, no validation_step. The probe records the sample indices each rank trains on."""

import os
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class ProbeData(L.LightningDataModule):
    """An ordinary DataModule: a plain shuffled DataLoader, no sharding of its own."""

    def train_dataloader(self):
        x = torch.arange(64, dtype=torch.float32).unsqueeze(1)
        return DataLoader(TensorDataset(x), batch_size=4, shuffle=True)


class Probe(L.LightningModule):
    """Records the sample indices each rank trains on; has no validation_step."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        with open(os.path.join(os.environ["PROBE_DIR"], f"rank{self.global_rank}.txt"), "a") as f:
            f.write(" ".join(str(int(v)) for v in x.flatten()) + "\n")
        return self.layer(x / 64).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
