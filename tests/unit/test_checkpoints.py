"""Checkpoint interop: every accepted format (our export, MAE pretrain / fine-tuned pickles, timm state dicts, DeiT
distilled) is detected, read safely, mapped to timm names and loaded with the source's features; conversion to our
export round-trips through `timm.create_model('local-dir:...')`."""

import argparse
import json
from functools import partial

import pytest
import safetensors.torch
import timm
import torch

from core.export.folder import export_model
from core.export.handoff import load_encoder, read_pooling_hint
from core.export.read import read_checkpoint
from finetune.convert import STANDARD_WIDTHS
from finetune.convert import main as convert_main
from tests.helpers.models import wide_vit


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


IMG, PATCH, DEPTH = 32, 8, 2
# Image 32, patch 8 (a 4x4 grid), 64 wide; DeiT's distilled variant next to the plain ViT.
vit = partial(wide_vit, img_size=IMG, patch_size=PATCH, depth=DEPTH)
deit = partial(vit, distilled=True)


def state_of(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def mae_args():
    """What official MAE pickles next to the weights: the training script's argparse namespace."""
    return argparse.Namespace(model="mae_vit_base_patch16", mask_ratio=0.75, norm_pix_loss=True, blr=1.5e-4)


def save_mae_pretrain(encoder, path):
    """{"model": encoder + mask_token + decoder, "optimizer", "epoch", "args"} as `main_pretrain.py` writes it."""
    dim, decoder_dim = encoder.embed_dim, 32
    model = state_of(encoder) | {
        "mask_token": torch.zeros(1, 1, decoder_dim),
        "decoder_embed.weight": torch.randn(decoder_dim, dim),
        "decoder_pos_embed": torch.zeros(1, 1 + encoder.patch_embed.num_patches, decoder_dim),
        "decoder_blocks.0.norm1.weight": torch.ones(decoder_dim),
        "decoder_norm.weight": torch.ones(decoder_dim),
        "decoder_pred.weight": torch.randn(PATCH * PATCH * 3, decoder_dim),
    }
    optimizer = {"state": {}, "param_groups": [{"lr": 1e-4, "params": [0, 1]}]}
    torch.save({"model": model, "optimizer": optimizer, "epoch": 799, "args": mae_args()}, path)
    return model


def save_mae_finetune(classifier, path):
    """An avg-pooled classifier (fc_norm, head, no final norm) as `main_finetune.py` saves it."""
    model = state_of(classifier)
    assert "fc_norm.weight" in model and "norm.weight" not in model
    torch.save({"model": model, "epoch": 99, "args": mae_args()}, path)
    return model


TIMM_LAYOUTS = {
    "plain.pth": lambda sd: sd,
    "wrapped.pth": lambda sd: {"state_dict": sd, "epoch": 3, "arch": "vit_tiny_patch16_224"},
    "ema.bin": lambda sd: {"model_ema": sd},
    "ddp.pth": lambda sd: {"model": {f"module.{k}": v for k, v in sd.items()}},
}


def save_timm(model, path):
    sd = state_of(model)
    if path.suffix == ".safetensors":
        safetensors.torch.save_file(sd, path)
    else:
        torch.save(TIMM_LAYOUTS.get(path.name, TIMM_LAYOUTS["plain.pth"])(sd), path)
    return sd


def features(model, x):
    """Pooled, normalised features (before the classifier): compares token and avg pooling alike."""
    with torch.no_grad():
        return model.forward_head(model.forward_features(x), pre_logits=True)


@pytest.mark.parametrize("name", [*TIMM_LAYOUTS, "weights.safetensors"])
def test_timm_state_dict_layouts_load_with_identical_features(tmp_path, name):
    source = vit(num_classes=5)
    save_timm(source, tmp_path / name)
    model = vit(num_classes=5, seed=1)

    report = load_encoder(model, tmp_path / name, keep_head=True)

    assert report.checkpoint_format == "timm" and report.dropped == [] and report.initialised == []
    x = torch.randn(2, 3, IMG, IMG)
    with torch.no_grad():
        torch.testing.assert_close(model(x), source(x), rtol=0, atol=0)
    if name == "ddp.pth":
        assert "stripped the 'module.' prefix from every key" in report.notes


def test_mae_pretrain_pickle_needs_trust_then_drops_decoder(tmp_path):
    encoder = vit()
    path = tmp_path / "mae_pretrain_vit_tiny.pth"
    saved = save_mae_pretrain(encoder, path)
    model = vit(num_classes=10, seed=1)

    with pytest.raises(ValueError) as error:
        load_encoder(model, path)
    message = str(error.value)
    assert str(path) in message and "model.trust_checkpoint=true" in message and "argparse.Namespace" in message

    report = load_encoder(model, path, trust_checkpoint=True)

    assert report.checkpoint_format == "mae-pretrain"
    assert sorted(report.dropped) == sorted(k for k in saved if k.startswith("decoder_") or k == "mask_token")
    assert report.initialised == ["head.weight", "head.bias"]
    x = torch.randn(2, 3, IMG, IMG)
    torch.testing.assert_close(features(model, x), features(encoder, x), rtol=0, atol=0)
    assert report.notes == [
        "unpickled in full (trust_checkpoint): the file holds argparse.Namespace",
        "weights from the checkpoint's 'model' entry (ignored: args, epoch, optimizer)",
    ]


@pytest.mark.parametrize("global_pool", ["avg", "token"])
def test_mae_finetune_checkpoint_into_avg_or_token_model(tmp_path, global_pool):
    source = vit(global_pool="avg", num_classes=10)
    save_mae_finetune(source, tmp_path / "mae_finetuned.pth")
    model = vit(global_pool=global_pool, num_classes=10, seed=1)

    report = load_encoder(model, tmp_path / "mae_finetuned.pth", trust_checkpoint=True)

    assert report.checkpoint_format == "mae-finetune" and report.dropped == ["head.weight", "head.bias"]
    if global_pool == "avg":
        assert report.mapped == []
        x = torch.randn(2, 3, IMG, IMG)
        torch.testing.assert_close(features(model, x), features(source, x), rtol=0, atol=0)
    else:
        assert report.mapped == [("fc_norm.bias", "norm.bias"), ("fc_norm.weight", "norm.weight")]
        assert torch.equal(model.norm.weight, source.fc_norm.weight)


def test_deit_distilled_into_distilled_model_with_both_heads(tmp_path):
    source = deit(num_classes=7)
    torch.save({"model": state_of(source)}, tmp_path / "deit.pth")
    model = deit(num_classes=7, seed=1)

    report = load_encoder(model, tmp_path / "deit.pth", keep_head=True)

    assert report.checkpoint_format == "deit-distilled" and report.dropped == [] and report.initialised == []
    assert report.head_init == "loaded from the checkpoint"
    x = torch.randn(2, 3, IMG, IMG)
    with torch.no_grad():
        torch.testing.assert_close(model(x), source(x), rtol=0, atol=0)  # eval: mean of the two heads


def test_deit_distilled_into_plain_vit_drops_dist_token_and_its_position(tmp_path):
    source = deit(num_classes=7)
    torch.save({"model": state_of(source)}, tmp_path / "deit.pth")
    model = vit(num_classes=3, seed=1)

    report = load_encoder(model, tmp_path / "deit.pth")

    assert sorted(report.dropped) == ["dist_token", "head.bias", "head.weight", "head_dist.bias", "head_dist.weight"]
    pos = source.pos_embed.detach()  # (1, 2 + 16, D)
    assert torch.equal(model.pos_embed.detach(), torch.cat([pos[:, :1], pos[:, 2:]], dim=1))
    assert "pos_embed: distillation-token position removed, cls position kept" in report.format()
    assert "pos_embed" in report.loaded and report.resized == []


def test_plain_checkpoint_into_distilled_model_initialises_dist_token(tmp_path):
    source = vit()
    save_timm(source, tmp_path / "plain.pth")
    model = deit(num_classes=4, seed=1)

    report = load_encoder(model, tmp_path / "plain.pth")

    assert report.initialised == ["dist_token", "head.weight", "head.bias", "head_dist.weight", "head_dist.bias"]
    pos = source.pos_embed.detach()  # (1, 1 + 16, D)
    assert torch.equal(model.pos_embed.detach(), torch.cat([pos[:, :1], pos[:, :1], pos[:, 1:]], dim=1))
    assert torch.equal(model.head_dist.weight, torch.zeros(4, 64))


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"not a checkpoint", "is not a readable PyTorch checkpoint"),
        ([torch.zeros(2)], "holds a list, not a state dict"),
        ({"model": {"weight": torch.zeros(2), "step": 3}}, "not a state dict of tensors"),
        ({"fc.weight": torch.zeros(2, 2)}, "is not a ViT checkpoint: none of patch_embed.proj.weight"),
    ],
)
def test_unreadable_files_name_the_file(tmp_path, content, expected):
    path = tmp_path / "weights.pth"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    with pytest.raises(ValueError, match=expected) as error:
        read_checkpoint(path, trust=True)
    assert str(path) in str(error.value)


