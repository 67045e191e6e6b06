"""Counting metrics shared by the stages: fine-tuning evaluation (classification and segmentation) and the kNN
monitor of pretraining."""

from __future__ import annotations

import torch


def topk_correct(logits: torch.Tensor, labels: torch.Tensor, ks: tuple[int, ...] = (1, 5)) -> torch.Tensor:
    """Number of samples whose label is among the k highest logits, for each k.

    Args:
        logits: (B, K) scores.
        labels: (B,) class indices.
        ks: The k values; a k above K counts as K (every sample correct).

    Returns:
        (len(ks),) int64 counts.
    """
    num_classes = logits.shape[-1]
    top = logits.topk(min(max(ks), num_classes), dim=-1).indices  # (B, maxk), best first
    hits = top == labels[:, None]  # (B, maxk)
    return torch.stack([hits[:, : min(k, num_classes)].any(dim=-1).sum() for k in ks])


class Confusion:
    """A (K, K) [true, predicted] confusion matrix of per-pixel predictions, accumulated on the device with no host
    read per batch (segmentation evaluation adds one per image: a read would wait for the GPU every time).

    A scored target id outside [0, K) is not counted; the largest scored id is kept on the device, and `check` reads
    it once (at the end of a pass) and raises if it is out of range.

    Args:
        num_classes: K.
        ignore_index: The target id that is left out.
        device: Where the counts live.
    """

    def __init__(self, num_classes: int, ignore_index: int, device: torch.device | str = "cpu"):
        self.num_classes, self.ignore_index = num_classes, ignore_index
        self.counts = torch.zeros(num_classes * num_classes + 1, dtype=torch.int64, device=device)  # last: not counted
        self.largest = torch.full((), -1, dtype=torch.int64, device=device)

    def add(self, pred: torch.Tensor, target: torch.Tensor) -> None:
        """Count one batch: `pred` and `target` (...) class ids, `ignore_index` where a pixel is not scored."""
        k = self.num_classes
        target, pred = target.long(), pred.long()
        scored = target != self.ignore_index
        counted = scored & (target >= 0) & (target < k)
        cells = torch.where(counted, target * k + pred, k * k)  # (...) the cell of each pixel; k * k: not counted
        self.counts += torch.bincount(cells.flatten(), minlength=k * k + 1)
        self.largest = torch.maximum(self.largest, torch.where(scored, target, -1).amax())

    def matrix(self) -> torch.Tensor:
        """(K, K) int64 [true, predicted] pixel counts, on the device."""
        return self.counts[:-1].view(self.num_classes, self.num_classes)

    def check(self) -> None:
        """One host read: raises ValueError if a scored target id was outside [0, K)."""
        largest = int(self.largest)
        if largest >= self.num_classes:
            raise ValueError(f"a mask holds class id {largest} outside [0, {self.num_classes}) (model.num_classes)")


def confusion_counts(pred: torch.Tensor, target: torch.Tensor, num_classes: int, ignore_index: int) -> torch.Tensor:
    """The confusion matrix of one batch of per-pixel predictions (`Confusion` for one batch, checked at once).

    Args:
        pred: (...) predicted class ids.
        target: (...) true class ids, `ignore_index` where a pixel is not scored.
        num_classes: K.
        ignore_index: The target id that is left out.

    Returns:
        (K, K) int64: [true, predicted] pixel counts.

    Raises:
        ValueError: If a scored target id is outside [0, K).
    """
    confusion = Confusion(num_classes, ignore_index, pred.device)
    confusion.add(pred, target)
    confusion.check()
    return confusion.matrix()


def segmentation_scores(confusion: torch.Tensor) -> dict[str, float | list[float | None]]:
    """mIoU, per-class IoU and pixel accuracy from a (K, K) [true, predicted] confusion matrix.

    IoU_k = TP / (TP + FP + FN). A class that neither occurs nor is predicted has no IoU (None) and is left out of
    the mean, as mmsegmentation does (its NaN); one that is predicted but never occurs has IoU 0.

    Returns:
        {"miou", "pixel_acc", "mean_acc": the mean per-class recall over classes that occur, "iou": K floats or None}.
    """
    counts = confusion.double()
    true_positive = counts.diagonal()
    union = counts.sum(0) + counts.sum(1) - true_positive  # predicted + occurring - both
    occurring = counts.sum(1)
    iou = [float(tp / u) if u > 0 else None for tp, u in zip(true_positive, union, strict=True)]
    scored = [value for value in iou if value is not None]
    recall = [float(tp / n) for tp, n in zip(true_positive, occurring, strict=True) if n > 0]
    total = float(counts.sum())
    return {
        "miou": sum(scored) / len(scored) if scored else 0.0,
        "pixel_acc": float(true_positive.sum()) / total if total else 0.0,
        "mean_acc": sum(recall) / len(recall) if recall else 0.0,
        "iou": iou,
    }
