"""Recipe: tiny fine-tune (below) from the tiny MAE export, 16 -> 20 px, 2 gloo processes through ./launch.sh."""

from __future__ import annotations

import json

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.launching import TINY_MODEL, launch, read_metrics, write_recipe

pytestmark = pytest.mark.dist


def finetune_recipe(shards, run_dir, init, **engine) -> dict:
    return {
        "stage": "finetune",
        "run_dir": str(run_dir),
        "model": {**TINY_MODEL, "img_size": 20, "global_pool": "avg", "init": str(init)},
        "data": {
            "train": str(shards["train"]),
            "val": str(shards["val"]),
            "global_batch_size": 32,
            "num_workers": 1,
            "eval_batch_size_per_device": 16,
            "crop_scale": [0.5, 1.0],
            "eval_crop_pct": 1.0,
        },
        "objective": {"kind": "classification", "label_smoothing": 0.1},
        "optim": {"base_lr": 1e-3, "betas": [0.9, 0.999]},
        "schedule": {"steps": 4, "warmup_steps": 1},
        "engine": {"zero_stage": 1, **engine},
        "checkpoint": {"every_steps": 4},
        "logging": {"every_steps": 2},
        "eval": {"every_steps": 2},
    }


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_handoff_resize_and_exactly_once_eval(zero2_run, shards, tmp_path, zero_stage):
    pretrain_dir, _ = zero2_run
    recipe = finetune_recipe(shards, tmp_path / "run", pretrain_dir / "export", zero_stage=zero_stage)
    recipe["model"]["global_pool"] = "auto"  # the MAE export's pooling_hint says avg
    proc = launch(write_recipe(tmp_path / "tiny_finetune.yaml", recipe))
    assert proc.returncode == 0, proc.stdout[-4000:]
    # The saved configs are the one the run used: the pooling resolved from the hint, not "auto".
    for saved in (tmp_path / "run" / "config.yaml", tmp_path / "run" / "checkpoints" / "step_00000004" / "config.yaml"):
        assert yaml.safe_load(saved.read_text())["model"]["global_pool"] == "avg", saved

    report = json.loads((tmp_path / "run" / "load_report.json").read_text())
    assert report["resized"] == [["pos_embed", [4, 4], [5, 5]]]
    assert ["norm.weight", "fc_norm.weight"] in report["mapped"]
    assert {"head.weight", "head.bias"} <= set(report["initialised"])
    assert "pos_embed 4x4 -> 5x5" in proc.stdout

    evals = [m for m in read_metrics(tmp_path / "run") if "val/top1" in m]
    assert [m["step"] for m in evals] == [2, 4]
    # 203 held-out samples in 3 uneven shards over 2 ranks with batch 16: each counted exactly once.
    assert all(m["val/samples"] == 203 for m in evals)
    assert all(0.0 <= m["val/top1"] <= m["val/top5"] <= 1.0 for m in evals)
    manifest = json.loads((tmp_path / "run" / "export" / "mimpipe.json").read_text())
    assert manifest["method"] == "finetune" and manifest["metrics"]["val/samples"] == 203
    config = json.loads((tmp_path / "run" / "export" / "config.json").read_text())
    assert config["num_classes"] == 4 and config["model_args"]["img_size"] in ([20, 20], 20)
    events = EventAccumulator(str(tmp_path / "run" / "tb"))
    events.Reload()
    assert [image.step for image in events.Images("val/confusion_matrix")] == [4]  # at the end only


def test_best_export_survives_a_resume_on_another_world_size(zero2_run, shards, tmp_path):
    """Fine-tune on 2 processes, resume on 1 with a learning rate that wrecks the weights: the worse evaluation after
    the resume must not replace the exported best (elastic resume once dropped the best score)."""
    pretrain_dir, _ = zero2_run
    run_dir = tmp_path / "run"
    recipe = finetune_recipe(shards, run_dir, pretrain_dir / "export")
    recipe["checkpoint"] = {"every_steps": 2}
    recipe_path = write_recipe(tmp_path / "tiny_finetune.yaml", recipe)
    proc = launch(recipe_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    before = {m["step"]: m["val/top1"] for m in read_metrics(run_dir) if "val/top1" in m}
    best_step = max(before, key=lambda step: (before[step], -step))
    exported = (run_dir / "export" / "model.safetensors").read_bytes()

    proc = launch(recipe_path, "schedule.steps=6", "optim.base_lr=100", "optim.min_lr=10", nproc=1)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "world size changed from 2 to 1" in proc.stdout
    after = {m["step"]: m["val/top1"] for m in read_metrics(run_dir) if "val/top1" in m and m["step"] > 4}
    assert list(after) == [6] and after[6] < before[best_step]
    assert f"best val top1 {before[best_step]:.4f} at step {best_step}" in proc.stdout
    manifest = json.loads((run_dir / "export" / "mimpipe.json").read_text())
    assert manifest["step"] == best_step
    assert (run_dir / "export" / "model.safetensors").read_bytes() == exported