def test_missing_path_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_checkpoint(tmp_path / "nothing.pth")


def test_read_pooling_hint(tmp_path):
    avg, token = vit(global_pool="avg"), vit()
    args = dict(img_size=IMG, patch_size=PATCH, embed_dim=64, depth=DEPTH, num_heads=4)
    hinted = export_model(token, tmp_path / "hinted", model_args=args, manifest={"pooling_hint": "avg"})
    plain = export_model(token, tmp_path / "plain", model_args=args, manifest={})
    save_timm(avg, tmp_path / "avg.safetensors")
    save_mae_finetune(avg, tmp_path / "mae_finetuned.pth")
    save_mae_pretrain(token, tmp_path / "mae_pretrain.pth")

    assert read_pooling_hint(hinted) == "avg"  # the manifest wins over the keys
    assert read_pooling_hint(plain) is None
    assert read_pooling_hint(tmp_path / "avg.safetensors") == "avg"
    assert read_pooling_hint(tmp_path / "mae_pretrain.pth", trust_checkpoint=True) is None
    assert read_pooling_hint(tmp_path / "mae_finetuned.pth", trust_checkpoint=True) == "avg"
    with pytest.raises(ValueError, match="model.trust_checkpoint=true"):
        read_pooling_hint(tmp_path / "mae_finetuned.pth")


