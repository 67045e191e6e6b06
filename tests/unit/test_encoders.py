"""The other encoders (`model.arch`: vit_hybrid, t2t_vit, vt_resnet) through the pipeline: recipe checks, build,
SimMIM, the fine-tuning hand-off at another resolution, layer decay groups, export -> plain timm load."""

import math

import pytest
import timm
import torch
from timm.optim import param_groups_layer_decay

import core.models.build  # noqa: F401  (registers t2t_vit_* and vt_resnet* with timm)
from core.export.folder import export_state_dict
from core.export.handoff import load_encoder
from core.models.build import build_model
from core.recipe.config import ConfigError, load_config
from data.masking import UnitMaskGenerator
from finetune.classification import Classification
from pretrain.objectives import objective_builder

TINY = ["model.embed_dim=32", "model.depth=2", "model.num_heads=2"]
ARCHS = {
    "vit": ["model.patch_size=8"],
    "vit_hybrid": ["model.arch=vit_hybrid", "model.hybrid_backbone=resnet_stem", "model.patch_size=2"],
    "t2t_vit": ["model.arch=t2t_vit", "model.t2t_variant=t_14", "objective.mask_patch_size=1"],
}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def simmim_cfg(arch: str, img_size: int = 32):
    return load_config(None, ["objective.kind=simmim", f"model.img_size={img_size}", *TINY, *ARCHS[arch]])


def finetune_cfg(arch: str, img_size: int = 32, extra=()):
    args = [a for a in ARCHS.get(arch, [f"model.arch={arch}"]) if not a.startswith("objective.")]
    return load_config(None, ["stage=finetune", f"model.img_size={img_size}", *TINY, *args, *extra])


def simmim_batch(cfg, objective, seed=0):
    torch.manual_seed(seed)
    gen = UnitMaskGenerator(cfg.model.grid, cfg.objective.mask_patch_size, cfg.objective.mask_ratio)
    masks = torch.stack([gen(), gen()])  # (2, gh, gw)
    return {"image": torch.randn(2, 3, *cfg.model.image_hw), "mask": masks}


@pytest.mark.parametrize("arch", ["vit", "vit_hybrid", "t2t_vit"])
def test_simmim_loss_covers_only_masked_pixels(arch):
    cfg = simmim_cfg(arch)
    torch.manual_seed(0)
    objective = objective_builder(cfg)().eval()
    batch = simmim_batch(cfg, objective)
    pixel_mask = objective.pixel_mask(batch["mask"]).expand_as(batch["image"])  # (B, 3, H, W)
    with torch.no_grad():
        pred = objective.forward_decoder(objective.forward_encoder(batch["image"], batch["mask"]))
        loss = objective.forward_loss(batch["image"], pred, batch["mask"])
        visible_changed = torch.where(pixel_mask, batch["image"], batch["image"] + 5.0)
        masked_changed = torch.where(pixel_mask, batch["image"] + 5.0, batch["image"])
        same = objective.forward_loss(visible_changed, pred, batch["mask"])
        other = objective.forward_loss(masked_changed, pred, batch["mask"])
    assert torch.equal(same, loss)
    assert not torch.allclose(other, loss)
    expected = (pred - batch["image"]).abs()[pixel_mask].mean()  # mean over the masked pixel values
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize("arch", ["vit_hybrid", "t2t_vit"])
def test_simmim_hides_masked_pixels_from_overlapping_stems(arch):
    """Changing masked pixels changes nothing the hybrid's / T2T's encoder sees (they are zeroed before the stem)."""
    cfg = simmim_cfg(arch)
    objective = objective_builder(cfg)().eval()
    batch = simmim_batch(cfg, objective)
    pixel_mask = objective.pixel_mask(batch["mask"]).expand_as(batch["image"])
    changed = torch.where(pixel_mask, torch.randn_like(batch["image"]), batch["image"])
    with torch.no_grad():
        latent = objective.forward_encoder(batch["image"], batch["mask"])
        assert torch.equal(objective.forward_encoder(changed, batch["mask"]), latent)
    assert objective.mask_pixels


