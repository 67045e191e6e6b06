"""Mixup / CutMix on whole training batches, with soft targets, as timm's `Mixup` in "batch" mode mixes them.

One mixing weight lam is drawn per batch; every sample i is mixed with sample B - 1 - i (the batch flipped):
    mixup:  image = lam * x + (1 - lam) * x.flip(0)
    cutmix: one box, the same for the whole batch, is pasted from x.flip(0); lam becomes the unpasted area fraction
    label = lam * y + (1 - lam) * y.flip(0), where y is the one-hot label smoothed to (1 - s + s / K, s / K)

Where: `MixBatches` draws in the training process, on the host, as batches leave the loader; it puts the draw
(`MixDraw`) into the batch and leaves the pinned uint8 images and int64 labels as they are, so that the host-to-device
copy stays asynchronous. `apply_mix` mixes on the device, after normalisation (data/device.py). Mixing after the
copy gives timm's values: it runs timm's operations, in timm's order, on the same normalised float32 images.

Randomness: lam, the mixup/cutmix switch and the box come from numpy's global RNG, drawn in timm's `Mixup` order
(`_params_per_batch`, then `cutmix_bbox_and_lam`). The draws advance the trainer's numpy RNG, whose state is
checkpointed with the other RNGs: a resumed run mixes as the uninterrupted one does. Applying a draw draws nothing,
so a batch copied to the device twice (the FLOP count's first batch) is mixed the same way twice.

Shapes: B batch size, K number of classes, H/W image height/width.
"""

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch
from timm.data.mixup import cutmix_bbox_and_lam, mixup_target


class MixDraw(NamedTuple):
    """One batch's Mixup / CutMix draw, applied on the device by `apply_mix`."""

    lam: float
    """Weight of each sample's own image and label (1: not mixed; CutMix: the unpasted area fraction)."""
    box: tuple[int, int, int, int] | None
    """CutMix's (top, bottom, left, right) pixel rows / columns pasted from the flipped batch; None for Mixup."""
    num_classes: int
    label_smoothing: float


def apply_mix(images: torch.Tensor, labels: torch.Tensor, draw: MixDraw) -> tuple[torch.Tensor, torch.Tensor]:
    """timm's batch-mode mixing of `images` (B, 3, H, W) float and class indices `labels` (B,) by `draw`.

    Returns:
        New tensors (the inputs are not modified): the mixed images (B, 3, H, W) and (B, K) float32 soft targets.
    """
    lam = draw.lam
    if draw.box is not None:
        top, bottom, left, right = draw.box
        images = images.clone()
        images[:, :, top:bottom, left:right] = images.flip(0)[:, :, top:bottom, left:right]
    elif lam != 1.0:
        images = images.mul(lam).add_(images.flip(0).mul_(1.0 - lam))  # timm's two products, then their sum
    soft = mixup_target(labels, draw.num_classes, lam, draw.label_smoothing)
    return images, soft.to(torch.float32)