# Conversion: width 192 so that timm's tiny architectures (3 heads) describe the checkpoints.
def write_source(kind, path):
    """Write a checkpoint of `kind` at `path`; return (source model, convert flags, compare full logits?)."""
    if kind == "mae-pretrain":
        source = vit(embed_dim=192, num_heads=3)
        save_mae_pretrain(source, path)
        return source, ["--arch", "vit_tiny_patch16_224", "--trust-checkpoint"], False
    if kind == "mae-finetune":
        source = vit(embed_dim=192, num_heads=3, global_pool="avg", num_classes=6)
        save_mae_finetune(source, path)
        return source, ["--arch", "vit_tiny_patch16_224", "--trust-checkpoint"], True
    if kind == "deit-distilled":
        source = deit(embed_dim=192, num_heads=3, num_classes=6)
        torch.save({"model": state_of(source)}, path)
        return source, ["--arch", "deit_tiny_distilled_patch16_224"], True
    source = vit(embed_dim=192, num_heads=3, num_classes=6)
    if kind == "mimpipe-export":
        model_args = dict(img_size=IMG, patch_size=PATCH, embed_dim=192, depth=DEPTH, num_heads=3, num_classes=6)
        export_model(source, path, model_args=model_args, manifest={"method": "mae", "step": 5})
        return source, [], True
    save_timm(source, path)
    return source, ["--arch", "vit_tiny_patch16_224"], True


@pytest.mark.parametrize(
    ("kind", "name"),
    [
        ("mae-pretrain", "mae.pth"),
        ("mae-finetune", "mae_ft.pth"),
        ("deit-distilled", "deit.pth"),
        ("timm", "vit.safetensors"),
        ("mimpipe-export", "export"),
    ],
)
def test_convert_round_trips_through_timm_local_dir(tmp_path, capsys, kind, name):
    source, flags, with_head = write_source(kind, tmp_path / name)
    dst = tmp_path / "converted"

    assert convert_main([str(tmp_path / name), str(dst), *flags]) == 0

    rebuilt = timm.create_model(f"local-dir:{dst}", pretrained=True).eval()
    x = torch.randn(2, 3, IMG, IMG)
    with torch.no_grad():
        if with_head:
            torch.testing.assert_close(rebuilt(x), source(x), rtol=0, atol=0)
        else:
            torch.testing.assert_close(rebuilt.forward_features(x), source.forward_features(x), rtol=0, atol=0)
    manifest = json.loads((dst / "mimpipe.json").read_text())
    assert manifest["checkpoint_format"] == kind and manifest["method"] == "convert"
    assert manifest["pooling_hint"] == source.global_pool
    config = json.loads((dst / "config.json").read_text())
    if kind == "mae-pretrain":
        assert "decoder_pred.weight" in manifest["not_exported"] and "mask_token" in manifest["not_exported"]
        assert config["pretrained_cfg"]["mean"] == list(timm.data.IMAGENET_DEFAULT_MEAN)
    if kind == "mimpipe-export":
        assert manifest["source_manifest"]["step"] == 5
    assert f"({kind})" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--arch", "vit_small_patch16_224"], "has embed_dim 384"),
        (["--num-heads", "5"], "--num-heads 5 does not divide"),
        (["--arch", "resnet18"], "not a timm VisionTransformer"),
        (["--arch", "no_such_model"], "is not a timm architecture"),
    ],
)
def test_convert_errors_exit_2_with_a_message(tmp_path, capsys, flags, expected):
    save_timm(vit(embed_dim=192, num_heads=3), tmp_path / "vit.pth")

    assert convert_main([str(tmp_path / "vit.pth"), str(tmp_path / "out"), *flags]) == 2

    assert expected in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_convert_standard_widths_are_timms_architectures():
    for width, (arch, num_heads) in STANDARD_WIDTHS.items():
        with torch.device("meta"):
            reference = timm.create_model(arch)
        assert (reference.embed_dim, reference.blocks[0].attn.num_heads) == (width, num_heads)


