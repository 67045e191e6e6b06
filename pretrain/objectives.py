"""Registry of pretraining objectives: `objective.kind` -> how to build it and how to picture its output."""

from __future__ import annotations

import torch
from torch import nn

from core.config import Config
from core.engine.stage import build_model
from pretrain.mae import MAE, reconstruction_grid


def _build_mae(cfg: Config) -> nn.Module:
    o = cfg.objective
    return MAE(
        build_model(cfg),
        mask_ratio=o.mask_ratio,
        norm_pix_loss=o.norm_pix_loss,
        decoder_embed_dim=o.decoder_embed_dim,
        decoder_depth=o.decoder_depth,
        decoder_num_heads=o.decoder_num_heads,
    )


def _picture_mae(cfg: Config, batch: dict, out: dict) -> torch.Tensor:
    return reconstruction_grid(
        batch["image"].float(),
        out["pred"].float(),
        out["mask"],
        patch_size=cfg.model.patch_size,
        mean=cfg.data.mean,
        std=cfg.data.std,
        norm_pix_loss=cfg.objective.norm_pix_loss,
    )


BUILDERS = {"mae": _build_mae}
PICTURES = {"mae": _picture_mae}


def build_objective(cfg: Config) -> nn.Module:
    """The objective module for `cfg.objective.kind`, wrapping a freshly initialised timm encoder."""
    return BUILDERS[cfg.objective.kind](cfg)


def visualize(cfg: Config, batch: dict, out: dict) -> torch.Tensor:
    """(3, H, W) picture in [0, 1] of the objective's output on `batch`, for TensorBoard."""
    return PICTURES[cfg.objective.kind](cfg, batch, out)
