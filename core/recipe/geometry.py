"""Token geometry per `model.arch`, as plain tables and arithmetic: what the schema validates shapes against and what
core/models builds from. No model code here, so loading a recipe imports no timm models."""

from __future__ import annotations

# vit_hybrid: hybrid_backbone -> (timm architecture whose ResNetV2 it builds, the backbone's stride in pixels).
HYBRID_ARCHITECTURES: dict[str, tuple[str, int]] = {
    "resnet_stem": ("vit_tiny_r_s16_p8_224", 4),
    "r26": ("vit_small_r26_s32_224", 32),
    "r50": ("vit_base_r50_s16_224", 16),
}
HYBRID_STRIDES = {name: stride for name, (_, stride) in HYBRID_ARCHITECTURES.items()}

# T2T-ViT: (kernel, stride, padding) of the three soft splits; at 224 px the grid goes 56 -> 28 -> 14 (1/16).
SOFT_SPLITS = ((7, 4, 2), (3, 2, 1), (3, 2, 1))


def soft_split_grid(img_size: tuple[int, int]) -> tuple[int, int]:
    """Token grid after the three soft splits: l_out = floor((l + 2p - k) / s) + 1 per side and split."""
    grid = img_size
    for kernel, stride, padding in SOFT_SPLITS:
        grid = tuple((side + 2 * padding - kernel) // stride + 1 for side in grid)
        if min(grid) < 1:
            raise ValueError(f"img_size {img_size} is too small for the T2T soft splits {SOFT_SPLITS}")
    return grid


# ViT sizes: `model.size` -> the width, depth and heads timm gives that size (core/models/vit.py builds them).
VIT_SIZES: dict[str, dict] = {
    "tiny": dict(embed_dim=192, depth=12, num_heads=3),
    "small": dict(embed_dim=384, depth=12, num_heads=6),
    "base": dict(embed_dim=768, depth=12, num_heads=12),
    "large": dict(embed_dim=1024, depth=24, num_heads=16),
    "huge": dict(embed_dim=1280, depth=32, num_heads=16),
}
