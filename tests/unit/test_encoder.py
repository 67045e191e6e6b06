"""pretrain/encoder.py: the encoder pass MAE and BEiT-style prediction share is timm's own forward over all patches,
and encoders of another layout are refused with every problem named."""

import pytest
import timm
import torch

from pretrain.encoder import check_encoder, forward_encoder, patch_positions

ARGS = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=0)


def test_all_patches_give_timms_forward_features():
    torch.manual_seed(0)
    encoder = timm.create_model("vit_tiny_patch16_224", pretrained=False, **ARGS).eval()
    images = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        ours = forward_encoder(encoder, encoder.patch_embed(images) + patch_positions(encoder))  # (2, 1 + 16, 32)
        torch.testing.assert_close(ours, encoder.forward_features(images), rtol=0, atol=0)


def test_visible_patches_only_give_one_output_per_token_plus_the_class_token():
    encoder = timm.create_model("vit_tiny_patch16_224", pretrained=False, **ARGS).eval()
    tokens = (encoder.patch_embed(torch.randn(2, 3, 16, 16)) + patch_positions(encoder))[:, :5]  # (2, 5, 32)
    assert forward_encoder(encoder, tokens).shape == (2, 6, 32)


def test_register_tokens_follow_the_class_token_as_in_timms_forward_features():
    """model.reg_tokens: the prefix is the class token, then the registers, each with its position (timm's order)."""
    torch.manual_seed(0)
    encoder = timm.create_model("vit_tiny_patch16_224", pretrained=False, **ARGS, reg_tokens=4).eval()
    with torch.no_grad():
        encoder.pos_embed.normal_()  # timm leaves the prefix positions at a draw too small to tell them apart
    images = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        ours = forward_encoder(encoder, encoder.patch_embed(images) + patch_positions(encoder))  # (2, 5 + 16, 32)
        torch.testing.assert_close(ours, encoder.forward_features(images), rtol=0, atol=0)
    assert patch_positions(encoder).shape == (1, 16, 32)


def test_other_layouts_are_refused_naming_the_objective_and_every_problem():
    check_encoder(timm.create_model("vit_tiny_patch16_224", pretrained=False, **ARGS), "MAE", token_pool=True)
    pooled = timm.create_model("vit_tiny_patch16_224", pretrained=False, **{**ARGS, "global_pool": "avg"})
    check_encoder(pooled, "masked-patch prediction")  # pooling matters only where asked for
    with pytest.raises(ValueError, match=r"^MAE encoder: global_pool must be 'token', got 'avg'$"):
        check_encoder(pooled, "MAE", token_pool=True)
    odd = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        **{**ARGS, "num_classes": 3, "reg_tokens": 2, "dynamic_img_size": True},
    )
    with pytest.raises(ValueError) as caught:
        check_encoder(odd, "masked-patch prediction")
    assert str(caught.value) == (  # register tokens are prefix tokens like the class token: allowed
        "masked-patch prediction encoder: num_classes must be 0, got 3; dynamic_img_size must be False"
    )
