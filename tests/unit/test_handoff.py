"""Hand-off of a pretrained encoder to fine-tuning: load, resize pos_embed, map the final norm, drop, zero the head."""

import json

import pytest
import safetensors.torch
import torch
from timm.layers import resample_patch_embed

from core.export.folder import export_model
from core.export.handoff import load_encoder
from core.models.pos_embed import sincos_pos_embed_2d
from tests.helpers.models import wide_vit


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def export_folder(model, out_dir):
    args = dict(
        img_size=model.patch_embed.img_size,
        patch_size=model.patch_embed.patch_size[0],
        in_chans=model.patch_embed.proj.in_channels,
    )
    return export_model(model, out_dir, model_args=args, manifest={"method": "mae", "step": 7})


def mae_checkpoint(encoder, path, pos_embed=None):
    """A bare pretraining file: encoder tensors plus an MAE decoder and mask token (not in any fine-tuning model)."""
    state = {k: v.clone() for k, v in encoder.state_dict().items()}
    if pos_embed is not None:
        state["pos_embed"] = pos_embed
    state["mask_token"] = torch.zeros(1, 1, 32)
    state["decoder_pos_embed"] = torch.zeros(1, 50, 32)
    state |= {f"decoder_blocks.{i}.{name}": torch.randn(32) for i in range(2) for name in ("norm1.weight", "fc.bias")}
    state |= {"decoder_pred.weight": torch.randn(48, 32), "head.weight": torch.randn(5, 64), "head.bias": torch.ones(5)}
    safetensors.torch.save_file(state, path)
    return state


def ramp_pos_embed(rows, cols, row_slope=2.0, col_slope=3.0, cls_value=-5.0, dim=64):
    """(1, 1 + rows*cols, dim): the cls position holds `cls_value`, grid position (r, c) holds 1 + a*r + b*c."""
    r, c = torch.meshgrid(torch.arange(rows).float(), torch.arange(cols).float(), indexing="ij")
    grid = (1 + row_slope * r + col_slope * c).reshape(1, rows * cols, 1).expand(1, rows * cols, dim)
    return torch.cat([torch.full((1, 1, dim), cls_value), grid], dim=1)


def resampled_coords(old, new):
    """Source coordinate of each new grid position (pixel centres aligned, as F.interpolate's align_corners=False)."""
    return (torch.arange(new).float() + 0.5) * old / new - 0.5


def test_same_grid_loads_every_tensor_unchanged_and_head_gives_zero_logits(tmp_path):
    source = wide_vit()
    folder = export_folder(source, tmp_path / "export")
    model = wide_vit(num_classes=10, seed=1)

    report = load_encoder(model, folder)

    assert report.resized == [] and report.mapped == [] and report.dropped == []
    assert report.initialised == ["head.weight", "head.bias"]
    assert report.loaded == list(source.state_dict())
    assert report.manifest["step"] == 7 and report.source == str(folder / "model.safetensors")
    assert report.checkpoint_format == "mimpipe-export" and report.head_init == "zero weight and bias"
    for key, tensor in source.state_dict().items():
        assert torch.equal(model.state_dict()[key], tensor), key
    with torch.no_grad():
        logits = model(torch.randn(3, 3, 28, 28))
    assert torch.equal(logits, torch.zeros(3, 10))


def test_mae_checkpoint_resized_mapped_and_dropped_into_avg_pooled_model(tmp_path):
    source = wide_vit()
    path = tmp_path / "mae.safetensors"
    state = mae_checkpoint(source, path)
    model = wide_vit(img_size=32, global_pool="avg", num_classes=10, seed=1)

    report = load_encoder(model, path)

    assert report.resized == [("pos_embed", (7, 7), (8, 8))]
    assert report.mapped == [("norm.bias", "fc_norm.bias"), ("norm.weight", "fc_norm.weight")]
    decoder_keys = [k for k in state if k.startswith("decoder_")]
    assert sorted(report.dropped) == sorted([*decoder_keys, "mask_token", "head.weight", "head.bias"])
    assert report.initialised == ["head.weight", "head.bias"]
    mapped = dict((dst, src) for src, dst in report.mapped)
    for key in report.loaded:
        assert torch.equal(model.state_dict()[key], state[mapped.get(key, key)]), key
    assert model.pos_embed.shape == (1, 65, 64)
    assert torch.equal(model.pos_embed[:, :1], state["pos_embed"][:, :1])  # cls position kept as is
    text = report.format()
    assert "pos_embed 7x7 -> 8x8" in text and "norm.weight -> fc_norm.weight" in text
    assert f"decoder_* ({len(decoder_keys)} tensors)" in text and "blocks.* (24 tensors)" in text
    assert json.loads(json.dumps(report.as_dict()))["resized"] == [["pos_embed", [7, 7], [8, 8]]]