def _round_trip(source, dst, with_head=True):
    rebuilt = timm.create_model(f"local-dir:{dst}", pretrained=True).eval()
    x = torch.randn(2, 3, IMG, IMG)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(x), source(x), rtol=0, atol=0)
    return json.loads((dst / "config.json").read_text())


def test_convert_infers_num_heads_of_a_standard_width(tmp_path, capsys):
    source = vit(embed_dim=768, num_heads=12, num_classes=3)
    save_timm(source, tmp_path / "base.safetensors")

    assert convert_main([str(tmp_path / "base.safetensors"), str(tmp_path / "out")]) == 0

    config = _round_trip(source, tmp_path / "out")
    assert config["architecture"] == "vit_base_patch16_224" and config["model_args"]["num_heads"] == 12
    distilled = deit(embed_dim=192, num_heads=3, num_classes=3)  # a distillation token picks DeiT's class
    torch.save({"model": state_of(distilled)}, tmp_path / "deit.pth")
    assert convert_main([str(tmp_path / "deit.pth"), str(tmp_path / "deit")]) == 0
    assert _round_trip(distilled, tmp_path / "deit")["architecture"] == "deit_tiny_distilled_patch16_224"


def test_convert_of_a_non_standard_width_needs_num_heads(tmp_path, capsys):
    source = vit(embed_dim=160, num_heads=5, num_classes=3)
    save_timm(source, tmp_path / "odd.pth")

    assert convert_main([str(tmp_path / "odd.pth"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "width 160" in err and "--num-heads" in err and "e.g. --num-heads 2" in err
    assert not (tmp_path / "out").exists()

    assert convert_main([str(tmp_path / "odd.pth"), str(tmp_path / "out"), "--num-heads", "5"]) == 0
    config = _round_trip(source, tmp_path / "out")
    assert config["model_args"]["embed_dim"] == 160 and config["model_args"]["num_heads"] == 5


def test_convert_refuses_untrusted_pickle(tmp_path, capsys):
    save_mae_pretrain(vit(embed_dim=192, num_heads=3), tmp_path / "mae.pth")

    assert convert_main([str(tmp_path / "mae.pth"), str(tmp_path / "out"), "--arch", "vit_tiny_patch16_224"]) == 2

    err = capsys.readouterr().err
    assert str(tmp_path / "mae.pth") in err and "--trust-checkpoint" in err


def _encoder(arch: str, **kwargs):
    torch.manual_seed(0)
    widths = {"embed_dim": 32, "depth": 2, "num_heads": 4} if arch.startswith("t2t") else {"token_dim": 64}
    return timm.create_model(arch, img_size=IMG, num_classes=3, **{**widths, **kwargs}).eval()


@pytest.mark.parametrize("source_kind", ["state dict", "export"])
@pytest.mark.parametrize(("arch", "flags"), [("t2t_vit_14", ["--num-heads", "4"]), ("vt_resnet34", [])])
def test_convert_t2t_and_vt_weights_round_trip_through_timm(tmp_path, capsys, source_kind, arch, flags):
    """The structure (Performer T2T layers, depth, width, token width; VT's ResNet stages, VT modules, classes) is
    read from the weights: the rebuilt model gives the source's outputs exactly, BatchNorm statistics included."""
    import core.models.build  # noqa: F401  (registers t2t_vit_* and vt_resnet*)
    from core.models.build import model_args

    source = _encoder(arch)
    if arch.startswith("vt"):  # running statistics that are not the defaults, so the test sees them carried over
        source.train()(torch.randn(4, 3, IMG, IMG))
        source.eval()
    path = tmp_path / ("export" if source_kind == "export" else "weights.safetensors")
    if source_kind == "export":
        export_model(source, path, model_args=model_args(source), manifest={"method": "test"})
        flags = []  # its config.json says everything
    else:
        safetensors.torch.save_file(state_of(source), path)

    assert convert_main([str(path), str(tmp_path / "out"), *flags]) == 0

    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architecture"] == arch
    # T2T-ViT weights do not show the image size (the position table is fixed): a state dict converts at the
    # variant's 224 px, and timm rebuilds the table for the size it is asked for.
    resized = {"img_size": IMG} if arch.startswith("t2t") and source_kind == "state dict" else {}
    if resized:
        assert "img_size" not in config["model_args"]  # the variant's default
    rebuilt = timm.create_model(f"local-dir:{tmp_path / 'out'}", pretrained=True, **resized).eval()
    assert type(rebuilt) is type(source)
    x = torch.randn(2, 3, IMG, IMG)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(x), source(x), rtol=0, atol=0)
    assert json.loads((tmp_path / "out" / "mimpipe.json").read_text())["pooling_hint"] == source.global_pool


@pytest.mark.parametrize(
    ("arch", "flags", "expected"),
    [
        ("t2t_vit_14", [], "T2T-ViT weights of width 32, not a variant's (384, 448, 512): their number of attention"),
        ("t2t_vit_14", ["--num-heads", "5"], "--num-heads 5 does not divide the T2T-ViT width 32"),
        ("t2t_vit_t_14", ["--num-heads", "4", "--arch", "vt_resnet18"], "holds T2T-ViT weights, whose variants"),
        ("vt_resnet18", ["--num-heads", "4"], "--num-heads does not apply to VT-ResNet"),
    ],
)
def test_convert_t2t_and_vt_errors_name_the_problem(tmp_path, capsys, arch, flags, expected):
    import core.models.build  # noqa: F401

    safetensors.torch.save_file(state_of(_encoder(arch)), tmp_path / "weights.safetensors")

    assert convert_main([str(tmp_path / "weights.safetensors"), str(tmp_path / "out"), *flags]) == 2

    assert expected in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_convert_vt_of_no_variant_names_its_stages(tmp_path, capsys):
    import core.models.build  # noqa: F401

    state = state_of(_encoder("vt_resnet18"))
    state = {k: v for k, v in state.items() if not k.startswith("layer3.1.")}  # one block short of ResNet-18's stage
    safetensors.torch.save_file(state, tmp_path / "weights.safetensors")

    assert convert_main([str(tmp_path / "weights.safetensors"), str(tmp_path / "out")]) == 2

    assert "BasicBlock stages of (2, 2, 1) blocks and 2 VT modules match no variant" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("backbone", "img_size", "arch"),
    [("resnet_stem", 32, "vit_tiny_r_s16_p8_224"), ("r26", 64, "vit_small_r26_s32_224")],
)
def test_convert_hybrid_state_dict_reads_its_backbone_and_image_size(tmp_path, backbone, img_size, arch):
    """A hybrid's patch embedding reads the ResNetV2's feature map: the backbone is told by its stages, and the image
    size is the position grid x the patch x the backbone's stride (resnet_stem 4, r26 32)."""
    from core.models.vit import build_vit

    torch.manual_seed(0)
    source = build_vit(
        "tiny", img_size=img_size, patch_size=2 if backbone == "resnet_stem" else 1, embed_dim=192, depth=1,
        num_heads=3, num_classes=3, hybrid_backbone=backbone,
    ).eval()  # fmt: skip
    torch.save(state_of(source), tmp_path / "hybrid.pth")

    assert convert_main([str(tmp_path / "hybrid.pth"), str(tmp_path / "out")]) == 0  # width 192: timm's 3 heads

    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architecture"] == arch and config["model_args"]["img_size"] == [img_size, img_size]
    rebuilt = timm.create_model(f"local-dir:{tmp_path / 'out'}", pretrained=True).eval()
    x = torch.randn(2, 3, img_size, img_size)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(x), source(x), rtol=0, atol=0)
