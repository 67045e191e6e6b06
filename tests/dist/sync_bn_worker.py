"""torchrun worker: `SyncBatchNorm2d` on this rank's share of a batch against `nn.BatchNorm2d` on the whole batch.

    sync_bn_worker.py DTYPE

Every rank builds the same batch (8 images, split 3 / 5 over 2 ranks: unequal counts) and the same layer, runs two
training steps of sum(y * g) on its share with the synchronised copy and on everything with the plain layer, and
reports the largest differences: outputs and input gradients of its share, the parameter gradients summed over
ranks, the running statistics. Rank 0 prints every rank's report as one JSON list.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch import nn

from core.engine.sync_batchnorm import synchronise_batchnorm


def main() -> None:
    dtype = getattr(torch, sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    bounds = [0, 3, 8] if world == 2 else [0, 8]
    torch.manual_seed(0)
    plain = nn.BatchNorm2d(4, momentum=0.3)
    nn.init.normal_(plain.weight), nn.init.normal_(plain.bias)
    synced = synchronise_batchnorm(copy.deepcopy(plain))
    errors = {"out": 0.0, "input_grad": 0.0}
    for _ in range(2):
        x, g = torch.randn(8, 4, 5, 3) * 3 + 2, torch.randn(8, 4, 5, 3)  # same on every rank (same seed)
        whole = x.clone().requires_grad_()
        expected = plain(whole)
        (expected * g).sum().backward()
        mine = slice(bounds[rank], bounds[rank + 1])
        share = x[mine].to(dtype).requires_grad_()
        y = synced(share)
        (y.float() * g[mine]).sum().backward()
        errors["out"] = max(errors["out"], (y.float() - expected.detach()[mine]).abs().max().item())
        errors["input_grad"] = max(errors["input_grad"], (share.grad.float() - whole.grad[mine]).abs().max().item())
    for name in ("weight", "bias"):
        grad = getattr(synced, name).grad.clone()
        dist.all_reduce(grad)  # what data parallelism sums (then averages) from the ranks
        errors[f"{name}_grad"] = (grad - getattr(plain, name).grad).abs().max().item()
    for name in ("running_mean", "running_var"):
        errors[name] = (getattr(synced, name) - getattr(plain, name)).abs().max().item()
    errors["batches_tracked"] = int(synced.num_batches_tracked) - int(plain.num_batches_tracked)
    reports = [None] * world
    dist.all_gather_object(reports, {"rank": rank, "class": type(synced).__name__, **errors})
    if rank == 0:  # one line from one process: two printing at once can interleave
        print(json.dumps(reports), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
