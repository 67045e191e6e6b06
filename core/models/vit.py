"""timm's VisionTransformer at a named size, and the timm hybrid (a ResNetV2 whose feature map is the patch grid).

`build_vit` creates it through `timm.create_model` under a registered architecture name, so an exported
`config.json` ("architecture" + `vit_model_args`) rebuilds the same model in stock timm.

Shape legend:
    D: embedding width    gh, gw: patch grid rows, columns    N: gh * gw patches    P: prefix (cls) tokens
"""

from __future__ import annotations

from typing import Any

import timm
from timm.layers import to_2tuple
from timm.models import get_model_args
from timm.models.vision_transformer import VisionTransformer

from core.recipe.geometry import HYBRID_ARCHITECTURES, HYBRID_STRIDES
from core.recipe.geometry import VIT_SIZES as VIT_SIZES  # re-exported: the size table is a plain one

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