def test_fc_norm_checkpoint_maps_to_norm_for_token_pooling(tmp_path):
    source = wide_vit(global_pool="avg")
    folder = export_folder(source, tmp_path / "export")
    model = wide_vit(global_pool="token", num_classes=10, seed=1)

    report = load_encoder(model, folder)

    assert report.mapped == [("fc_norm.bias", "norm.bias"), ("fc_norm.weight", "norm.weight")]
    assert torch.equal(model.norm.weight, source.fc_norm.weight)


def test_linear_ramp_upsampled_7x7_to_8x8_stays_linear_away_from_borders(tmp_path):
    pos_embed = ramp_pos_embed(7, 7)
    mae_checkpoint(wide_vit(), tmp_path / "mae.safetensors", pos_embed=pos_embed)
    model = wide_vit(img_size=32, num_classes=10)

    load_encoder(model, tmp_path / "mae.safetensors")

    u = resampled_coords(7, 8)
    expected = 1 + 2 * u[:, None] + 3 * u[None, :]  # (8, 8)
    grid = model.pos_embed.detach()[0, 1:, 0].reshape(8, 8)
    # Bicubic taps reach one position back and two forward; rows/cols 2..5 never touch the border.
    torch.testing.assert_close(grid[2:6, 2:6], expected[2:6, 2:6], atol=1e-4, rtol=0)
    assert (grid.diff(dim=0) > 0).all() and (grid.diff(dim=1) > 0).all()
    assert torch.equal(model.pos_embed.detach()[0, 0], torch.full((64,), -5.0))


def test_non_square_target_grid_7x7_to_6x10(tmp_path):
    pos_embed = ramp_pos_embed(7, 7, row_slope=0.0)
    mae_checkpoint(wide_vit(), tmp_path / "mae.safetensors", pos_embed=pos_embed)
    model = wide_vit(img_size=(24, 40), num_classes=10)

    report = load_encoder(model, tmp_path / "mae.safetensors")

    assert report.resized == [("pos_embed", (7, 7), (6, 10))]
    grid = model.pos_embed.detach()[0, 1:, 0].reshape(6, 10)
    expected = 1 + 3 * resampled_coords(7, 10)  # (10,), constant down the rows
    torch.testing.assert_close(grid[:, 2:8], expected[2:8].expand(6, 6), atol=1e-4, rtol=0)


def test_non_square_source_grid_read_from_config(tmp_path):
    source = wide_vit(img_size=(24, 40))
    folder = export_folder(source, tmp_path / "export")
    model = wide_vit(img_size=28, num_classes=10)

    report = load_encoder(model, folder)

    assert report.resized == [("pos_embed", (6, 10), (7, 7))]
    assert model.pos_embed.shape == (1, 50, 64)


def test_head_init_keep_leaves_timm_init(tmp_path):
    folder = export_folder(wide_vit(), tmp_path / "export")
    model = wide_vit(num_classes=10, seed=1)
    head_before = model.head.weight.detach().clone()

    load_encoder(model, folder, head_init="keep")

    assert torch.equal(model.head.weight, head_before) and head_before.abs().sum() > 0


@pytest.mark.parametrize(
    ("source_kwargs", "model_kwargs", "expected"),
    [
        (
            {"embed_dim": 64},
            {"embed_dim": 96},
            [
                "blocks.0.attn.qkv.weight: checkpoint (192, 64) vs model (288, 96)",
                "cls_token: checkpoint (1, 1, 64) vs model (1, 1, 96)",
            ],
        ),
        ({"depth": 2}, {"depth": 3}, ["missing encoder key blocks.2.attn.qkv.weight: model (192, 64)"]),
        ({"depth": 3}, {"depth": 2}, ["unexpected encoder key blocks.2.mlp.fc1.weight: checkpoint (256, 64)"]),
        (
            {"in_chans": 3},
            {"in_chans": 1},
            ["patch_embed.proj.weight: checkpoint (64, 3, 4, 4) vs model (64, 1, 4, 4)"],
        ),
    ],
)
def test_wrong_architecture_names_file_and_every_mismatched_key(tmp_path, source_kwargs, model_kwargs, expected):
    folder = export_folder(wide_vit(**source_kwargs), tmp_path / "export")
    model = wide_vit(num_classes=10, **model_kwargs)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    with pytest.raises(ValueError) as error:
        load_encoder(model, folder)

    message = str(error.value)
    assert str(folder / "model.safetensors") in message
    for line in expected:
        assert line in message
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())  # nothing half-loaded


