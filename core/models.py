"""Builds the encoder the recipe names (`model.arch`) and the fixed 2-D sin-cos position embedding.

The backbone is a timm model created through `timm.create_model` under a registered architecture name: the plain
`VisionTransformer`, timm's hybrid (a ResNetV2 whose feature map is the patch grid), or T2T-ViT / VT-ResNet
(registered by core/t2t_vit.py and core/vt.py, imported at the end of this file). So an exported `config.json`
("architecture" + "model_args") rebuilds the same model in stock timm. `build_model` builds it from the recipe.
Nothing distributed lives here: a ZeRO-3 build redoes timm's initialisation from core/engine/zero_init.py.

Shape legend:
    D: embedding width    gh, gw: patch grid rows, columns    N: gh * gw patches    P: prefix (cls) tokens
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import timm
import torch
from timm.layers import PatchEmbed, to_2tuple
from timm.models import get_model_args
from timm.models.vision_transformer import VisionTransformer
from torch import nn

if TYPE_CHECKING:
    from core.config import Config

VIT_SIZES: dict[str, dict] = {
    "tiny": dict(embed_dim=192, depth=12, num_heads=3),
    "small": dict(embed_dim=384, depth=12, num_heads=6),
    "base": dict(embed_dim=768, depth=12, num_heads=12),
    "large": dict(embed_dim=1024, depth=24, num_heads=16),
    "huge": dict(embed_dim=1280, depth=32, num_heads=16),
}

# vit_hybrid: hybrid_backbone -> (timm architecture whose ResNetV2 it builds, the backbone's stride in pixels).
HYBRID_ARCHITECTURES: dict[str, tuple[str, int]] = {
    "resnet_stem": ("vit_tiny_r_s16_p8_224", 4),
    "r26": ("vit_small_r26_s32_224", 32),
    "r50": ("vit_base_r50_s16_224", 16),
}
HYBRID_STRIDES = {name: stride for name, (_, stride) in HYBRID_ARCHITECTURES.items()}

# timm registers every size at patch 16 except huge (patch 14 only); used when `vit_{size}_patch{p}_224` is absent.
_FALLBACK_ARCHITECTURES = {
    "tiny": "vit_tiny_patch16_224",
    "small": "vit_small_patch16_224",
    "base": "vit_base_patch16_224",
    "large": "vit_large_patch16_224",
    "huge": "vit_huge_patch14_224",
}


def _architecture_name(size: str, patch_size: int) -> str:
    """Returns the registered timm name closest to the request; model_args override its structure anyway."""
    name = f"vit_{size}_patch{patch_size}_224"
    return name if timm.is_model(name) else _FALLBACK_ARCHITECTURES[size]


def build_vit(
    size: str = "base",
    *,
    img_size: int | tuple[int, int],
    patch_size: int,
    in_chans: int = 3,
    num_classes: int = 0,
    global_pool: str = "token",
    drop_path_rate: float = 0.0,
    embed_dim: int | None = None,
    depth: int | None = None,
    num_heads: int | None = None,
    mlp_ratio: float = 4.0,
    distilled: bool = False,
    hybrid_backbone: str | None = None,
    **timm_kwargs: Any,
) -> VisionTransformer:
    """Builds a randomly initialised timm ViT of a named size, optionally with custom width/depth/heads.

    Args:
        size: One of `VIT_SIZES`; gives the default `embed_dim`, `depth` and `num_heads`.
        img_size: Input resolution, an int for square images or (height, width).
        patch_size: Side of the square patches; must divide both image sides.
        in_chans: Input image channels.
        num_classes: Classifier outputs; 0 means no head (a pure encoder).
        global_pool: timm pooling type, e.g. "token" or "avg".
        drop_path_rate: Stochastic depth rate of the last block.
        embed_dim: Overrides the size's width.
        depth: Overrides the size's number of blocks.
        num_heads: Overrides the size's number of attention heads.
        mlp_ratio: MLP hidden width relative to `embed_dim`.
        distilled: DeiT's VisionTransformerDistilled (a distillation token and head next to the class token's).
        hybrid_backbone: A key of `HYBRID_ARCHITECTURES`: timm's hybrid ViT with that ResNetV2 in front, whose
            feature map is cut into `patch_size` patches (the image must be divisible by stride x patch_size).
        **timm_kwargs: Further `VisionTransformer` arguments (e.g. `qkv_bias`, `init_values`).

    Returns:
        The model; `model.pretrained_cfg["architecture"]` and `vit_model_args(model)` rebuild it in timm.

    Raises:
        ValueError: On an unknown size or an image side not divisible by the patch size.
    """
    if size not in VIT_SIZES:
        raise ValueError(f"Unknown ViT size {size!r}; expected one of {sorted(VIT_SIZES)}")
    height, width = to_2tuple(img_size)
    if hybrid_backbone is not None and hybrid_backbone not in HYBRID_ARCHITECTURES:
        raise ValueError(f"Unknown hybrid backbone {hybrid_backbone!r}; expected one of {sorted(HYBRID_ARCHITECTURES)}")
    stride = patch_size * (HYBRID_STRIDES[hybrid_backbone] if hybrid_backbone else 1)
    if height % stride or width % stride:
        by = f" x the {hybrid_backbone} backbone's stride" if hybrid_backbone else ""
        raise ValueError(f"img_size {(height, width)} is not divisible by patch_size {patch_size}{by} ({stride} px)")
    dims = VIT_SIZES[size]
    model_args = dict(
        img_size=(height, width),
        patch_size=patch_size,
        in_chans=in_chans,
        num_classes=num_classes,
        global_pool=global_pool,
        drop_path_rate=drop_path_rate,
        embed_dim=dims["embed_dim"] if embed_dim is None else embed_dim,
        depth=dims["depth"] if depth is None else depth,
        num_heads=dims["num_heads"] if num_heads is None else num_heads,
        mlp_ratio=mlp_ratio,
        **timm_kwargs,
    )
    name = _architecture_name(size, patch_size)
    if hybrid_backbone is not None:
        name = HYBRID_ARCHITECTURES[hybrid_backbone][0]
    if distilled:
        name = f"deit_{size}_distilled_patch16_224"
        name = name if timm.is_model(name) else "deit_base_distilled_patch16_224"  # model_args set the shape anyway
    return timm.create_model(name, pretrained=False, **model_args)


def build_model(cfg: Config, num_classes: int = 0, *, plain: bool = False) -> nn.Module:
    """The timm model `model.arch` describes (DeiT's distilled ViT when fine-tuning with `distill`, unless `plain`).

    Every arch is built by `timm.create_model` under a registered name (T2T-ViT and VT-ResNet are registered by
    core/t2t_vit.py and core/vt.py), so `model_args` + that name rebuild it in timm.

    Args:
        cfg: The recipe; `model` gives the architecture, `engine.activation_checkpointing` the gradient checkpointing.
        num_classes: Classifier outputs; 0 means no head (a pure encoder).
        plain: Build the plain ViT even when the recipe distills.
    """
    m = cfg.model
    global_pool = "token" if m.global_pool == "auto" else m.global_pool  # fine-tuning resolves auto first
    widths = {k: v for k, v in dict(embed_dim=m.embed_dim, depth=m.depth, num_heads=m.num_heads).items() if v}
    if m.arch == "t2t_vit":
        model = timm.create_model(
            f"t2t_vit_{m.t2t_variant}", img_size=m.img_size, num_classes=num_classes, global_pool=global_pool,
            drop_path_rate=m.drop_path_rate, **widths,
        )  # fmt: skip
    elif m.arch == "vt_resnet":
        model = timm.create_model(
            f"vt_resnet{m.vt_variant}", img_size=m.img_size, num_classes=num_classes, drop_path_rate=m.drop_path_rate,
            **({"token_dim": m.embed_dim} if m.embed_dim else {}),
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


def vit_model_args(model: VisionTransformer) -> dict[str, Any]:
    """Returns the keyword arguments that rebuild `model` with `timm.create_model(architecture, **args)`.

    timm's recorded construction arguments (which keep extra options such as `qkv_bias`) are completed with the
    structure read from the model itself, so the result does not depend on how the model was created. Runtime-only
    options (drop rates) are left out, as timm does.

    Args:
        model: A timm VisionTransformer.

    Returns:
        JSON-serialisable arguments (tuples become lists in JSON, which timm accepts).
    """
    first_block = model.blocks[0]
    args = get_model_args(model)
    args.update(
        img_size=tuple(model.patch_embed.img_size),
        patch_size=tuple(model.patch_embed.patch_size),
        in_chans=model.patch_embed.proj.in_channels,
        num_classes=model.num_classes,
        global_pool=model.global_pool,
        embed_dim=model.embed_dim,
        depth=len(model.blocks),
        num_heads=first_block.attn.num_heads,
        class_token=model.has_class_token,
        reg_tokens=model.num_reg_tokens,
        no_embed_class=model.no_embed_class,
    )
    # Block sizes its MLP as int(dim * mlp_ratio); the recorded ratio is exact, the derived one may round.
    args.setdefault("mlp_ratio", first_block.mlp.fc1.out_features / model.embed_dim)
    return args


def sincos_pos_embed_2d(embed_dim: int, grid_size: tuple[int, int], num_prefix_tokens: int = 1) -> torch.Tensor:
    """Fixed 2-D sin-cos position embedding with MAE's layout.

    Patches are numbered row-major. The first half of the channels encodes the column index, the second half the
    row index; each half is [sin(pos * w_k) for k] followed by [cos(pos * w_k) for k], with
    w_k = 10000 ** (-k / (embed_dim / 4)), k = 0 .. embed_dim / 4 - 1. Prefix tokens get zeros.

    Args:
        embed_dim: Channels D; must be divisible by 4.
        grid_size: (gh, gw) patch grid.
        num_prefix_tokens: Leading zero rows for cls/register tokens.

    Returns:
        (1, P + gh * gw, D) float32 tensor.
    """
    if embed_dim % 4:
        raise ValueError(f"embed_dim {embed_dim} must be divisible by 4 for a 2-D sin-cos position embedding")
    num_freqs = embed_dim // 4
    freqs = 1.0 / 10000 ** (torch.arange(num_freqs, dtype=torch.float64) / num_freqs)  # (D/4,)
    rows, cols = torch.meshgrid(
        torch.arange(grid_size[0], dtype=torch.float64), torch.arange(grid_size[1], dtype=torch.float64), indexing="ij"
    )  # (gh, gw) each

    def encode(positions: torch.Tensor) -> torch.Tensor:
        angles = positions.reshape(-1, 1) * freqs  # (N, D/4)
        return torch.cat([angles.sin(), angles.cos()], dim=1)  # (N, D/2)

    patches = torch.cat([encode(cols), encode(rows)], dim=1)  # (N, D)
    prefix = torch.zeros(num_prefix_tokens, embed_dim, dtype=torch.float64)  # (P, D)
    return torch.cat([prefix, patches], dim=0).float().unsqueeze(0)  # (1, P + N, D)


# Registers t2t_vit_* and vt_resnet* with timm; imported last since both modules import this one.
from core import t2t_vit as _t2t_vit  # noqa: E402, F401
from core import vt as _vt  # noqa: E402, F401
