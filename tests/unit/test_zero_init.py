"""The hook by which a ZeRO-3 build redoes timm's ViT initialisation (core/engine/zero_init.py), and its self-check.
The partitioned build itself is covered in tests/dist/test_zero_init_dist.py."""

from __future__ import annotations

import contextlib

import deepspeed
import pytest
from timm.models.vision_transformer import VisionTransformer

from core.engine import zero_init
from core.models import build_vit

TINY = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2)


def test_every_vit_built_in_the_block_is_redone_once_and_timm_is_restored_after():
    original = VisionTransformer.init_weights
    redone = []
    with zero_init._vit_init_redone(redone):
        plain = build_vit("tiny", **TINY)
        distilled = build_vit("tiny", distilled=True, **TINY)  # DeiT's init_weights reaches the ViT's via super()
    assert redone == [plain, distilled]
    assert VisionTransformer.init_weights is original
    build_vit("tiny", **TINY)
    assert len(redone) == 2


def test_build_partitioned_names_timm_when_a_vit_skipped_init_weights(monkeypatch):
    """Stand-in for a timm whose ViT no longer initialises through `init_weights`: the build stops, naming it."""
    monkeypatch.setattr(deepspeed.zero, "Init", lambda **kwargs: contextlib.nullcontext())
    with pytest.raises(RuntimeError, match=r"1 timm VisionTransformer\(s\) built but 0 initialised .*timm 1\."):
        zero_init.build_partitioned(lambda: build_vit("tiny", weight_init="skip", **TINY), ds_config={})
