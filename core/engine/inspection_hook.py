"""The ViT paper's inspection pictures in TensorBoard while a stage trains (core/report/vit_pictures.py draws them):
`inspect/filters`, `inspect/position_similarity`, `inspect/attention_distance`, `inspect/attention_rollout`, at the
picture cadence (`logging.image_every_steps`, and the first and last step), for any stage whose model holds a plain
ViT (pretraining's encoder, a fine-tuned classifier, a segmentation encoder).

Rank 0 alone draws them from its own copy of the weights, so nothing is collective; under ZeRO-3 a rank holds a
slice of each weight, and the pictures are left out (`python -m finetune inspect EXPORT` draws them from the export).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from core.engine.stage import StageRun
from core.engine.stream import fixed_batch
from core.report.vit_pictures import inspectable, inspection
from data.transforms import eval_transform


def inspection_hook(run: StageRun, module: nn.Module) -> Callable[[int], None] | None:
    """`log_images(step)` drawing the inspection of the first plain ViT inside `module`, or None: no such ViT, no
    pictures asked for (`logging.image_every_steps` 0), or ZeRO-3. The same on every rank (the loop agrees on a
    stop after each picture step, a collective), and it does nothing on the ranks that do not log."""
    cfg = run.cfg
    vit = next((m for m in module.modules() if inspectable(m)), None)
    if vit is None or not cfg.logging.image_every_steps or cfg.engine.zero_stage == 3:
        return None
    if not run.logger.enabled:
        return lambda step: None
    view = eval_transform(tuple(vit.patch_embed.img_size), cfg.data.mean, cfg.data.std, crop_pct=1.0)
    images = fixed_batch(cfg, view, run.dist.device)["image"]  # the first training images, whole

    def log_images(step: int) -> None:
        with torch.no_grad():
            pictures, _ = inspection(vit, images, cfg.data.mean, cfg.data.std)
        for name, picture in pictures.items():
            run.logger.image(f"inspect/{name}", step, picture)

    return log_images


def both(*hooks: Callable[[int], None] | None) -> Callable[[int], None] | None:
    """One picture hook calling each of `hooks` that is not None, in order (None when all are)."""
    present = [hook for hook in hooks if hook is not None]
    if not present:
        return None

    def log_images(step: int) -> None:
        for hook in present:
            hook(step)

    return log_images
