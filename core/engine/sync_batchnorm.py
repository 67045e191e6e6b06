"""BatchNorm over the global batch: every rank normalises with the mean and variance of all ranks' images together.

With data parallelism each rank sees global_batch / world_size images; a segmentation head's BatchNorm on 2 images
per GPU (ADE20K's 16 over 8 GPUs) has noisy statistics, which is why mmsegmentation's UperNet (BEiT's and MAE's
set-up) synchronises them. `torch.nn.SyncBatchNorm` refuses CPU tensors, so this is one code path for every device
and backend (gloo included): the GPU's branch is the one the CPU tests take.

In training, each rank's per-channel (count, mean, biased variance) are summed into a (world, 2C + 1) table by one
differentiable all-reduce (`torch.distributed.nn`: its backward all-reduces the gradients, so each rank's input
gets the gradient of every rank's loss through the shared statistics), and combined exactly (Chan et al.'s parallel
variance; ranks may hold different counts). Running statistics are updated from the global ones, as one
BatchNorm2d over the whole batch would (unbiased variance). In evaluation, or in one process, it is BatchNorm2d.
Every rank must run the same BatchNorm layers in the same order, as data-parallel training does.

Shapes: N images on this rank, C channels, H/W the map.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from torch import nn


class SyncBatchNorm2d(nn.BatchNorm2d):
    """`nn.BatchNorm2d` whose training statistics are those of the batch summed over all ranks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) -> (N, C, H, W) in x's dtype (statistics in fp32)."""
        if not (self.training and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        mean, var, count = _global_moments(x.float())  # (C,), (C,), scalar
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), count)
        scale = torch.rsqrt(var + self.eps)
        y = (x.float() - mean[:, None, None]) * scale[:, None, None]
        if self.affine:
            y = y * self.weight.float()[:, None, None] + self.bias.float()[:, None, None]
        return y.to(x.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor) -> None:
        self.num_batches_tracked.add_(1)
        factor = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        unbiased = var * count / (count - 1).clamp(min=1)
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
        self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)


def _global_moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's (N, C, H, W) fp32 -> the mean and biased variance (C,) over every rank's pixels, and their count."""
    channels, world, rank = x.shape[1], dist.get_world_size(), dist.get_rank()
    count = x.new_tensor([x.numel() // channels])
    local = torch.cat([count, x.mean(dim=(0, 2, 3)), x.var(dim=(0, 2, 3), unbiased=False)])  # (2C + 1,)
    table = dist_nn.all_reduce(F.pad(local[None], (0, 0, rank, world - rank - 1)))  # (world, 2C + 1): row `rank` ours
    counts, means, variances = table[:, :1], table[:, 1 : 1 + channels], table[:, 1 + channels :]  # (world, .)
    total = counts.sum()
    mean = (counts * means).sum(0) / total
    var = (counts * (variances + (means - mean) ** 2)).sum(0) / total
    return mean, var, total


def synchronise_batchnorm(module: nn.Module) -> nn.Module:
    """Every `nn.BatchNorm2d` in `module` becomes a `SyncBatchNorm2d` with its parameters, buffers and mode
    (in place; the state-dict keys stay the same). Returns `module`, or the replacement when it is one itself."""
    if isinstance(module, nn.BatchNorm2d) and not isinstance(module, SyncBatchNorm2d):
        synced = SyncBatchNorm2d(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        synced.load_state_dict(module.state_dict())
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if tensors:
            synced.to(tensors[0].device)
        if module.affine:
            synced.weight.requires_grad_(module.weight.requires_grad)
            synced.bias.requires_grad_(module.bias.requires_grad)
        return synced.train(module.training)
    for name, child in module.named_children():
        setattr(module, name, synchronise_batchnorm(child))
    return module
