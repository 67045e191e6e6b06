"""Held-out evaluation, each sample counted exactly once across ranks.

Every rank streams its own disjoint shards (`make_eval_loader`), sums loss / top-1 / top-5 / count, and the sums
are all-reduced. Ranks step in lock-step (one tiny all-reduce per batch says whether anyone still has data) and a
rank that has run out forwards a zero-weight stand-in batch, because under ZeRO-3 every forward is collective.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core.engine.distributed import DistInfo, all_reduce
from core.engine.loop import autocast_context, to_device
from finetune.classification import topk_correct


@torch.no_grad()
def evaluate(engine, batches, *, dist: DistInfo, precision: str) -> dict[str, float]:
    """Returns {"val/loss", "val/top1", "val/top5", "val/samples"} over the whole held-out set."""
    sums = torch.zeros(4, dtype=torch.float64, device=dist.device)  # loss, top1, top5, count
    iterator = iter(batches)
    stand_in = None
    engine.eval()
    while True:
        batch = next(iterator, None)
        has_data = torch.tensor([0.0 if batch is None else 1.0], device=dist.device)
        if all_reduce(has_data, op="max").item() == 0:
            break
        weight = 1.0
        if batch is None:
            batch, weight = stand_in, 0.0
        stand_in = batch
        batch = to_device(batch, dist.device, precision)
        with autocast_context(precision, dist.device):
            logits = engine(batch)["logits"].float()
        labels = batch["label"]
        loss = F.cross_entropy(logits, labels, reduction="sum")
        correct = topk_correct(logits, labels, ks=(1, 5)).to(sums)
        sums += weight * torch.stack([loss.double(), correct[0], correct[1], torch.tensor(len(labels)).to(sums)])
    engine.train()
    loss, top1, top5, count = all_reduce(sums).tolist()
    count = max(count, 1.0)
    return {"val/loss": loss / count, "val/top1": top1 / count, "val/top5": top5 / count, "val/samples": count}