class MixBatches:
    """Mixup and/or CutMix of a batch dict, turning its class labels into soft targets (drawn here, applied on the
    device by `apply_mix`).

    Label smoothing is part of the soft targets, so the classification loss must use label_smoothing 0 on mixed
    batches (otherwise the labels are smoothed twice).

    Args:
        num_classes: K, the number of classes.
        mixup: Mixup's Beta(alpha, alpha) parameter; 0 disables mixup.
        cutmix: CutMix's Beta(alpha, alpha) parameter; 0 disables cutmix.
        prob: Probability of mixing a batch at all (unmixed batches still get soft, smoothed labels).
        switch_prob: Probability of CutMix rather than Mixup when both are enabled.
        label_smoothing: Mass s spread uniformly over the K classes of each one-hot label before mixing.

    Raises:
        ValueError: If an argument is out of range or both mixup and cutmix are 0 (use `build_mix`).
    """

    def __init__(
        self,
        *,
        num_classes: int,
        mixup: float,
        cutmix: float,
        prob: float = 1.0,
        switch_prob: float = 0.5,
        label_smoothing: float = 0.0,
    ):
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        if mixup < 0 or cutmix < 0 or mixup == cutmix == 0:
            raise ValueError(f"mixup and cutmix must be >= 0 and not both 0, got {mixup} and {cutmix}")
        for name, value in (("prob", prob), ("switch_prob", switch_prob)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        self.num_classes, self.mixup, self.cutmix = num_classes, mixup, cutmix
        self.prob, self.switch_prob, self.label_smoothing = prob, switch_prob, label_smoothing

    def __call__(self, batch: dict) -> dict:
        """Draws the mixing of one batch, to be applied on the device.

        Args:
            batch: "image" (B, 3, H, W), "label" (B,) int64 class indices, any other entries.

        Returns:
            A new dict with the same entries, the same tensors (pinned ones stay pinned), and "mix": the `MixDraw`.
            On the device (`data.device.batch_to_device`) "image" becomes (B, 3, H, W) mixed and "label" (B, K)
            float32 soft targets whose rows sum to 1.

        Raises:
            ValueError: If B is odd (sample i is paired with sample B - 1 - i, so the middle one would be paired
                with itself; use an even per-device batch size) or a label is not a class index below K.
        """
        images, labels = batch["image"], batch["label"]
        if len(images) % 2:
            raise ValueError(f"mixup / cutmix need an even batch size, got batch size {len(images)}")
        if labels.ndim != 1 or labels.dtype.is_floating_point:
            raise ValueError(
                f"mixup / cutmix need class indices (B,) as labels, got {labels.dtype} {tuple(labels.shape)}"
            )
        if len(labels) and not 0 <= int(labels.min()) <= int(labels.max()) < self.num_classes:
            raise ValueError(f"labels must be in [0, {self.num_classes}), got {labels.min()}..{labels.max()}")
        return {**batch, "mix": self.draw(tuple(images.shape))}

    def draw(self, shape: tuple[int, ...]) -> MixDraw:
        """lam, Mixup or CutMix and CutMix's box for a batch of `shape` (B, 3, H, W), from numpy's global RNG in the
        order timm's `Mixup` draws them (mode "batch", correct_lam: a box clipped by the border counts its real
        area)."""
        lam, box = 1.0, None
        if np.random.rand() < self.prob:
            if self.mixup > 0 and self.cutmix > 0:
                use_cutmix = np.random.rand() < self.switch_prob
                alpha = self.cutmix if use_cutmix else self.mixup
            else:
                use_cutmix, alpha = self.cutmix > 0, max(self.mixup, self.cutmix)
            lam = float(np.random.beta(alpha, alpha))
            if use_cutmix and lam != 1.0:  # timm mixes nothing at lam 1, nor draws a box
                corners, lam = cutmix_bbox_and_lam(shape, lam, correct_lam=True)
                box = tuple(int(c) for c in corners)
        return MixDraw(float(lam), box, self.num_classes, self.label_smoothing)


def mixed(batches: Iterator[dict], mix: MixBatches | None) -> Iterator[dict]:
    """Yields each batch mixed by `mix`, or unchanged when `mix` is None."""
    for batch in batches:
        yield batch if mix is None else mix(batch)


def build_mix(
    *, num_classes: int, mixup: float, cutmix: float, prob: float, switch_prob: float, label_smoothing: float
) -> MixBatches | None:
    """A `MixBatches`, or None when mixup == cutmix == 0 (then the loss applies `label_smoothing` itself).

    Args:
        num_classes: K, the number of classes.
        mixup: Mixup's alpha; 0 disables mixup.
        cutmix: CutMix's alpha; 0 disables cutmix.
        prob: Probability of mixing a batch.
        switch_prob: Probability of CutMix rather than Mixup when both are enabled.
        label_smoothing: Smoothing built into the soft targets (the loss must then use 0).
    """
    if mixup == 0 and cutmix == 0:
        return None
    return MixBatches(
        num_classes=num_classes,
        mixup=mixup,
        cutmix=cutmix,
        prob=prob,
        switch_prob=switch_prob,
        label_smoothing=label_smoothing,
    )
