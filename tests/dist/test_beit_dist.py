"""Recipes: the tokenizer stage and BEiT-style pretraining (tiny ViT, 28 px / patch 4) on Fashion-MNIST shards
through ./launch.sh, then the hand-off to fine-tuning at 32 px."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import HISTOGRAMS, IMAGES, EventAccumulator
from tensorboard.plugins.hparams import metadata as hparams_metadata
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

from tests.launching import REPO, TINY_MODEL, launch, losses, read_metrics, write_recipe

pytestmark = pytest.mark.dist

FMNIST = {"mean": [0.286] * 3, "std": [0.353] * 3}
VIT_28 = {**TINY_MODEL, "img_size": 28}  # 7x7 patch grid


@pytest.fixture(scope="session")
def fmnist(tmp_path_factory) -> dict[str, Path]:
    """Fashion-MNIST shards: 2048 training images in 4 shards, 256 test images in 2."""
    root = tmp_path_factory.mktemp("fmnist")
    out = {}
    for split, limit, shard in (("train", 2048, 512), ("test", 256, 128)):
        cmd = [sys.executable, "-m", "data", "write", "--source", "fashion-mnist", "--split", split]
        cmd += ["--out", str(root / split), "--shard-size", str(shard), "--limit", str(limit)]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode:
            pytest.skip(f"Fashion-MNIST not available (apt-get install -y dataset-fashion-mnist): {proc.stderr[-300:]}")
        out[split] = root / split
    return out


def _recipe(stage: str, run_dir: Path, fmnist, objective: dict, **sections) -> dict:
    recipe = {
        "stage": stage,
        "run_dir": str(run_dir),
        "model": dict(VIT_28),
        "data": {"train": str(fmnist["train"]), "global_batch_size": 64, "num_workers": 1, **FMNIST},
        "objective": objective,
        "optim": {"base_lr": 2e-3, "lr_rule": "absolute", "betas": [0.9, 0.999], "weight_decay": 0.0},
        "schedule": {"steps": 16, "warmup_steps": 2},
        "engine": {"device": "cpu", "zero_stage": 1},
        "checkpoint": {"every_steps": 100},
        "logging": {"every_steps": 1, "image_every_steps": 8},
    }
    if stage == "tokenizer":  # the VQ-VAE's shape is its objective's; a model section would be refused as unread
        del recipe["model"]
    for key, value in sections.items():
        recipe[key] = {**recipe.get(key, {}), **value}
    return recipe


@pytest.fixture(scope="session")
def tokenizer_run(fmnist, tmp_path_factory):
    """The tokenizer stage, 2 processes, ZeRO-2: a VQ-VAE at 28 px, 4 px per code (7x7 grid), 64 codes."""
    tmp = tmp_path_factory.mktemp("tokenizer")
    objective = {
        "kind": "vqvae",
        "img_size": 28,
        "downsample": 4,
        "codebook_size": 64,
        "hidden_dim": 32,
        "ema_decay": 0.9,
    }
    recipe = _recipe("tokenizer", tmp / "run", fmnist, objective, schedule={"steps": 60}, engine={"zero_stage": 2})
    proc = launch(write_recipe(tmp / "tiny_tokenizer.yaml", recipe))
    assert proc.returncode == 0, proc.stdout[-4000:]
    return tmp / "run", proc.stdout


def test_tokenizer_stage_trains_and_uses_its_codebook(tokenizer_run):
    run_dir, output = tokenizer_run
    metrics = [m for m in read_metrics(run_dir) if "train/recon_loss" in m]
    first, last = metrics[0], metrics[-1]
    assert last["train/recon_loss"] < 0.5 * first["train/recon_loss"]
    assert last["train/codes_used"] >= 0.3 and last["train/perplexity"] >= 0.3 * 64
    manifest = json.loads((run_dir / "export" / "mimpipe.json").read_text())
    assert manifest["kind"] == "vqvae" and manifest["vocab_size"] == 64 and manifest["grid"] == [7, 7]
    assert (run_dir / "export" / "tokenizer.safetensors").is_file()
    assert "tokenizer exported to" in output
    events = _tensorboard(run_dir)
    assert {"train/reconstruction", "train/code_usage"} <= set(events.Tags()["images"])
    usage = events.Histograms("train/code_usage")[-1].histogram_value  # the codes of the fixed batch of 64 images
    assert usage.num == 64 * 7 * 7 and len(usage.bucket) == 64
    content = events.PluginTagToContent(hparams_metadata.PLUGIN_NAME)[hparams_metadata.SESSION_START_INFO_TAG]
    hparams = HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["objective.kind"].string_value == "vqvae" and hparams["objective.codebook_size"].number_value == 64


def _tensorboard(run_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(run_dir / "tb"), size_guidance={HISTOGRAMS: 0, IMAGES: 0})
    events.Reload()
    return events


@pytest.mark.parametrize("target", ["mean_color_3bit", "color_3bit_4x4", "pixels_l2", "tokenizer"])
def test_every_target_trains_through_the_engine(target, fmnist, tokenizer_run, tmp_path):
    objective = {
        "kind": "beit",
        "mask": {"kind": "blockwise", "num_masked": 20, "min_patches": 4},
        "target": {"kind": target, **({"path": str(tokenizer_run[0] / "export")} if target == "tokenizer" else {})},
    }
    if target == "mean_color_3bit":  # the ViT paper's variant
        objective.update(mask={"kind": "random", "ratio": 0.5}, corruption="mixed")
    recipe = _recipe("pretrain", tmp_path / "run", fmnist, objective, schedule={"steps": 24})
    proc = launch(write_recipe(tmp_path / f"tiny_{target}.yaml", recipe), nproc=1)
    assert proc.returncode == 0, proc.stdout[-4000:]
    loss = losses(tmp_path / "run")
    first, last = [loss[s] for s in range(1, 5)], [loss[s] for s in range(21, 25)]
    assert sum(last) < 0.95 * sum(first), loss
    if target != "pixels_l2":
        acc = [m["train/mlm_acc"] for m in read_metrics(tmp_path / "run") if "train/mlm_acc" in m]
        assert len(acc) == 24 and sum(acc[-4:]) > sum(acc[:4])
    pictures = _tensorboard(tmp_path / "run").Images("train/masked_patches")
    assert [picture.step for picture in pictures] == [1, 8, 16, 24]


def test_beit_export_loads_in_timm_and_hands_off(fmnist, tokenizer_run, tmp_path, monkeypatch):
    objective = {
        "kind": "beit",
        "mask": {"kind": "blockwise", "num_masked": 20, "min_patches": 4},
        "target": {"kind": "tokenizer", "path": str(tokenizer_run[0] / "export")},
        "head": "mlp",
    }
    pretrain = _recipe(
        "pretrain",
        tmp_path / "beit",
        fmnist,
        objective,
        model={"layer_scale_init": 0.1, "drop_path_rate": 0.1},
        engine={"zero_stage": 2},
        schedule={"steps": 4},
    )
    proc = launch(write_recipe(tmp_path / "tiny_beit.yaml", pretrain))
    assert proc.returncode == 0, proc.stdout[-4000:]
    export = tmp_path / "beit" / "export"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = timm.create_model(f"local-dir:{export}", pretrained=True)
    exported = load_file(str(export / "model.safetensors"))
    assert set(model.state_dict()) == set(exported) and "blocks.0.ls1.gamma" in exported
    assert all(torch.equal(model.state_dict()[k], v) for k, v in exported.items())
    manifest = json.loads((export / "mimpipe.json").read_text())
    assert manifest["method"] == "beit" and "mask_token" in manifest["not_exported"]
    assert not any(k.startswith(("target", "tokenizer")) for k in manifest["not_exported"])  # frozen, not ours

    finetune = _recipe(
        "finetune",
        tmp_path / "ft",
        fmnist,
        {"kind": "classification"},
        model={"img_size": 32, "global_pool": "avg", "init": str(export), "layer_scale_init": 0.1},
        data={"val": str(fmnist["test"]), "eval_crop_pct": 1.0},
        schedule={"steps": 2},
        optim={"lr_rule": "scaled"},
    )
    proc = launch(write_recipe(tmp_path / "tiny_beit_ft.yaml", finetune))
    assert proc.returncode == 0, proc.stdout[-4000:]
    report = json.loads((tmp_path / "ft" / "load_report.json").read_text())
    assert report["resized"] == [["pos_embed", [7, 7], [8, 8]]]
    assert {"head.weight", "head.bias"} <= set(report["initialised"])
    assert "left at pretraining" in proc.stdout and "mask_token" in proc.stdout
