"""Tests for core/models/vit.py: ViT sizes, rebuild arguments and the sin-cos position embedding."""

import json
import math

import pytest
import timm
import torch

from core.models.pos_embed import sincos_pos_embed_2d
from core.models.vit import VIT_SIZES, build_vit, vit_model_args

TINY = dict(embed_dim=64, depth=2, num_heads=4)


@pytest.mark.parametrize(
    ("size", "patch_size", "architecture", "millions"),
    [
        ("base", 16, "vit_base_patch16_224", 86.6),
        ("large", 16, "vit_large_patch16_224", 304.3),
        ("huge", 14, "vit_huge_patch14_224", 632.0),
    ],
)
def test_parameter_counts_match_the_papers(size, patch_size, architecture, millions):
    with torch.device("meta"):
        model = build_vit(size, img_size=224, patch_size=patch_size, num_classes=1000)
    num_params = sum(p.numel() for p in model.parameters())
    assert round(num_params / 1e6, 1) == millions
    assert model.pretrained_cfg["architecture"] == architecture
    assert (model.embed_dim, len(model.blocks)) == (VIT_SIZES[size]["embed_dim"], VIT_SIZES[size]["depth"])


def test_unregistered_patch_size_falls_back_to_the_size_architecture():
    model = build_vit("tiny", img_size=28, patch_size=4, **TINY)
    assert model.pretrained_cfg["architecture"] == "vit_tiny_patch16_224"
    assert tuple(model.patch_embed.patch_size) == (4, 4)
    assert model.blocks[0].attn.num_heads == 4


def test_unknown_size_lists_the_sizes():
    with pytest.raises(ValueError, match="giant.*'base'.*'huge'.*'large'.*'small'.*'tiny'"):
        build_vit("giant", img_size=224, patch_size=16)


def test_image_not_divisible_by_patch_names_both():
    with pytest.raises(ValueError, match=r"\(30, 28\).*patch_size 4"):
        build_vit("tiny", img_size=(30, 28), patch_size=4, **TINY)


def test_non_square_image():
    model = build_vit("tiny", img_size=(28, 32), patch_size=4, **TINY)
    assert model.patch_embed.grid_size == (7, 8)
    assert model.pos_embed.shape == (1, 1 + 7 * 8, 64)
    features = model.forward_features(torch.randn(2, 3, 28, 32))
    assert features.shape == (2, 1 + 56, 64)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(img_size=28, patch_size=4),
        dict(img_size=(28, 32), patch_size=4, num_classes=10, global_pool="avg", qkv_bias=False, mlp_ratio=2.0),
    ],
)
def test_model_args_rebuild_the_same_model_in_timm(kwargs):
    model = build_vit("tiny", drop_path_rate=0.1, **TINY, **kwargs)
    args = json.loads(json.dumps(vit_model_args(model)))  # as stored in an exported config.json
    rebuilt = timm.create_model(model.pretrained_cfg["architecture"], pretrained=False, **args)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == expected
    assert rebuilt.global_pool == model.global_pool
    assert (rebuilt.blocks[0].attn.qkv.bias is None) == (kwargs.get("qkv_bias") is False)
    rebuilt.load_state_dict(model.state_dict(), strict=True)
    images = torch.randn(1, 3, *model.patch_embed.img_size)
    torch.testing.assert_close(rebuilt.eval()(images), model.eval()(images))


def test_sincos_values_by_hand():
    # D = 8 -> two frequencies per (axis, sin/cos): 1 and 10000 ** (-1/2) = 0.01.
    pos_embed = sincos_pos_embed_2d(8, (2, 3), num_prefix_tokens=1)
    assert pos_embed.shape == (1, 1 + 6, 8)
    assert pos_embed.dtype == torch.float32
    assert torch.equal(pos_embed[0, 0], torch.zeros(8))

    def expected(row: int, col: int) -> list[float]:
        def axis(p: int) -> list[float]:
            return [math.sin(p), math.sin(0.01 * p), math.cos(p), math.cos(0.01 * p)]

        return axis(col) + axis(row)  # column first, then row (MAE's layout)

    assert pos_embed[0, 1].tolist() == pytest.approx([0, 0, 1, 1, 0, 0, 1, 1])
    for row, col in [(0, 2), (1, 0), (1, 2)]:
        assert pos_embed[0, 1 + row * 3 + col].tolist() == pytest.approx(expected(row, col), abs=1e-7)


def test_sincos_without_prefix_and_bad_dim():
    assert sincos_pos_embed_2d(16, (3, 2), num_prefix_tokens=0).shape == (1, 6, 16)
    with pytest.raises(ValueError, match="embed_dim 6"):
        sincos_pos_embed_2d(6, (2, 2))
