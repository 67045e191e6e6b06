"""Mixup / CutMix on whole training batches, with soft targets, by timm's `Mixup` in "batch" mode.

One mixing weight lam is drawn per batch; every sample i is mixed with sample B - 1 - i (the batch flipped):
    mixup:  image = lam * x + (1 - lam) * x.flip(0)
    cutmix: one box, the same for the whole batch, is pasted from x.flip(0); lam becomes the unpasted area fraction
    label = lam * y + (1 - lam) * y.flip(0), where y is the one-hot label smoothed to (1 - s + s / K, s / K)

Randomness: timm draws lam, the mixup/cutmix switch and the box from numpy's global RNG. Mixing runs in the
training process on batches the loader has produced, so the draws advance the trainer's numpy RNG, whose state is
checkpointed with the other RNGs: a resumed run mixes as the uninterrupted one does.

Shapes: B batch size, K number of classes, H/W image height/width.
"""

from collections.abc import Iterator

import torch
from timm.data import Mixup


class MixBatches:
    """Mixup and/or CutMix applied to a batch dict, turning its class labels into soft targets.

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
        self.num_classes = num_classes
        # correct_lam: a box clipped by the image border mixes the labels by its real area
        self.mix = Mixup(
            mixup_alpha=mixup,
            cutmix_alpha=cutmix,
            prob=prob,
            switch_prob=switch_prob,
            mode="batch",
            correct_lam=True,
            label_smoothing=label_smoothing,
            num_classes=num_classes,
        )

    def __call__(self, batch: dict) -> dict:
        """Mixes one batch.

        Args:
            batch: "image" (B, 3, H, W) float, "label" (B,) int64 class indices, any other entries.

        Returns:
            A new dict (the input batch is not modified): "image" (B, 3, H, W) mixed, "label" (B, K) float32 soft
            targets whose rows sum to 1; the other entries unchanged.

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
        mixed_images, soft_labels = self.mix(images.clone(), labels)  # timm mixes in place: keep the input intact
        return {**batch, "image": mixed_images, "label": soft_labels.to(torch.float32)}


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
