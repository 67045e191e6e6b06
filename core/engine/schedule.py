"""Learning-rate schedule: linear warmup to the peak, then half-cosine to `min_lr`; and the weight decay's (constant,
or a half cosine to `optim.weight_decay_end`); both set every optimizer step."""

from __future__ import annotations

import math


def lr_at(
    step: int, *, peak_lr: float, min_lr: float, warmup_steps: int, total_steps: int, start_lr: float = 0.0
) -> float:
    """Learning rate for optimizer step `step` (1-based: the first update uses step 1).

    Args:
        step: the optimizer step about to be taken, in [1, total_steps].
        peak_lr: lr reached at the end of warmup (already scaled by the global batch).
        min_lr: lr at the last step.
        warmup_steps: steps of linear warmup from `start_lr` (0 = none).
        total_steps: schedule length.
        start_lr: where the warmup starts (I-JEPA: 2e-4; MAE: 0).
    """
    if step <= warmup_steps:
        return start_lr + (peak_lr - start_lr) * step / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def weight_decay_at(step: int, *, start: float, end: float | None, total_steps: int) -> float:
    """Weight decay for optimizer step `step`: `start` throughout without an `end`, else a half cosine from `start`
    at step 0 to `end` at the last step (I-JEPA, DINO: 0.04 -> 0.4)."""
    if end is None:
        return start
    progress = min(1.0, step / max(1, total_steps))
    return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * progress))
