"""Segmentation evaluation on data.val: mIoU, per-class IoU and pixel accuracy, every image counted once across ranks.

Each rank streams its own shards (`data.pipeline.make_eval_loader`) one image at a time, since masks keep their
stored size. An image is predicted whole (resized to the crop by its transform) or window by window ("slide":
crop-sized windows at `stride`, the last ones flush with the far edges, logits averaged where windows overlap; an
image smaller than the crop is padded), the logits are resized bilinearly to the mask's size, and its scored pixels
are added to a (K, K) confusion matrix on the device. The matrices are summed over ranks once at the end, so the
scores are those of all pixels at any world size. Ranks forward in lock-step, one forward per image
(finetune/evaluate.py `lockstep`: under ZeRO-3 every forward is collective), agreeing every `AGREE_EVERY` images;
nothing else is read back to the host per image (a mask id outside the classes is checked once per pass), so the GPU
never waits for it.

Shapes: K classes, H/W a mask's size, h/w the image as the transform resized it, (ch, cw) the crop.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from core.engine.distributed import DistInfo, all_reduce
from core.engine.precision import to_device
from core.report.metrics import Confusion, segmentation_scores
from core.report.pictures import colour_mask, id_colours, image_grid, legend
from data.segmentation import IGNORE_INDEX
from finetune.evaluate import lockstep

AGREE_EVERY = 32
"""Images each rank reads ahead between two lock-step agreements (one host read each): 2,000 ADE20K validation images
on 8 ranks agree 8 times, not 250."""


@torch.no_grad()
def evaluate_segmentation(
    engine,
    batches,
    *,
    dist: DistInfo,
    precision: str,
    num_classes: int,
    crop: tuple[int, int],
    stride: tuple[int, int] | None = None,
    keep: int = 0,
) -> SegResult:
    """Evaluate on every rank's share of the held-out set; collective: every rank must call it.

    Args:
        engine: Called as `engine({"image": ...})`, returns "logits" (N, K, ch, cw); has `eval()` and `train()`.
        batches: This rank's batches of one image each: "image" (1, 3, h, w) uint8 and "seg" (1, H, W).
        dist: This process's place in the group.
        precision: As for training.
        num_classes: K.
        crop: The model's input size.
        stride: Slide the crop over the image at this stride; None: the image is the crop (whole-image mode).

        keep: How many of this rank's first images to keep, with their prediction and mask (for pictures).

    Returns:
        The metrics, the confusion matrix summed over ranks, and this rank's kept examples (see `SegResult`).
    """
    confusion = Confusion(num_classes, IGNORE_INDEX, dist.device)
    images = torch.zeros((), dtype=torch.float64, device=dist.device)
    examples = []
    engine.eval()
    try:
        for raw, real in lockstep(batches, dist, every=AGREE_EVERY):
            batch = to_device(raw, dist.device, precision)
            logits = predict(engine, batch["image"], crop, stride)  # (1, K, h, w)
            if real:  # a stand-in only keeps ZeRO-3 in step
                target = batch["seg"]  # (1, H, W)
                logits = F.interpolate(logits, target.shape[-2:], mode="bilinear", align_corners=False)
                pred = logits.argmax(dim=1)  # (1, H, W)
                confusion.add(pred, target)  # on the device: no host read per image
                images += 1
                if len(examples) < keep:
                    examples.append((raw["image"][0], pred[0].cpu(), target[0].cpu()))
    finally:
        engine.train()
    confusion.check()  # a mask's id outside the classes, read once per pass
    confusion = all_reduce(confusion.matrix()).cpu()
    scores = segmentation_scores(confusion)
    metrics = {"val/miou": scores["miou"], "val/pixel_acc": scores["pixel_acc"], "val/mean_acc": scores["mean_acc"]}
    metrics["val/images"] = float(all_reduce(images))
    return SegResult(metrics, confusion, examples)


class SegResult(NamedTuple):
    """What `evaluate_segmentation` found."""

    metrics: dict[str, float]
    """"val/miou", "val/pixel_acc", "val/mean_acc", "val/images": over every rank's images."""
    confusion: torch.Tensor
    """(K, K) int64 on the CPU, summed over ranks: rows true classes, columns predicted."""
    examples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """This rank's first images: (3, h, w) uint8 as the model saw it, prediction and mask (H, W)."""


def segmentation_picture(examples: list, names: list[str], ids: list[int], side: int = 96) -> torch.Tensor:
    """image | prediction | ground truth, one row per example, each panel resized to side x side (nearest), the
    classes colour-coded by the id they have in the dataset's own masks (`ids`, `core.report.pictures.id_colours`;
    ignored pixels white), and below them a legend of the classes shown, by name and that id: (3, H, W) float in
    [0, 1]. `names` and `ids` are per training class."""
    colours = id_colours(ids)
    columns, shown = [[], [], []], set()
    for image, pred, target in examples:
        panels = (image, colour_mask(pred, colours, IGNORE_INDEX), colour_mask(target, colours, IGNORE_INDEX))
        for column, panel in zip(columns, panels, strict=True):
            column.append(F.interpolate(panel[None].float(), (side, side), mode="nearest")[0] / 255)
        shown |= {k for k in torch.cat([pred.flatten(), target.flatten()]).unique().tolist() if k < len(names)}
    grid = image_grid([torch.stack(c) for c in columns], ["image", "prediction", "ground truth"])
    entries = [(f"{names[k]} ({ids[k]})", colours[k].tolist()) for k in sorted(shown)]
    return torch.cat([grid, legend(entries, grid.shape[-1])], dim=1)


def predict(engine, image: torch.Tensor, crop: tuple[int, int], stride: tuple[int, int] | None) -> torch.Tensor:
    """Logits (1, K, h, w) of one normalised image (1, 3, h, w): one forward of the image, or of all its windows."""
    if stride is None:
        return engine({"image": image})["logits"].float()
    height, width = image.shape[-2:]
    pad_h, pad_w = max(crop[0] - height, 0), max(crop[1] - width, 0)
    padded = F.pad(image, (0, pad_w, 0, pad_h))  # zeros after normalisation: the mean colour
    boxes = window_boxes(padded.shape[-2:], crop, stride)
    windows = torch.cat([padded[..., top : top + crop[0], left : left + crop[1]] for top, left in boxes])
    logits = engine({"image": windows})["logits"].float()  # (n, K, ch, cw)
    total = logits.new_zeros(1, logits.shape[1], *padded.shape[-2:])
    count = logits.new_zeros(1, 1, *padded.shape[-2:])
    for (top, left), window in zip(boxes, logits, strict=True):
        total[..., top : top + crop[0], left : left + crop[1]] += window
        count[..., top : top + crop[0], left : left + crop[1]] += 1
    return (total / count)[..., :height, :width]


def window_boxes(size: torch.Size | tuple[int, int], crop: tuple[int, int], stride: tuple[int, int]) -> list:
    """The (top, left) corners of the windows that cover a `size` image at least as large as `crop`: every `stride`,
    the last window of a row or column moved back to end at the image's edge (mmsegmentation's slide inference)."""
    corners = []
    for side, window, step in zip(size, crop, stride, strict=True):
        count = max(-(-(side - window) // step), 0) + 1  # ceil((side - window) / step) + 1
        corners.append(sorted({min(i * step, side - window) for i in range(count)}))
    return [(top, left) for top in corners[0] for left in corners[1]]