@pytest.mark.parametrize("arch", ["vit", "vit_hybrid", "t2t_vit"])
def test_simmim_every_parameter_gets_a_gradient(arch):
    cfg = simmim_cfg(arch)
    objective = objective_builder(cfg)()
    out = objective(simmim_batch(cfg, objective))
    out["loss"].backward()
    assert torch.isfinite(out["loss"])
    assert out["pred"].shape == (2, 3, 32, 32)
    missing = [n for n, p in objective.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []
    assert objective.no_weight_decay() >= {"mask_token", "encoder.cls_token"}


def test_unit_masks_cover_whole_units_with_ceil_of_the_ratio():
    gen = UnitMaskGenerator((8, 6), 2, 0.6)
    mask = gen()
    units = mask.view(4, 2, 3, 2).permute(0, 2, 1, 3).reshape(12, 4)  # (units, 4 patches each)
    assert ((units.all(1)) | (~units.any(1))).all()  # each unit fully masked or fully visible
    assert units.all(1).sum() == math.ceil(0.6 * 12)
    with pytest.raises(ValueError, match="does not divide"):
        UnitMaskGenerator((7, 7), 2, 0.6)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            ["model.arch=t2t_vit"],
            "objective.kind mae needs model.arch vit.*it drops the masked tokens.*use objective.kind simmim",
        ),
        (["model.arch=vt_resnet", "objective.kind=simmim"], "VT is fine-tuned only"),
        (["objective.kind=simmim", "model.img_size=28", "model.patch_size=4"], "mask_patch_size 2 does not divide"),
        (["model.arch=t2t_vit", "objective.kind=simmim", "model.img_size=28"], "divisible by 16"),
        (["model.arch=vit_hybrid", "model.hybrid_backbone=r50", "model.patch_size=1", "model.img_size=40"], "16"),
        (["model.arch=t2t_vit", "engine.activation_checkpointing=true", "objective.kind=simmim"], "vit_hybrid"),
        (["stage=finetune", "model.arch=vt_resnet", "model.global_pool=token"], "averages its visual tokens"),
        (["stage=finetune", "model.arch=vit_hybrid", "distill.kind=soft", "distill.teacher=x"], "distill needs"),
    ],
)
def test_arch_cross_checks_name_the_fields(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_hybrid_patch_defaults_to_one_feature_map_cell():
    cfg = load_config(None, ["model.arch=vit_hybrid", "objective.kind=simmim"])  # r50: stride 16 at 224 px
    assert cfg.model.patch_size == 1 and cfg.model.grid == (14, 14) and cfg.model.pixel_stride == 16
    assert load_config(None, []).model.patch_size == 16


def test_hybrid_and_t2t_grids_in_the_recipe_match_the_built_models():
    for arch, img_size in (("vit_hybrid", 32), ("t2t_vit", 48)):
        cfg = finetune_cfg(arch, img_size)
        model = build_model(cfg, num_classes=3)
        grid = model.patch_embed.grid_size if arch == "vit_hybrid" else model.grid_size
        assert tuple(grid) == cfg.model.grid
        assert model(torch.randn(1, 3, img_size, img_size)).shape == (1, 3)


@pytest.mark.parametrize("arch", ["vit_hybrid", "t2t_vit"])
def test_handoff_to_another_resolution_resizes_the_grid(tmp_path, arch):
    """Pretrained at 32 px, fine-tuned at 48 px: the hybrid's pos_embed is interpolated, T2T's table rebuilt."""
    cfg = simmim_cfg(arch)
    torch.manual_seed(0)
    encoder = objective_builder(cfg)().encoder
    export = export_state_dict(cfg, encoder.state_dict(), tmp_path / "export", num_classes=0, manifest={})
    ft_cfg = finetune_cfg(arch, 48)
    model = build_model(ft_cfg, num_classes=5)
    report = load_encoder(model, export)
    assert model.get_classifier().weight.abs().sum() == 0 and report.head_init == "zero weight and bias"
    source, target = cfg.model.grid, ft_cfg.model.grid
    assert source != target
    if arch == "vit_hybrid":
        assert report.resized == [("pos_embed", source, target)]
        assert model.pos_embed.shape[1] == 1 + math.prod(target)
        assert torch.equal(model.patch_embed.backbone.conv.weight, encoder.patch_embed.backbone.conv.weight)
    else:
        assert any("rebuilt for the 3x3 token grid (checkpoint: 2x2)" in note for note in report.notes)
        assert torch.equal(model.blocks[0].attn.qkv.weight, encoder.blocks[0].attn.qkv.weight)
    assert model(torch.randn(2, 3, 48, 48)).shape == (2, 5)


@pytest.mark.parametrize("arch", ["vit", "vit_hybrid", "t2t_vit", "vt_resnet"])
def test_export_loads_in_plain_timm_with_identical_outputs(tmp_path, arch):
    cfg = finetune_cfg(arch)
    torch.manual_seed(0)
    model = build_model(cfg, num_classes=4).eval()
    with torch.no_grad():
        model.get_classifier().weight.normal_()  # a head that matters for the comparison
    out = export_state_dict(cfg, model.state_dict(), tmp_path / "export", num_classes=4, manifest={"method": "x"})
    loaded = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    assert type(loaded) is type(model)


@pytest.mark.parametrize("arch", ["vit_hybrid", "t2t_vit", "vt_resnet"])
def test_layer_decay_groups_come_from_each_group_matcher(arch):
    model = build_model(finetune_cfg(arch), num_classes=4)
    groups = param_groups_layer_decay(Classification(model), weight_decay=0.05, layer_decay=0.5)
    scales = sorted({g["lr_scale"] for g in groups})
    assert len(scales) >= 3 and scales[-1] == 1.0  # stem lowest, blocks between, head at the full lr
    stem = [g for g in groups if g["lr_scale"] == scales[0]]
    stem_names = {n for n, p in model.named_parameters() if any(p is q for g in stem for q in g["params"])}
    first = {"vit_hybrid": "patch_embed.", "t2t_vit": "tokens_to_token.", "vt_resnet": "conv1."}[arch]
    assert stem_names and all(not n.startswith(("blocks.", "layer4.")) for n in stem_names)
    assert any(n.startswith(first) for n in stem_names)


def test_simmim_reconstruction_picture_shows_four_panels_per_image():
    from pretrain.pictures import PICTURES

    cfg = simmim_cfg("vit_hybrid")
    objective = objective_builder(cfg)().eval()
    batch = simmim_batch(cfg, objective)
    with torch.no_grad():
        out = objective(batch)
    tag, draw, _ = PICTURES["simmim"]
    picture = draw(cfg, batch, out)
    assert tag == "train/reconstruction" and picture.shape[0] == 3
    assert picture.min() >= 0 and picture.max() <= 1 and picture.shape[2] > picture.shape[1]  # 4 panels wide


def test_preflight_describes_every_encoder_from_its_shapes():
    """`model.init` is described by `launch.sh`'s pre-flight from the checkpoint's shapes, whatever the arch."""
    from finetune.preflight import describe_encoder

    t2t = timm.create_model("t2t_vit_t_14", img_size=32, embed_dim=32, depth=3, num_heads=2)
    vt = timm.create_model("vt_resnet34", token_dim=64)
    hybrid = build_model(finetune_cfg("vit_hybrid", 32))
    assert describe_encoder(t2t.state_dict()) == "T2T-ViT 32 wide, 3 blocks"
    assert describe_encoder(vt.state_dict()) == "VT-ResNet, tokens 64 wide, 3 VT modules"
    assert describe_encoder(hybrid.state_dict()) == "ViT 32 wide, 2 blocks, patch 2x2"  # on the feature map
    resnet50 = timm.create_model("resnet50", num_classes=0)
    assert describe_encoder(resnet50.state_dict()) == "ResNet, blocks 3-4-6-3, 2048 channels"
