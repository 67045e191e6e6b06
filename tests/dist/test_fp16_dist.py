"""Recipes: the tiny MAE (tests/launching.py `pretrain_recipe`) and its fine-tuning (`finetune_recipe`, distilled) in
`engine.precision: fp16`, 2 gloo processes under torchrun, with fp16 allowed on this CPU by tests/dist/cpu_fp16.py."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from core.export.folder import export_model
from core.models.vit import build_vit, vit_model_args
from tests.launching import REPO, finetune_recipe, pretrain_recipe, read_metrics, torchrun, write_recipe

pytestmark = pytest.mark.dist


def pretrain_fp16(shards, tmp_path: Path, name: str, **engine) -> Path:
    recipe = pretrain_recipe(shards, tmp_path / name, engine={"precision": "fp16", **engine})
    proc = torchrun("cpu_fp16.py", "pretrain", write_recipe(tmp_path / f"{name}.yaml", recipe))
    assert "precision fp16" in proc.stdout
    return tmp_path / name


def offline_export(run_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    cmd = [sys.executable, "-m", "pretrain", "export", str(run_dir), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(out / "model.safetensors")


def assert_exports_fp32_masters(run_dir: Path, tmp_path: Path) -> None:
    """The run's own export equals `python -m pretrain export` of its last checkpoint (DeepSpeed's fp32 partitions, or
    at ZeRO-0 the fp16 optimizer's named fp32 groups), and holds fp32 values, not the fp16 copy rounded."""
    live = load_file(run_dir / "export" / "model.safetensors")
    offline = offline_export(run_dir, tmp_path / f"{run_dir.name}_offline")
    assert live.keys() == offline.keys()
    assert all(torch.equal(live[k], offline[k]) for k in live)
    rounded = [k for k, v in live.items() if torch.equal(v, v.half().float())]
    assert rounded == ["pos_embed"]  # MAE's fixed sin-cos: frozen, so it has no fp32 copy


def test_fp16_trains_like_bf16_at_zero2_and_zero3_and_hands_off(zero2_run, shards, tmp_path):
    bf16 = {m["step"]: m for m in read_metrics(zero2_run[0]) if "train/loss" in m}  # the same recipe in bf16
    for stage in (2, 3):
        run_dir = pretrain_fp16(shards, tmp_path, f"zero{stage}", zero_stage=stage)
        metrics = [m for m in read_metrics(run_dir) if "train/loss" in m]
        assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
        assert all(m["train/loss_scale"] == 2.0**16 and m["train/skipped_steps"] == 0 for m in metrics)
        assert all(math.isfinite(m["train/loss"]) for m in metrics)
        for m in metrics:  # unscaled gradients: a loss scale applied twice or not at all shows as a factor of 65536
            assert 0.5 < m["train/grad_norm"] / bf16[m["step"]]["train/grad_norm"] < 2
        if stage == 2:  # the same initial weights and batches as the bf16 run (ZeRO-3 initialises under zero.Init)
            assert all(abs(m["train/loss"] - bf16[m["step"]]["train/loss"]) < 0.01 for m in metrics), metrics
            assert metrics[0]["train/grad_norm"] == pytest.approx(bf16[1]["train/grad_norm"], rel=0.01)
        assert_exports_fp32_masters(run_dir, tmp_path)

    # Fine-tuning with a distillation teacher: the teacher stays fp32 outside DeepSpeed's fp16 cast and gets the half
    # batch back in fp32 (tests/unit/test_fp16_side_models.py checks the values).
    torch.manual_seed(0)
    teacher = build_vit("tiny", img_size=20, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=4)
    export_model(teacher, tmp_path / "teacher", model_args=vit_model_args(teacher), manifest={"method": "test"})
    recipe = finetune_recipe(shards, tmp_path / "finetune", tmp_path / "zero2" / "export", precision="fp16")
    recipe["model"] |= {"global_pool": "token"}
    recipe["distill"] = {"kind": "soft", "teacher": str(tmp_path / "teacher")}
    recipe["optim"] |= {"ema_decay": 0.9}
    torchrun("cpu_fp16.py", "finetune", write_recipe(tmp_path / "finetune.yaml", recipe))
    train = [m for m in read_metrics(tmp_path / "finetune") if "train/loss" in m]
    assert len(train) == 2 and all(
        math.isfinite(m["train/loss"]) and math.isfinite(m["train/loss_teacher"]) for m in train
    )
    evals = [m for m in read_metrics(tmp_path / "finetune") if "val/top1" in m]
    assert [m["step"] for m in evals] == [2, 4] and all(m["val/samples"] == 203 for m in evals)
    assert all(math.isfinite(m["val/loss"]) and math.isfinite(m["val_ema/loss"]) for m in evals)
    config_json = (tmp_path / "finetune" / "export" / "config.json").read_text()
    assert '"num_classes": 4' in config_json


@pytest.mark.faults
def test_fp16_overflow_skips_steps_and_halves_the_scale_at_zero0(shards, tmp_path):
    """Starting at 2^20 the scaled gradients overflow fp16: DeepSpeed skips those steps and halves the scale each
    time until the gradients fit, then trains. At ZeRO-0 only the loop scales the loss (core/compat/deepspeed.py,
    `zero0_fp16_loss_scale`): without it nothing would overflow here, and every update would be 2^20 times too small."""
    run_dir = pretrain_fp16(shards, tmp_path, "zero0", zero_stage=0, fp16_initial_scale_power=20)
    metrics = [m for m in read_metrics(run_dir) if "train/loss" in m]
    skipped = int(metrics[-1]["train/skipped_steps"])
    assert 2 <= skipped < len(metrics), metrics
    for m in metrics:
        step = m["step"]
        assert m["train/skipped_steps"] == min(step, skipped)
        assert m["train/loss_scale"] == 2.0 ** (20 - min(step, skipped))
        assert ("train/grad_norm" in m) == (step > skipped)  # no gradient norm of a skipped step
        assert math.isfinite(m["train/loss"])
    assert_exports_fp32_masters(run_dir, tmp_path)

    # resumed from step 3 (mid-way through the skips), steps 4-6 repeat: loss scale and skip count are checkpointed
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000006")
    (resumed / "checkpoints" / "latest").write_text("step_00000003")
    (resumed / "metrics.jsonl").unlink()
    recipe = tmp_path / "resumed.yaml"
    recipe.write_text((run_dir / "config.yaml").read_text().replace(str(run_dir), str(resumed)))
    torchrun("cpu_fp16.py", "pretrain", recipe)
    again = {m["step"]: m for m in read_metrics(resumed) if "train/loss" in m}
    assert sorted(again) == [4, 5, 6]
    for m in metrics[3:]:
        assert again[m["step"]]["train/loss"] == pytest.approx(m["train/loss"], rel=1e-6, abs=1e-7)
        assert again[m["step"]]["train/loss_scale"] == m["train/loss_scale"]
        assert again[m["step"]]["train/skipped_steps"] == m["train/skipped_steps"]
