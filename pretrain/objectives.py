"""Registry of pretraining objectives: `objective.kind` -> how to build it, what its data transform adds to each
sample (masks and views made in the data workers). How each is pictured is in pretrain/pictures.py."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

from torch import nn

from core.export.manifest import MANIFEST_NAME
from core.models.build import build_model
from core.recipe.config import Config, ijepa_masks
from core.recipe.sections import BEiTObjective, BlockwiseMask, SimMIMObjective
from core.recipe.teacher_sections import Data2Vec2Objective, IJEPAObjective
from data.masking import (
    BlockwiseMaskGenerator,
    InverseBlockMaskGenerator,
    MaskStack,
    RandomMaskGenerator,
    UnitMaskGenerator,
)
from data.multiblock import WithBatchMasks
from data.transforms import TwoViewCropFlip, WithMask, pretrain_transform
from pretrain.beit import MaskedPatchPrediction
from pretrain.data2vec2 import Data2Vec2
from pretrain.ijepa import IJEPA
from pretrain.mae import MAE
from pretrain.simmim import SimMIM
from pretrain.targets import Color3Bit4x4, MeanColor3Bit, PixelsL2, TokenizerCodes
from pretrain.tokenizer import load_tokenizer


def _mae_builder(cfg: Config) -> Callable[[], nn.Module]:
    o = cfg.objective
    return lambda: MAE(
        build_model(cfg),
        mask_ratio=o.mask_ratio,
        norm_pix_loss=o.norm_pix_loss,
        decoder_embed_dim=o.decoder_embed_dim,
        decoder_depth=o.decoder_depth,
        decoder_num_heads=o.decoder_num_heads,
    )


def _beit_builder(cfg: Config) -> Callable[[], nn.Module]:
    o: BEiTObjective = cfg.objective
    patch = (cfg.model.pixel_stride, cfg.model.pixel_stride)  # pixels per token (a hybrid's or T2T's too)
    kind = o.target.kind
    if kind == "mean_color_3bit":
        target = MeanColor3Bit(patch, cfg.data.mean, cfg.data.std)
    elif kind == "color_3bit_4x4":
        target = Color3Bit4x4(patch, cfg.data.mean, cfg.data.std)
    elif kind == "pixels_l2":
        target = PixelsL2(patch, norm_pix=o.target.norm_pix)
    else:
        target = TokenizerCodes(load_tokenizer(o.target.path), cfg.model.grid)
    num_masked = mask_generator(cfg).num_masked  # every mask the data workers make selects exactly this many
    return lambda: MaskedPatchPrediction(
        build_model(cfg), target, num_masked=num_masked, corruption=o.corruption, head=o.head
    )


def _simmim_builder(cfg: Config) -> Callable[[], nn.Module]:
    return lambda: SimMIM(build_model(cfg))


def _data2vec2_builder(cfg: Config) -> Callable[[], nn.Module]:
    o: Data2Vec2Objective = cfg.objective
    num_masked = mask_generator(cfg).num_masked  # every copy the data workers mask hides exactly this many tokens
    return lambda: Data2Vec2(
        build_model(cfg),
        build_model(cfg),  # the teacher: built beside the student, so ZeRO-3 partitions it the same way
        ema=o.ema,
        decoder=o.decoder,
        top_k_blocks=o.top_k_blocks,
        num_masked=num_masked,
        cls_loss_weight=o.cls_loss_weight,
        mask_noise_std=o.mask_noise_std,
    )


def _ijepa_builder(cfg: Config) -> Callable[[], nn.Module]:
    o: IJEPAObjective = cfg.objective
    return lambda: IJEPA(
        build_model(cfg),
        build_model(cfg),  # the target encoder: built beside the context encoder, partitioned with it under ZeRO-3
        ema=o.ema,
        predictor=o.predictor,
        loss=o.loss,
    )


def _mae_transform(cfg: Config):
    d = cfg.data
    return pretrain_transform(cfg.model.img_size, d.mean, d.std, scale=d.crop_scale, decode=d.decode, hflip=d.hflip)


def _beit_transform(cfg: Config):
    o: BEiTObjective = cfg.objective
    if o.target.kind == "tokenizer":
        manifest = tokenizer_manifest(o.target.path)
        crop = TwoViewCropFlip(
            cfg.model.img_size,
            manifest["tokenizer"]["img_size"],
            cfg.data.mean,
            cfg.data.std,
            manifest["mean"],
            manifest["std"],
            scale=cfg.data.crop_scale,
        )
    else:
        crop = _mae_transform(cfg)
    return WithMask(crop, mask_generator(cfg))


def _simmim_transform(cfg: Config):
    return WithMask(_mae_transform(cfg), mask_generator(cfg))


def _data2vec2_transform(cfg: Config):
    return WithMask(_mae_transform(cfg), MaskStack(mask_generator(cfg), cfg.objective.num_masks))


def _ijepa_transform(cfg: Config):
    return WithBatchMasks(_mae_transform(cfg), ijepa_masks(cfg.objective, cfg.model.grid))


def mask_generator(cfg: Config):
    """The recipe's patch-mask generator for the encoder's grid (called once per sample, per copy for data2vec 2.0,
    in the data workers)."""
    if isinstance(cfg.objective, Data2Vec2Objective):
        o = cfg.objective
        return InverseBlockMaskGenerator(cfg.model.grid, o.mask_ratio, block_size=o.mask_block, adjust=o.mask_adjust)
    if isinstance(cfg.objective, SimMIMObjective):
        o = cfg.objective
        return UnitMaskGenerator(cfg.model.grid, o.mask_patch_size, o.mask_ratio)
    m, grid = cfg.objective.mask, cfg.model.grid
    if isinstance(m, BlockwiseMask):
        return BlockwiseMaskGenerator(
            grid,
            m.budget(math.prod(grid)),
            min_patches=m.min_patches,
            max_patches=m.max_patches,
            aspect_ratio=m.aspect_ratio,
            tries=m.tries,
        )
    return RandomMaskGenerator(grid, m.ratio)


def tokenizer_manifest(path: str | Path) -> dict:
    """The `mimpipe.json` of a tokenizer export (architecture, normalisation)."""
    file = Path(path) / MANIFEST_NAME
    if not file.is_file():
        raise ValueError(f"objective.target.path {path}: no {MANIFEST_NAME} (expected a `stage: tokenizer` export)")
    return json.loads(file.read_text())


BUILDERS = {
    "mae": _mae_builder,
    "beit": _beit_builder,
    "simmim": _simmim_builder,
    "data2vec2": _data2vec2_builder,
    "ijepa": _ijepa_builder,
}
TRANSFORMS = {
    "mae": _mae_transform,
    "beit": _beit_transform,
    "simmim": _simmim_transform,
    "data2vec2": _data2vec2_transform,
    "ijepa": _ijepa_transform,
}


def objective_builder(cfg: Config) -> Callable[[], nn.Module]:
    """The function that builds the objective module for `cfg.objective.kind` around a freshly initialised timm
    encoder. What the objective only reads (the target, a frozen tokenizer) is made now, outside the function, so
    that under ZeRO-3 only trainable modules are built inside deepspeed.zero.Init (see core/engine/zero_init.py)."""
    return BUILDERS[cfg.objective.kind](cfg)


def train_transform(cfg: Config):
    """The per-sample training transform of `cfg.objective.kind` (augmentation, plus masks and extra views)."""
    return TRANSFORMS[cfg.objective.kind](cfg)
