"""The frozen teacher of DeiT distillation, from our export folder or any checkpoint the hand-off accepts."""

from __future__ import annotations

import timm
import torch
from torch import nn

from core.engine.setup import set_attention
from core.export.handoff import load_encoder
from core.export.read import local_path
from core.recipe.config import Config
from core.recipe.sections import DistillConfig


def load_teacher(cfg: Config, num_classes: int, logger, device: torch.device) -> nn.Module:
    """Build and load `distill.teacher` with its classifier head; frozen, in eval mode, on `device`.

    Raises:
        ValueError: A bare checkpoint without `distill.teacher_arch`, or a teacher with another number of classes.
    """
    d = cfg.distill
    path = local_path(d.teacher)  # an `hf-hub:` teacher: its folder in the Hub cache
    if teacher_is_folder(d):
        teacher = timm.create_model(f"local-dir:{path}", pretrained=True)
    else:
        size = cfg.model.img_size
        teacher = timm.create_model(d.teacher_arch, pretrained=False, num_classes=num_classes, img_size=size)
        report = load_encoder(teacher, path, keep_head=True, trust_checkpoint=cfg.model.trust_checkpoint)
        logger.console(f"[mimpipe] distillation teacher from {path}\n{report.format()}")
    if teacher.num_classes != num_classes:
        raise ValueError(f"distill.teacher {path} predicts {teacher.num_classes} classes, the task has {num_classes}")
    set_attention(teacher, cfg.engine.attention, device)
    return teacher.to(device).eval().requires_grad_(False)


def teacher_is_folder(d: DistillConfig) -> bool:
    """Whether `distill.teacher` is a folder timm rebuilds by itself (our export, any timm Hugging Face folder: its
    config.json names the architecture) rather than a bare checkpoint.

    Raises:
        ValueError: A bare checkpoint without `distill.teacher_arch`, or an `hf-hub:` teacher that is neither cached
            nor downloadable.
    """
    path = local_path(d.teacher)
    if path.is_dir() and (path / "config.json").is_file():
        return True
    if not d.teacher_arch:
        raise ValueError(f"distill.teacher {path} is a bare checkpoint: set distill.teacher_arch (a timm name)")
    return False
