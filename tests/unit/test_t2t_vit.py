"""Tests for core/models/t2t_vit.py: sizes and parameter counts per variant, gradients, position table, timm round
trip."""

import pytest
import safetensors.torch
import timm
import torch
from timm.optim import param_groups_layer_decay

from core.models.pos_embed import sincos_pos_embed_2d
from core.models.t2t_vit import VARIANTS, T2TViT, sincos_pos_embed_1d
from core.recipe.geometry import soft_split_grid

TINY = dict(depth=2, num_classes=10)  # the T2T module at full width, a 2-block backbone


@pytest.mark.parametrize(
    ("name", "img_size", "millions"),
    [
        ("t2t_vit_14", 224, 21.5),
        ("t2t_vit_19", 224, 39.2),
        ("t2t_vit_24", 224, 64.1),
        ("t2t_vit_t_14", 224, 21.5),
        ("t2t_vit_t_19", 224, 39.2),
        ("t2t_vit_t_24", 224, 64.1),
        ("t2t_vit_14", 384, 21.7),
    ],
)
def test_parameter_counts_match_the_paper(name, img_size, millions):
    """The T2T-ViT paper's table as the authors' README gives it (yitu-opensource/T2T-ViT, "T2T-ViT Models"; at 384
    px: 21.7M), 1000 classes.

    The authors keep the fixed sin-cos table as an untrained nn.Parameter, so their counts include it (that is
    how the 384 px model gains 0.2M); here it is a buffer, added back for the comparison.
    """
    with torch.device("meta"):
        model = timm.create_model(name, img_size=img_size)
    num_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert round((num_trainable + model.pos_embed.numel()) / 1e6, 1) == millions
    assert (model.embed_dim, len(model.blocks)) == (VARIANTS[name]["embed_dim"], VARIANTS[name]["depth"])


@pytest.mark.parametrize(
    ("name", "millions"), [("t2t_vit_t_14", 21.47), ("t2t_vit_t_19", 39.08), ("t2t_vit_t_24", 64.00)]
)
def test_trained_parameter_counts_match_the_converted_official_weights(name, millions):
    """mmpretrain's table for the authors' T2T-ViT_t weights (configs/t2t_vit/README.md, 2 decimals) counts the
    trained parameters alone: the position table left out, which is where the paper's 0.1M more come from."""
    with torch.device("meta"):
        model = timm.create_model(name)
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 2) == millions


