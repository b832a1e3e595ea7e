"""A callback that records, on rank 0, the Trainer arguments a run's Trainer actually holds."""

import json
import os

import torch
from lightning.pytorch.callbacks import Callback


class TrainerArgsProbe(Callback):
    """Writes ``trainer_args.json`` into the run's output dir at the first training batch."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx or not trainer.is_global_zero:
            return
        with trainer.precision_plugin.forward_context():  # the context training_step runs in
            dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        seen = {"precision": trainer.precision, "gradient_clip_val": trainer.gradient_clip_val,
                "world_size": trainer.world_size, "autocast_dtype": str(dtype)}
        with open(os.path.join(trainer.default_root_dir, "trainer_args.json"), "w") as f:
            json.dump(seen, f)
