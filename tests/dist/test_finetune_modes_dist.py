"""Recipes: tiny fine-tunes (tests/dist/test_finetune_dist.py `finetune_recipe`) in the other modes, 2 gloo processes
through ./launch.sh: a linear probe from a timm state dict, and DeiT distillation with the full augmentation set,
layer decay and an EMA of the weights."""

from __future__ import annotations

import json
import re

import pytest
import timm
import torch
from safetensors.torch import load_file

from core.export.folder import export_model
from core.models.vit import build_vit, vit_model_args
from tests.dist.test_finetune_dist import finetune_recipe
from tests.launching import launch, read_metrics, write_recipe

pytestmark = pytest.mark.dist


def test_linear_probe_from_a_timm_checkpoint_keeps_the_encoder(zero2_run, shards, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    encoder = timm.create_model(f"local-dir:{zero2_run[0] / 'export'}", pretrained=True)
    torch.save(encoder.state_dict(), tmp_path / "timm_vit.pth")  # a plain timm state dict, as people have them
    recipe = finetune_recipe(shards, tmp_path / "run", tmp_path / "timm_vit.pth")
    recipe["model"] |= {"img_size": 16, "global_pool": "token"}
    recipe["objective"] = {"kind": "classification", "mode": "linear_probe"}
    recipe["optim"] = {"kind": "lars", "base_lr": 0.1, "weight_decay": 0.0}
    proc = launch(write_recipe(tmp_path / "tiny_linprobe.yaml", recipe))
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "(timm)" in proc.stdout  # the load report names the detected format

    exported = load_file(str(tmp_path / "run" / "export" / "model.safetensors"))
    for key, value in encoder.state_dict().items():  # frozen: identical after the probe's steps
        assert torch.equal(exported[key], value), key
    assert exported["head.weight"].shape == (4, 32) and exported["head.weight"].abs().sum() > 0
    probe = timm.create_model(f"local-dir:{tmp_path / 'run' / 'export'}", pretrained=True)  # BN folded: plain timm
    assert isinstance(probe.head, torch.nn.Linear)


def test_distillation_with_augmentation_layer_decay_and_ema(zero2_run, shards, tmp_path, monkeypatch):
    torch.manual_seed(0)
    teacher = build_vit("tiny", img_size=20, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=4)
    export_model(teacher, tmp_path / "teacher", model_args=vit_model_args(teacher), manifest={"method": "test"})
    recipe = finetune_recipe(shards, tmp_path / "run", zero2_run[0] / "export")
    recipe["model"] |= {"global_pool": "token"}
    recipe["augment"] = {"auto_augment": "rand-m9-mstd0.5-inc1", "re_prob": 0.25, "mixup": 0.8, "cutmix": 1.0}
    recipe["distill"] = {"kind": "soft", "teacher": str(tmp_path / "teacher")}  # an export folder: timm local-dir
    recipe["optim"] |= {"layer_decay": 0.75, "ema_decay": 0.9}
    proc = launch(write_recipe(tmp_path / "tiny_distill.yaml", recipe))
    assert proc.returncode == 0, proc.stdout[-4000:]

    metrics = read_metrics(tmp_path / "run")
    assert all("train/loss_teacher" in m for m in metrics if "train/loss" in m)
    assert [m["step"] for m in metrics if "val_ema/top1" in m] == [2, 4]
    table = proc.stdout.split("per-class accuracy at step 4:")[1]
    assert sum(int(n) for n in re.findall(r"^\| \S+ +\| +(\d+) \|", table, re.M)) == 203  # every sample once
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    student = timm.create_model(f"local-dir:{tmp_path / 'run' / 'export'}", pretrained=True)
    assert type(student).__name__ == "VisionTransformerDistilled" and student.dist_token is not None
    manifest = json.loads((tmp_path / "run" / "export" / "mimpipe.json").read_text())
    assert manifest["method"] == "deit-distill-soft"
