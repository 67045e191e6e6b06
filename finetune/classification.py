"""The fine-tuning objective: image classification with a timm ViT and cross-entropy (optionally label-smoothed).

Shapes: B batch, K classes, H/W image height/width.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from timm.models import VisionTransformer
from torch import nn


class Classification(nn.Module):
    """Wraps the ViT (with its K-class head) and returns the loss and the scalars to log.

    Args:
        model: timm ViT with a classification head (`num_classes` > 0).
        label_smoothing: Probability mass spread uniformly over the K classes, in [0, 1).
    """

    def __init__(self, model: VisionTransformer, *, label_smoothing: float = 0.0):
        super().__init__()
        if model.num_classes <= 0:
            raise ValueError(f"Classification needs a model with a head; model.num_classes is {model.num_classes}")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        self.model = model
        self.label_smoothing = label_smoothing

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Classify a batch.

        Args:
            batch: "image" (B, 3, H, W) and "label": class indices (B,), or class probabilities (B, K) as made
                by mixup / cutmix (which smooth labels themselves; keep label_smoothing 0 with them).

        Returns:
            "loss": fp32 scalar cross-entropy, "acc1": fp32 scalar top-1 accuracy of this batch (against the
            most probable class for soft labels), "logits": (B, K) fp32.
        """
        labels = batch["label"]
        logits = self.model(batch["image"]).float()  # (B, K); fp32 even under bf16 autocast
        loss = F.cross_entropy(logits, labels, label_smoothing=self.label_smoothing)
        hard_labels = labels.argmax(dim=-1) if labels.ndim == 2 else labels  # (B,)
        acc1 = (logits.argmax(dim=-1) == hard_labels).float().mean()
        return {"loss": loss, "acc1": acc1, "logits": logits}

    def no_weight_decay(self) -> set[str]:
        """Full parameter names kept out of weight decay: position embedding and prefix tokens (timm's list)."""
        names = {name for name, _ in self.named_parameters()}
        return {f"model.{name}" for name in self.model.no_weight_decay()} & names

    def group_matcher(self, coarse: bool = False) -> dict:
        """timm's parameter groups of the ViT (for layer-wise lr decay), re-rooted at this wrapper's `model.`."""
        return {group: reroot_rule(rule, "model.") for group, rule in self.model.group_matcher(coarse).items()}


def reroot_rule(rule, prefix: str):
    """A timm group-matcher rule (regex, or list of (regex, ordinal)) matching the same names under `prefix`.

    timm applies rules with `re.match`, so every alternative of `a|b` is anchored at the start of the name; an
    alternative's own `^` (T2T-ViT's `^cls_token|^tokens_to_token`) is dropped, as it could never match after the
    prefix."""
    if isinstance(rule, str):
        alternatives = "|".join(part.removeprefix("^") for part in rule.split("|"))
        return f"^{re.escape(prefix)}(?:{alternatives})"
    return [(reroot_rule(regex, prefix), ordinal) for regex, ordinal in rule]
