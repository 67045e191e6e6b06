"""Learning-rate schedule: linear warmup to the peak, then half-cosine to `min_lr`, set every optimizer step."""

from __future__ import annotations

import math


def lr_at(step: int, *, peak_lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (1-based: the first update uses step 1).

    Args:
        step: the optimizer step about to be taken, in [1, total_steps].
        peak_lr: lr reached at the end of warmup (already scaled by the global batch).
        min_lr: lr at the last step.
        warmup_steps: steps of linear warmup from 0 (0 = none).
        total_steps: schedule length.
    """
    if step <= warmup_steps:
        return peak_lr * step / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
