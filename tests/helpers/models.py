"""Tiny timm ViTs (from `core.models.vit.build_vit`) with seeded random weights, for tests that need a model but not its
size."""

from __future__ import annotations

import torch
from timm.models.vision_transformer import VisionTransformer

from core.models.vit import build_vit
from tests.launching import TINY_MODEL

# 16 px images in 4 px patches (a 4x4 grid), 32 wide, 2 blocks of 2 heads: the recipes' model in tests/dist.
SMALL = {key: value for key, value in TINY_MODEL.items() if key != "size"}
# 28 px images in 4 px patches (the quickstart's 7x7 grid), 64 wide, 2 blocks of 4 heads.
WIDE = dict(img_size=28, patch_size=4, embed_dim=64, depth=2, num_heads=4)


def tiny_vit(seed: int = 0, **overrides) -> VisionTransformer:
    """SMALL, without a head unless `num_classes` says so; any `build_vit` keyword overrides (e.g. `distilled=True`).
    Weights drawn after seeding `seed`; in eval mode, so a forward pass is deterministic."""
    torch.manual_seed(seed)
    return build_vit("tiny", **(SMALL | overrides)).eval()


def wide_vit(seed: int = 0, **overrides) -> VisionTransformer:
    """`tiny_vit` with WIDE's shape: 28 px, 7x7 grid, 64 wide."""
    return tiny_vit(seed, **(WIDE | overrides))
