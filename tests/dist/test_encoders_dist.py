"""Recipes: the other encoders through ./launch.sh at ZeRO-2 on 2 gloo processes, 32 px synthetic images, tiny
widths: SimMIM on the hybrid (ResNet stem) and on T2T-ViT_t-14 with their exports loaded back in timm, the hybrid
fine-tuned from its SimMIM export at 48 px (pos_embed resized, layer decay), VT-ResNet-18 fine-tuned from scratch
and then linear-probed; SimMIM on T2T-ViT_t-14 again at ZeRO-3. Their ZeRO-3 construction
(tests/dist/zero3_encoders_worker.py under torchrun) against the ordinary build."""

from __future__ import annotations

import json
import math
import re

import pytest
import timm
import torch
from safetensors.torch import load_file

import core.models.build  # noqa: F401  (registers t2t_vit_* and vt_resnet* with timm)
from tests.launching import launch, losses, pretrain_recipe, torchrun, write_recipe

pytestmark = pytest.mark.dist

TINY = {"embed_dim": 32, "depth": 2, "num_heads": 2, "img_size": 32}
HYBRID = {**TINY, "arch": "vit_hybrid", "hybrid_backbone": "resnet_stem", "patch_size": 2}  # 4x4 grid
T2T = {**TINY, "arch": "t2t_vit", "t2t_variant": "t_14"}  # 2x2 grid
STEPS = 4


def simmim_recipe(shards, run_dir, model: dict, mask_patch_size: int) -> dict:
    recipe = pretrain_recipe(
        shards,
        run_dir,
        model=model,
        schedule={"steps": STEPS, "warmup_steps": 1},
        checkpoint={"every_steps": STEPS},
        logging={"every_steps": 1, "image_every_steps": 2},
    )
    recipe["objective"] = {"kind": "simmim", "mask_patch_size": mask_patch_size}  # replaces MAE's section
    return recipe


def finetune_recipe(shards, run_dir, model: dict) -> dict:
    recipe = pretrain_recipe(
        shards,
        run_dir,
        stage="finetune",
        model=model,
        optim={"base_lr": 1e-3, "layer_decay": 0.75},
        schedule={"steps": STEPS, "warmup_steps": 1},
        checkpoint={"every_steps": STEPS},
        logging={"every_steps": 1, "image_every_steps": 0},
    )
    recipe["objective"] = {"kind": "classification"}
    recipe["data"].update(val=str(shards["val"]), eval_batch_size_per_device=32, eval_crop_pct=1.0)
    return recipe


def run(recipe: dict, path) -> str:
    proc = launch(write_recipe(path, recipe))
    assert proc.returncode == 0, proc.stdout[-4000:]
    steps = losses(path.parent / "run")
    assert sorted(steps) == list(range(1, STEPS + 1)) and all(math.isfinite(v) for v in steps.values())
    return proc.stdout