@pytest.mark.parametrize("name", list(VARIANTS))
def test_shapes_at_224_and_32(name):
    """Full width, 2 blocks; the T2T module is the same in each family, so 224 px runs once per T2T kind."""
    if name in ("t2t_vit_14", "t2t_vit_t_14"):
        model = timm.create_model(name, **TINY).eval()
        features = model.forward_features(torch.randn(1, 3, 224, 224))
        assert features.shape == (1, 1 + 14 * 14, VARIANTS[name]["embed_dim"])
        assert model.forward_head(features).shape == (1, 10)
    small = timm.create_model(name, img_size=32, **TINY)
    assert small.grid_size == (2, 2)
    assert small(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_soft_split_grid_follows_the_formula_and_rejects_tiny_images():
    assert soft_split_grid((224, 224)) == (14, 14)
    assert soft_split_grid((384, 256)) == (24, 16)
    assert soft_split_grid((28, 28)) == (2, 2)  # 28 -> 7 -> 4 -> 2
    with pytest.raises(ValueError, match="too small"):
        soft_split_grid((2, 2))


def test_wrong_input_size_names_both_sizes():
    model = timm.create_model("t2t_vit_t_14", img_size=32, **TINY)
    with pytest.raises(ValueError, match=r"\(64, 64\).*\(32, 32\)"):
        model(torch.randn(1, 3, 64, 64))


@pytest.mark.parametrize("t2t_kind", ["performer", "transformer"])
def test_every_parameter_gets_a_gradient(t2t_kind):
    model = T2TViT(img_size=32, embed_dim=64, depth=2, num_heads=2, num_classes=10, t2t_kind=t2t_kind)
    model(torch.randn(2, 3, 32, 32)).logsumexp(dim=1).sum().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
        assert torch.isfinite(param.grad).all(), name


def test_performer_features_estimate_the_softmax_kernel():
    """phi(q) . phi(k) is an unbiased estimate of exp(q . k) for Gaussian w (the module's orthogonal rows reduce its
    variance); with many features the linear attention tends to softmax attention."""
    torch.manual_seed(0)
    layer = T2TViT(img_size=32, embed_dim=64, depth=1, num_heads=2).tokens_to_token.layers[0]
    layer.w = torch.randn(20000, 64)
    q, k, v = (0.1 * torch.randn(1, 8, 64) for _ in range(3))
    phi_q, phi_k = layer.random_features(q), layer.random_features(k)  # (1, 8, 20000)
    assert torch.allclose(phi_q @ phi_k.transpose(1, 2), torch.exp(q @ k.transpose(1, 2)), rtol=0.1)
    approx = (phi_q @ (phi_k.transpose(1, 2) @ v)) / (phi_q @ phi_k.sum(1).unsqueeze(-1))
    exact = torch.softmax(q @ k.transpose(1, 2), dim=-1) @ v
    assert torch.allclose(approx, exact, atol=0.005)


@pytest.mark.parametrize("kind", ["sincos_1d", "sincos_2d"])
def test_position_table_for_another_size_matches_a_fresh_model(kind):
    """A checkpoint saved at 224 px loads at 384 px with strict=True; its table is the 384 px one."""
    at_224 = timm.create_model("t2t_vit_t_14", pos_embed_kind=kind, **TINY)
    at_384 = timm.create_model("t2t_vit_t_14", img_size=384, pos_embed_kind=kind, **TINY)
    at_384.load_state_dict(at_224.state_dict(), strict=True)
    fresh = sincos_pos_embed_2d(384, (24, 24)) if kind == "sincos_2d" else sincos_pos_embed_1d(384, 1 + 24 * 24)
    assert torch.equal(at_384.pos_embed, fresh)
    assert torch.equal(at_384.blocks[0].attn.qkv.weight, at_224.blocks[0].attn.qkv.weight)


def test_sincos_1d_table_values():
    table = sincos_pos_embed_1d(8, 3)[0]  # (3, 8)
    assert torch.equal(table[0], torch.tensor([0.0, 1.0] * 4))
    assert table[2, 0].item() == pytest.approx(torch.tensor(2.0).sin().item())
    assert table[2, 3].item() == pytest.approx(torch.tensor(2.0 / 10000 ** (2 / 8)).cos().item())


@pytest.mark.parametrize("name", ["t2t_vit_14", "t2t_vit_t_14"])
def test_safetensors_export_loads_in_timm_with_identical_outputs(tmp_path, name):
    torch.manual_seed(0)
    model = timm.create_model(name, img_size=32, **TINY).eval()
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file(model.state_dict(), path)
    loaded = timm.create_model(
        name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path), num_classes=10), img_size=32, **TINY
    ).eval()
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(loaded(x), model(x))
    loaded_state = loaded.state_dict()  # includes the Performer's fixed random features
    assert all(torch.equal(loaded_state[k], v) for k, v in model.state_dict().items())


def test_a_stored_position_table_is_ignored_on_load(tmp_path):
    """The authors' checkpoints store pos_embed; the filter drops it so the model's own table stays."""
    model = timm.create_model("t2t_vit_t_14", img_size=32, **TINY)
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file({**model.state_dict(), "pos_embed": torch.zeros(1, 5, 384)}, path)
    loaded = timm.create_model(
        "t2t_vit_t_14",
        pretrained=True,
        pretrained_cfg_overlay=dict(file=str(path), num_classes=10),
        img_size=32,
        **TINY,
    )
    assert torch.equal(loaded.pos_embed, model.pos_embed)


def test_layer_decay_groups_one_per_block_depth():
    model = timm.create_model("t2t_vit_t_14", img_size=32, depth=3, num_classes=10)
    groups = param_groups_layer_decay(
        model, weight_decay=0.05, no_weight_decay_list=model.no_weight_decay(), layer_decay=0.5
    )
    scales = sorted({g["lr_scale"] for g in groups})
    assert scales == [0.5**4, 0.5**3, 0.5**2, 0.5, 1.0]  # stem, blocks 0..2, norm + head
    by_param = {id(p): g for g in groups for p in g["params"]}
    assert by_param[id(model.cls_token)]["lr_scale"] == 0.5**4 and by_param[id(model.cls_token)]["weight_decay"] == 0
    assert by_param[id(model.tokens_to_token.project.weight)]["lr_scale"] == 0.5**4
    assert by_param[id(model.blocks[2].mlp.fc1.weight)]["lr_scale"] == 0.5
    assert by_param[id(model.head.weight)]["lr_scale"] == 1.0


def test_reset_classifier_and_pooling():
    model = timm.create_model("t2t_vit_t_14", img_size=32, **TINY).eval()
    x = torch.randn(2, 3, 32, 32)
    features = model.forward_features(x)
    model.reset_classifier(0, "avg")
    assert (model.num_classes, model.global_pool) == (0, "avg")
    assert torch.equal(model(x), features[:, 1:].mean(dim=1))
    model.reset_classifier(5)
    assert model(x).shape == (2, 5) and model.global_pool == "avg"
    with pytest.raises(ValueError, match="global_pool 'max'"):
        model.reset_classifier(5, "max")
