"""Recipe: tiny fine-tune (tests/launching.py `finetune_recipe`) from the tiny MAE export, 16 -> 20 px, checkpoints
at steps 2 and 4, 2 gloo processes through ./launch.sh."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.launching import finetune_recipe, launch, read_metrics, write_recipe

pytestmark = pytest.mark.dist


def _recipe(shards, run_dir: Path, init: Path, zero_stage: int) -> Path:
    recipe = finetune_recipe(shards, run_dir, init, zero_stage=zero_stage)
    recipe["checkpoint"] = {"every_steps": 2}
    recipe["model"]["global_pool"] = "auto"  # the MAE export's pooling_hint says avg
    return write_recipe(run_dir.parent / f"tiny_finetune_zero{zero_stage}.yaml", recipe)


@pytest.fixture(scope="module")
def finetuned(zero2_run, shards, tmp_path_factory):
    """`finetuned(zero_stage)`: (run_dir, output) of the tiny fine-tune at that ZeRO stage, run once per module."""
    runs = {}

    def run(zero_stage: int) -> tuple[Path, str]:
        if zero_stage not in runs:
            run_dir = tmp_path_factory.mktemp(f"finetune_zero{zero_stage}") / "run"
            proc = launch(_recipe(shards, run_dir, zero2_run[0] / "export", zero_stage))
            assert proc.returncode == 0, proc.stdout[-4000:]
            runs[zero_stage] = run_dir, proc.stdout
        return runs[zero_stage]

    return run


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_handoff_resize_and_exactly_once_eval(finetuned, zero_stage):
    run_dir, output = finetuned(zero_stage)
    # The saved configs are the one the run used: the pooling resolved from the export's hint, not "auto".
    for saved in (run_dir / "config.yaml", run_dir / "checkpoints" / "step_00000004" / "config.yaml"):
        assert yaml.safe_load(saved.read_text())["model"]["global_pool"] == "avg", saved

    report = json.loads((run_dir / "load_report.json").read_text())
    assert report["resized"] == [["pos_embed", [4, 4], [5, 5]]]
    assert ["norm.weight", "fc_norm.weight"] in report["mapped"]
    assert {"head.weight", "head.bias"} <= set(report["initialised"])
    assert "pos_embed 4x4 -> 5x5" in output

    evals = [m for m in read_metrics(run_dir) if "val/top1" in m]
    assert [m["step"] for m in evals] == [2, 4]
    # 203 held-out samples in 3 uneven shards over 2 ranks with batch 16: each counted exactly once.
    assert all(m["val/samples"] == 203 for m in evals)
    assert all(0.0 <= m["val/top1"] <= m["val/top5"] <= 1.0 for m in evals)
    manifest = json.loads((run_dir / "export" / "mimpipe.json").read_text())
    assert manifest["method"] == "finetune" and manifest["metrics"]["val/samples"] == 203
    config = json.loads((run_dir / "export" / "config.json").read_text())
    assert config["num_classes"] == 4 and config["model_args"]["img_size"] in ([20, 20], 20)
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    assert [image.step for image in events.Images("val/confusion_matrix")] == [4]  # at the end only


def test_best_export_survives_a_resume_on_another_world_size(finetuned, zero2_run, shards, tmp_path):
    """Fine-tune on 2 processes, resume (a copy of that run) on 1 with a learning rate that wrecks the weights: the
    worse evaluation after the resume must not replace the exported best (elastic resume once dropped the best
    score). The learning rate is another config: the relaunch needs --allow-config-change."""
    run_dir = tmp_path / "run"
    shutil.copytree(finetuned(1)[0], run_dir)
    before = {m["step"]: m["val/top1"] for m in read_metrics(run_dir) if "val/top1" in m}
    best_step = max(before, key=lambda step: (before[step], -step))
    exported = (run_dir / "export" / "model.safetensors").read_bytes()

    recipe = _recipe(shards, run_dir, zero2_run[0] / "export", zero_stage=1)
    proc = launch(recipe, "schedule.steps=6", "optim.base_lr=100", "optim.min_lr=10", "--allow-config-change", nproc=1)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "world size changed from 2 to 1" in proc.stdout
    after = {m["step"]: m["val/top1"] for m in read_metrics(run_dir) if "val/top1" in m and m["step"] > 4}
    assert list(after) == [6] and after[6] < before[best_step]
    assert f"best val top1 {before[best_step]:.4f} at step {best_step}" in proc.stdout
    manifest = json.loads((run_dir / "export" / "mimpipe.json").read_text())
    assert manifest["step"] == best_step
    assert (run_dir / "export" / "model.safetensors").read_bytes() == exported