def assert_export_matches_timm(export, monkeypatch, cls_name: str, img_size: int = 32) -> torch.nn.Module:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = timm.create_model(f"local-dir:{export}", pretrained=True).eval()
    assert type(model).__name__ == cls_name
    state = load_file(str(export / "model.safetensors"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert model(torch.randn(1, 3, img_size, img_size)).isfinite().all()
    return model


@pytest.fixture(scope="module")
def hybrid_simmim(shards, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hybrid_simmim")
    output = run(simmim_recipe(shards, tmp / "run", HYBRID, mask_patch_size=2), tmp / "recipe.yaml")
    return tmp / "run", output


def test_simmim_on_the_hybrid_exports_its_encoder(hybrid_simmim, monkeypatch):
    run_dir, output = hybrid_simmim
    assert json.loads((run_dir / "deepspeed.json").read_text())["zero_optimization"]["stage"] == 2
    manifest = json.loads((run_dir / "export" / "mimpipe.json").read_text())
    assert manifest["method"] == "simmim" and {"mask_token", "decoder.weight"} <= set(manifest["not_exported"])
    model = assert_export_matches_timm(run_dir / "export", monkeypatch, "VisionTransformer")
    assert model.patch_embed.grid_size == (4, 4) and type(model.patch_embed).__name__ == "HybridEmbed"


def test_hybrid_finetunes_from_its_simmim_export_at_48_px(hybrid_simmim, shards, tmp_path):
    pretrain_dir, _ = hybrid_simmim
    model = {**HYBRID, "img_size": 48, "init": str(pretrain_dir / "export")}
    run(finetune_recipe(shards, tmp_path / "run", model), tmp_path / "recipe.yaml")
    report = json.loads((tmp_path / "run" / "load_report.json").read_text())
    assert report["resized"] == [["pos_embed", [4, 4], [6, 6]]]
    assert report["head_init"] == "zero weight and bias"


@pytest.fixture(scope="module")
def t2t_simmim(shards, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("t2t_simmim")
    run(simmim_recipe(shards, tmp / "run", T2T, mask_patch_size=1), tmp / "recipe.yaml")
    return tmp / "run"


def test_simmim_on_t2t_exports_its_encoder(t2t_simmim, monkeypatch):
    assert json.loads((t2t_simmim / "export" / "mimpipe.json").read_text())["method"] == "simmim"
    model = assert_export_matches_timm(t2t_simmim / "export", monkeypatch, "T2TViT")
    assert model.grid_size == (2, 2) and model.embed_dim == 32


def test_simmim_on_t2t_at_zero3_repeats_the_zero2_losses(t2t_simmim, shards, tmp_path, monkeypatch):
    """Recipe: the T2T SimMIM run above with engine.zero_stage=3: built under deepspeed.zero.Init (the same initial
    weights, see the build test below), each rank holds half of the weights, and it trains and exports as at ZeRO-2."""
    recipe = simmim_recipe(shards, tmp_path / "run", T2T, mask_patch_size=1)
    recipe["engine"] = {**recipe.get("engine", {}), "zero_stage": 3}
    output = run(recipe, tmp_path / "recipe.yaml")
    held = re.search(r"ZeRO-3 partitioned parameters: this rank holds ([\d,]+) of ([\d,]+)", output)
    assert held and 0.45 < int(held[1].replace(",", "")) / int(held[2].replace(",", "")) < 0.55
    zero2 = losses(t2t_simmim)
    for step, loss in losses(tmp_path / "run").items():
        assert math.isclose(loss, zero2[step], rel_tol=1e-4), (step, loss, zero2[step])
    at_zero3 = assert_export_matches_timm(tmp_path / "run" / "export", monkeypatch, "T2TViT")
    assert at_zero3.blocks[0].attn.qkv.weight.shape == (96, 32)  # gathered, not a ZeRO-3 placeholder


@pytest.fixture(scope="module")
def zero3_builds(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("zero3_encoders")
    torchrun("zero3_encoders_worker.py", out)
    return json.loads((out / "zero3_encoders.json").read_text())


@pytest.mark.parametrize("arch", ["t2t_vit", "vt_resnet"])
def test_zero3_build_equals_the_ordinary_build(zero3_builds, arch):
    """T2T-ViT-14 (Performer) initialises through `Module.apply` and VT-ResNet-18 likewise, which DeepSpeed gathers
    around each call: the partitioned model holds the ordinary build's values from the same seed (T2T's sin-cos table
    up to float32 rounding, which zero.Init's float32 tensor creation imposes)."""
    built = zero3_builds[arch]
    assert 0.45 < built["held_share"] < 0.55
    assert built["max_diff"] < 1e-6, built["worst"]


def test_zero3_build_of_the_hybrid_initialises_like_timm(zero3_builds):
    """The hybrid's ResNet initialisation is redone with the ViT's on gathered weights (core/engine/zero_init.py), in
    a different order of random draws than the ordinary build: the constant tensors (norms, zero-init biases and
    last norms) are equal, the random ones have the same spread (a lost init would keep torch's default, whose
    spread is about twice the kaiming fan-out one on the stem convolution)."""
    built = zero3_builds["vit_hybrid"]
    assert 0.45 < built["held_share"] < 0.55
    assert built["constants_equal"] and built["num_constant"] > 10
    low, high = built["std_ratios"]
    assert 0.85 < low <= high < 1.15


VT = {"arch": "vt_resnet", "vt_variant": 18, "embed_dim": 64, "img_size": 32}


@pytest.fixture(scope="module")
def vt_finetuned(shards, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vt_finetune")
    run(finetune_recipe(shards, tmp / "run", VT), tmp / "recipe.yaml")
    return tmp / "run"


def test_vt_resnet_finetunes_from_scratch(vt_finetuned, monkeypatch):
    loaded = assert_export_matches_timm(vt_finetuned / "export", monkeypatch, "VTResNet")
    assert loaded.num_classes == 4 and loaded.num_features == 64


def test_vt_resnet_linear_probe_keeps_its_encoder_and_batch_norm_statistics(
    vt_finetuned, shards, tmp_path, monkeypatch
):
    """Recipe: a linear probe (LARS) on the VT-ResNet fine-tuned above: everything but `fc` is exported as it came,
    BatchNorm running statistics included, and the probe's folded `fc` loads into plain timm."""
    recipe = finetune_recipe(shards, tmp_path / "run", {**VT, "init": str(vt_finetuned / "export")})
    recipe["objective"] = {"kind": "classification", "mode": "linear_probe"}
    recipe["optim"] = {"kind": "lars", "base_lr": 0.1, "weight_decay": 0.0}
    run(recipe, tmp_path / "recipe.yaml")
    before = load_file(str(vt_finetuned / "export" / "model.safetensors"))
    after = load_file(str(tmp_path / "run" / "export" / "model.safetensors"))
    assert set(after) == set(before) and "layer1.0.bn1.running_mean" in after
    # Frozen BatchNorms keep no update counter, so it is exported as 0 (only BatchNorm with momentum=None reads it).
    assert all(after[k] == 0 for k in after if k.endswith("num_batches_tracked"))
    kept = [k for k in before if not k.startswith("fc.") and not k.endswith("num_batches_tracked")]
    changed = [k for k in kept if not torch.equal(after[k], before[k])]
    assert not changed, changed
    assert not torch.equal(after["fc.weight"], before["fc.weight"])
    assert isinstance(
        assert_export_matches_timm(tmp_path / "run" / "export", monkeypatch, "VTResNet").fc, torch.nn.Linear
    )
