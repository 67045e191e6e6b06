"""The linear segmentation probe of `mimpipe evaluate` (finetune/report_card.py): the `linear` head of segmentation
fine-tuning (finetune/seg_heads.py `LinearHead`: BatchNorm + 1x1 convolution on the last block's patch tokens after
the final norm, DINOv2's linear protocol) trained on a frozen encoder for a short fixed schedule, then mIoU on the
validation masks (finetune/seg_evaluate.py, every pixel at each mask's own size, as segmentation fine-tuning scores).

Schedule (`SegSchedule`, the same for every encoder so that their rows compare): 300 steps of 16 crops, AdamW at
lr 1e-3 (recipes/seg_linear_vitb_ade20k.yaml's lr at batch 16) with weight decay 1e-4, 30 warmup steps then cosine to
0; crops of the training transform (random rescale 0.5-2.0, crop, flip, photometric jitter). Each rank trains the
same head on the same stream (rank 0's view of every training shard, seed 0) and the heads are averaged over ranks
(identical on CPU: the average only removes GPU non-determinism); the validation images are split over the ranks and
the confusion matrices summed.

Shapes: B batch, K classes, (h, w) the crop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from core.engine.distributed import DistInfo, all_reduce
from core.engine.precision import autocast_context, to_device
from core.engine.schedule import lr_at
from data.pipeline import make_eval_loader, make_train_loader
from data.progress import Progress
from data.seg_transforms import SegEvalTransform, SegTrainTransform
from data.specs import resolve_shards, segmentation_info
from finetune.seg_evaluate import evaluate_segmentation
from finetune.seg_model import Segmentation, SegmentationModel


@dataclass(frozen=True)
class SegSchedule:
    """The probe's training: fixed, so that every encoder gets the same."""

    steps: int = 300
    batch_size: int = 16
    lr: float = 1e-3
    weight_decay: float = 1e-4
    warmup_steps: int = 30


class _Autocast(nn.Module):
    """The objective under the evaluation's autocast (a DeepSpeed engine enters its own; this probe has none)."""

    def __init__(self, objective: Segmentation, precision: str, device: torch.device):
        super().__init__()
        self.objective, self.precision, self.device = objective, precision, device

    def forward(self, batch: dict) -> dict[str, torch.Tensor]:
        with autocast_context(self.precision, self.device):
            return self.objective(batch)


def seg_probe(
    encoder: nn.Module,
    *,
    train: str,
    val: str,
    crop: tuple[int, int],
    mean: tuple[float, ...],
    std: tuple[float, ...],
    dist: DistInfo,
    precision: str,
    num_workers: int,
    schedule: SegSchedule = SegSchedule(),
    label: str = "seg probe",
) -> dict[str, float]:
    """Train the linear head on the frozen `encoder` and score it; collective: every rank must call it.

    Args:
        encoder: A timm ViT (or hybrid, T2T-ViT) without a classifier, built with `global_pool: token` at `crop`.
        train: Segmentation shards to train the head on.
        val: Segmentation shards to score (mIoU).
        crop: The encoder's input size.
        mean: Normalisation of the encoder's images.
        std: Normalisation of the encoder's images.
        dist: This process's place in the group.
        precision: "bf16" (autocast) or "fp32".
        num_workers: Data workers per loader.
        schedule: The head's training.
        label: The progress line's prefix.

    Returns:
        "seg/miou", "seg/pixel_acc", "seg/mean_acc" over every validation image, and "seg/images".
    """
    num_classes = segmentation_info(train)["num_classes"]
    objective = Segmentation(SegmentationModel(encoder, "linear", num_classes), freeze_encoder=True)
    model = _Autocast(objective.to(dist.device), precision, dist.device)
    _train_head(model, train, crop, mean, std, dist, num_workers, schedule, label)
    val_loader = make_eval_loader(
        resolve_shards(val), transform=SegEvalTransform(crop, mean, std), batch_size=1, rank=dist.rank,
        world_size=dist.world_size, num_workers=num_workers, labels=False,
    )  # fmt: skip
    metrics = evaluate_segmentation(
        model, val_loader, dist=dist, precision=precision, num_classes=num_classes, crop=crop
    ).metrics
    return {name.replace("val/", "seg/"): value for name, value in metrics.items()}


def _train_head(
    model: _Autocast, train: str, crop, mean, std, dist: DistInfo, num_workers: int, schedule: SegSchedule, label: str
) -> None:
    """`schedule.steps` AdamW steps on the head alone; the head then averaged over ranks."""
    loader = make_train_loader(
        resolve_shards(train), transform=SegTrainTransform(crop, mean, std), batch_size=schedule.batch_size, seed=0,
        rank=0, world_size=1, num_workers=num_workers, labels=False,
    )  # fmt: skip
    head = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(head, lr=schedule.lr, weight_decay=schedule.weight_decay)
    progress = Progress(schedule.steps, "steps", label=label) if dist.is_main else None
    model.train()
    model.objective.model.encoder.eval()  # frozen: no dropout, no drop path
    for step, batch in zip(range(1, schedule.steps + 1), loader, strict=False):
        lr = lr_at(
            step, peak_lr=schedule.lr, min_lr=0.0, warmup_steps=schedule.warmup_steps, total_steps=schedule.steps
        )
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = model(to_device(batch, dist.device, "fp32"))["loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if progress is not None:
            progress.advance()
    if progress is not None:
        progress.finish()
    with torch.no_grad():
        for tensor in model.objective.model.head.state_dict().values():
            if tensor.is_floating_point():  # BatchNorm's step count is an integer, the same on every rank
                tensor.copy_(all_reduce(tensor.clone()) / dist.world_size)
