"""Counting metrics shared by the stages: fine-tuning evaluation and the kNN monitor of pretraining."""

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