def test_bare_file_with_non_square_grid_and_no_config_is_an_error(tmp_path):
    mae_checkpoint(wide_vit(), tmp_path / "mae.safetensors", pos_embed=torch.zeros(1, 61, 64))

    with pytest.raises(ValueError, match=r"pos_embed: checkpoint \(1, 61, 64\) vs model \(1, 50, 64\)"):
        load_encoder(wide_vit(num_classes=10), tmp_path / "mae.safetensors")


def test_missing_path_and_unreadable_pickle_are_refused(tmp_path):
    (tmp_path / "weights.pth").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="does not exist"):
        load_encoder(wide_vit(num_classes=10), tmp_path / "missing")
    with pytest.raises(ValueError, match=r"weights.pth is not a readable PyTorch checkpoint"):
        load_encoder(wide_vit(num_classes=10), tmp_path / "weights.pth")


def bare_file(model, path):
    """The model's encoder tensors as a bare .safetensors file (no config.json: grids come from the tensors)."""
    safetensors.torch.save_file({k: v.clone() for k, v in model.state_dict().items()}, path)
    return path


def test_patch_size_change_8_to_4_resamples_kernel_and_grid(tmp_path):
    source = wide_vit(img_size=32, patch_size=8)  # 4x4 grid
    path = bare_file(source, tmp_path / "p8.safetensors")
    model = wide_vit(img_size=32, patch_size=4, num_classes=10, seed=1)  # 8x8 grid

    report = load_encoder(model, path)

    assert report.resized == [("patch_embed.proj.weight", (8, 8), (4, 4)), ("pos_embed", (4, 4), (8, 8))]
    assert report.resize_method == {
        "patch_embed.proj.weight": "resample_patch_embed",
        "pos_embed": "bicubic interpolation",
    }
    expected = resample_patch_embed(source.patch_embed.proj.weight.detach(), [4, 4])
    torch.testing.assert_close(model.patch_embed.proj.weight.detach(), expected)
    assert torch.equal(model.patch_embed.proj.bias, source.patch_embed.proj.bias)
    text = report.format()
    assert "patch_embed.proj.weight 8x8 -> 4x4 (resample_patch_embed)" in text
    assert "pos_embed 4x4 -> 8x8 (bicubic interpolation)" in text
    assert json.loads(json.dumps(report.as_dict()))["resized"][0] == ["patch_embed.proj.weight", [8, 8], [4, 4]]
    with torch.no_grad():
        out = model.forward_features(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 65, 64) and torch.isfinite(out).all()


def test_upsampled_kernel_sees_upsampled_patches_as_the_original(tmp_path):
    """FlexiViT's property: a 4x4 kernel resampled to 8x8 gives the same embedding for each patch resized to 8x8."""
    source = wide_vit(img_size=16, patch_size=4)  # 4x4 grid
    model = wide_vit(img_size=32, patch_size=8, num_classes=10, seed=1)  # 4x4 grid, no pos_embed resize
    report = load_encoder(model, bare_file(source, tmp_path / "p4.safetensors"))
    assert [key for key, _, _ in report.resized] == ["patch_embed.proj.weight"]

    patches = torch.randn(16, 3, 4, 4)  # one image's 4x4 grid of patches
    big = torch.nn.functional.interpolate(patches, size=(8, 8), mode="bicubic", antialias=True)  # (16, 3, 8, 8)
    with torch.no_grad():
        small_out = source.patch_embed.proj(patches)  # (16, D, 1, 1)
        big_out = model.patch_embed.proj(big)
    torch.testing.assert_close(big_out, small_out, atol=1e-4, rtol=1e-4)


