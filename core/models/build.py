"""Builds the encoder the recipe names (`model.arch`): every arch through `timm.create_model` under a registered name
(the plain ViT and timm's hybrid: core/models/vit.py; T2T-ViT and VT-ResNet: registered by core/models/t2t_vit.py and
core/models/vt.py, imported here for that; timm's ResNet as it is), so `model_args` + that name rebuild it in stock
timm. Nothing distributed lives here: a ZeRO-3 build redoes timm's initialisation from core/engine/zero_init.py."""

from __future__ import annotations

from typing import Any

import timm
from timm.layers import PatchEmbed
from timm.models import get_model_args
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from core.models import t2t_vit as _t2t_vit  # noqa: F401  (registers t2t_vit_* with timm)
from core.models import vt as _vt  # noqa: F401  (registers vt_resnet* with timm)
from core.models.vit import build_vit, vit_model_args
from core.recipe.config import Config


def build_model(cfg: Config, num_classes: int = 0, *, plain: bool = False) -> nn.Module:
    """The timm model `model.arch` describes (DeiT's distilled ViT when fine-tuning with `distill`, unless `plain`).

    Every arch is built by `timm.create_model` under a registered name (T2T-ViT and VT-ResNet are registered by
    core/models/t2t_vit.py and core/models/vt.py), so `model_args` + that name rebuild it in timm.

    Args:
        cfg: The recipe; `model` gives the architecture, `engine.activation_checkpointing` the gradient checkpointing.
        num_classes: Classifier outputs; 0 means no head (a pure encoder).
        plain: Build the plain ViT even when the recipe distills.
    """
    m = cfg.model
    global_pool = ("token" if m.class_token else "avg") if m.global_pool == "auto" else m.global_pool  # fine-tuning
    # resolves auto first; an encoder without a class token pools by averaging
    widths = {k: v for k, v in dict(embed_dim=m.embed_dim, depth=m.depth, num_heads=m.num_heads).items() if v}
    if m.arch == "t2t_vit":
        model = timm.create_model(
            f"t2t_vit_{m.t2t_variant}", img_size=m.img_size, num_classes=num_classes, global_pool=global_pool,
            drop_path_rate=m.drop_path_rate, **widths,
        )  # fmt: skip
    elif m.arch == "resnet":  # timm's own; any image size (no position table)
        model = timm.create_model(f"resnet{m.resnet_variant}", num_classes=num_classes, drop_path_rate=m.drop_path_rate)
    elif m.arch == "vt_resnet":
        model = timm.create_model(
            f"vt_resnet{m.vt_variant}", img_size=m.img_size, num_classes=num_classes, drop_path_rate=m.drop_path_rate,
            tokenizer=m.vt_tokenizer, **({"token_dim": m.embed_dim} if m.embed_dim else {}),
        )  # fmt: skip
    else:
        model = build_vit(
            m.size,
            img_size=m.img_size,
            patch_size=m.patch_size,
            num_classes=num_classes,
            global_pool=global_pool,
            drop_path_rate=m.drop_path_rate,
            embed_dim=m.embed_dim,
            depth=m.depth,
            num_heads=m.num_heads,
            distilled=not plain and cfg.stage == "finetune" and cfg.distill.kind != "none",
            hybrid_backbone=m.hybrid_backbone if m.arch == "vit_hybrid" else None,
            **({"init_values": m.layer_scale_init} if m.layer_scale_init is not None else {}),
            **({"reg_tokens": m.reg_tokens} if m.reg_tokens else {}),
            **({} if m.class_token else no_class_token(cfg.stage)),
        )
    if cfg.engine.activation_checkpointing:  # config.py allows it only for the archs that have it
        model.set_grad_checkpointing(True)
    return model


def model_args(model: nn.Module) -> dict[str, Any]:
    """The keyword arguments that rebuild any arch `build_model` makes with `timm.create_model(architecture, ...)`:
    `vit_model_args` for a ViT with a patch embedding, timm's recorded arguments otherwise (a hybrid's backbone is
    fixed by its architecture name; T2T-ViT and VT-ResNet record every argument they were built with)."""
    if isinstance(model, VisionTransformer) and isinstance(model.patch_embed, PatchEmbed):
        return vit_model_args(model)
    args = get_model_args(model)
    if isinstance(model, VisionTransformer):  # hybrid: the width and depth as built, whatever was passed
        args.update(embed_dim=model.embed_dim, depth=len(model.blocks), num_heads=model.blocks[0].attn.num_heads)
    return args


def no_class_token(stage: str) -> dict[str, Any]:
    """timm's arguments of a ViT without a class token (`model.class_token: false`). Pretraining keeps the final norm
    on every token (`fc_norm` off), as I-JEPA's encoders do: its objectives read the normalised tokens, and the export
    pools them by average. Fine-tuning keeps timm's average-pool layout, whose norm follows the pooling."""
    return {"class_token": False, **({"fc_norm": False} if stage == "pretrain" else {})}
