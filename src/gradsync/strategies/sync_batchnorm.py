"""BatchNorm with statistics over the global batch on any backend (``--sync-batchnorm`` on CPU/gloo).

torch's ``SyncBatchNorm`` runs on CUDA only (its forward refuses CPU input, and DDP refuses CPU
modules that hold it), so Lightning's ``sync_batchnorm=True`` fails on a CPU run. Under sync DDP each
rank's BatchNorm normalizes with its own batch's statistics and updates its own running statistics;
DDP broadcasts rank 0's buffers before every forward, so the ranks end a run with different running
statistics (``buffers_agree: false`` in summary.json). :class:`GlobalBatchNorm` all-reduces the
per-channel count, sum and sum of squares (differentiably, so the backward pass is that of one
BatchNorm over the global batch) and every rank normalizes and updates its running statistics
with the same global figures.

:class:`GlobalSyncBatchNorm` is the Lightning ``LayerSync`` plugin that swaps the layers in; gradsync
strategies use it for ``sync_batchnorm=True`` on CPU and keep torch's ``SyncBatchNorm`` on GPUs.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from torch import nn


class GlobalBatchNorm(nn.modules.batchnorm._BatchNorm):
    """A BatchNorm layer (any number of dimensions) whose training statistics span every rank of
    ``process_group`` (the world when None). Outside training, or on one process, it is BatchNorm."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: Optional[Any] = None, **kwargs: Any) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, **kwargs)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) > 1
        if not (self.training and distributed):
            return super().forward(input)
        from torch.distributed.nn.functional import all_reduce

        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        x = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        count = torch.full((1,), x.numel() / channels, dtype=x.dtype, device=x.device)
        stats = torch.cat([x.sum(dims), (x * x).sum(dims), count])
        stats = all_reduce(stats, group=self.process_group or dist.group.WORLD)  # differentiable
        total = stats[-1]
        mean = stats[:channels] / total
        var = (stats[channels:2 * channels] / total - mean * mean).clamp_min(0)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum)
                unbiased = var * total / (total - 1).clamp_min(1)
                self.running_mean.mul_(1 - factor).add_(mean.detach().to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.detach().to(self.running_var.dtype), alpha=factor)
        shape = [1, channels] + [1] * (input.dim() - 2)
        out = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(input.dtype)


def _swap(module: nn.Module, make: Any, kind: type) -> nn.Module:
    out = module
    if isinstance(module, kind):
        out = make(module)
        if module.affine:
            with torch.no_grad():
                out.weight, out.bias = module.weight, module.bias
        out.running_mean, out.running_var = module.running_mean, module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, _swap(child, make, kind))
    return out


class GlobalSyncBatchNorm(LayerSync):
    """Lightning ``LayerSync`` plugin: every BatchNorm layer becomes a :class:`GlobalBatchNorm` while
    fitting and is turned back after (``L.Trainer(plugins=[GlobalSyncBatchNorm()])`` on any backend)."""

    def apply(self, model: nn.Module) -> nn.Module:
        return _swap(model, lambda m: GlobalBatchNorm(m.num_features, m.eps, m.momentum, m.affine,
                                                      m.track_running_stats), nn.modules.batchnorm._BatchNorm)

    def revert(self, model: nn.Module) -> nn.Module:
        from lightning.pytorch.plugins.layer_sync import _BatchNormXd

        return _swap(model, lambda m: _BatchNormXd(m.num_features, m.eps, m.momentum, m.affine,
                                                   m.track_running_stats), GlobalBatchNorm)


def layer_sync_for(current: Optional[LayerSync], device_type: str) -> Optional[LayerSync]:
    """The plugin to use: torch's SyncBatchNorm (Lightning's ``sync_batchnorm=True``) works on CUDA
    only, so on any other device it is replaced by :class:`GlobalSyncBatchNorm`."""
    if type(current) is TorchSyncBatchNorm and device_type != "cuda":
        return GlobalSyncBatchNorm()
    return current