def test_patch_size_change_keeps_a_non_square_grid_without_config(tmp_path):
    source = wide_vit(img_size=(24, 40), patch_size=8)  # 3x5 grid, bare file: no config.json
    model = wide_vit(img_size=(24, 40), patch_size=4, num_classes=10, seed=1)  # 6x10 grid

    report = load_encoder(model, bare_file(source, tmp_path / "p8.safetensors"))

    assert report.resized == [("patch_embed.proj.weight", (8, 8), (4, 4)), ("pos_embed", (3, 5), (6, 10))]


@pytest.mark.parametrize(("img_size", "grid"), [(32, (8, 8)), ((24, 40), (6, 10))])
def test_sincos_regenerates_pos_embed_for_the_new_grid(tmp_path, img_size, grid):
    mae_checkpoint(wide_vit(), tmp_path / "mae.safetensors", pos_embed=ramp_pos_embed(7, 7))
    model = wide_vit(img_size=img_size, num_classes=10)

    report = load_encoder(model, tmp_path / "mae.safetensors", pos_embed_resize="sincos")

    assert report.resized == [("pos_embed", (7, 7), grid)]
    assert report.resize_method == {"pos_embed": "sin-cos regenerated"}
    assert torch.equal(model.pos_embed.detach(), sincos_pos_embed_2d(64, grid, num_prefix_tokens=1))
    assert f"pos_embed 7x7 -> {grid[0]}x{grid[1]} (sin-cos regenerated)" in report.format()


def test_sincos_leaves_an_unchanged_grid_as_loaded(tmp_path):
    source = wide_vit()
    model = wide_vit(num_classes=10, seed=1)

    report = load_encoder(model, bare_file(source, tmp_path / "enc.safetensors"), pos_embed_resize="sincos")

    assert report.resized == [] and "pos_embed" in report.loaded
    assert torch.equal(model.pos_embed, source.pos_embed)


def test_trunc_normal_head_has_the_requested_std_and_zero_bias(tmp_path):
    folder = export_folder(wide_vit(), tmp_path / "export")
    model = wide_vit(num_classes=2000, seed=1)  # 2000 x 64 weights: the sample std is within a few percent

    report = load_encoder(model, folder, head_init="trunc_normal", head_init_std=2e-5)

    std = model.head.weight.detach().std().item()
    assert abs(std - 2e-5) < 0.03 * 2e-5
    assert torch.equal(model.head.bias, torch.zeros(2000))
    assert report.head_init == "trunc_normal(std=2e-05), zero bias" and "head: trunc_normal" in report.format()


def test_keep_head_loads_the_checkpoint_classifier(tmp_path):
    state = mae_checkpoint(wide_vit(), tmp_path / "mae.safetensors")  # carries a 5-class head
    model = wide_vit(num_classes=5, seed=1)

    report = load_encoder(model, tmp_path / "mae.safetensors", keep_head=True)

    assert report.initialised == [] and {"head.weight", "head.bias"} <= set(report.loaded)
    assert "head.weight" not in report.dropped and report.head_init == "loaded from the checkpoint"
    assert torch.equal(model.head.weight, state["head.weight"]) and torch.equal(model.head.bias, state["head.bias"])


@pytest.mark.parametrize(
    ("num_classes", "with_head", "expected"),
    [
        (10, True, r"head.weight: checkpoint \(5, 64\) vs model \(10, 64\)"),
        (10, False, r"missing encoder key head.weight: model \(10, 64\)"),
    ],
)
def test_keep_head_needs_a_matching_head(tmp_path, num_classes, with_head, expected):
    source = wide_vit(num_classes=5 if with_head else 0)
    path = bare_file(source, tmp_path / "classifier.safetensors")

    with pytest.raises(ValueError, match=expected):
        load_encoder(wide_vit(num_classes=num_classes, seed=1), path, keep_head=True)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"head_init": "normal"}, "head_init must be one of"),
        ({"head_init_std": 0.0}, "head_init_std must be positive"),
        ({"pos_embed_resize": "bilinear"}, "pos_embed_resize must be one of"),
    ],
)
def test_unknown_options_are_errors(tmp_path, options, expected):
    folder = export_folder(wide_vit(), tmp_path / "export")
    with pytest.raises(ValueError, match=expected):
        load_encoder(wide_vit(num_classes=10), folder, **options)
