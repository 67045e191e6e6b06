"""`engine.compile` in real processes: the tiny fine-tune (tests/launching.py `finetune_recipe`) from the tiny MAE
export, 2 gloo processes at ZeRO-2 through ./launch.sh, compiled (the whole step, and the blocks for evaluation) with
an inductor cache of its own; evaluated at steps 2 and 4 on 203 samples (partial batches), resumed from step 2 (its
compile read from the cache), exported for timm."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file

import core.models.build  # noqa: F401  (registers the archs timm loads exports of)
from tests.launching import finetune_recipe, launch, losses, read_metrics, write_recipe

pytestmark = [pytest.mark.dist, pytest.mark.long]  # a cold compile: about a minute alone


def _launch(shards, run_dir: Path, init: Path, cache: Path) -> str:
    recipe = finetune_recipe(shards, run_dir, init, zero_stage=2, compile=True)
    recipe["checkpoint"] = {"every_steps": 2}
    recipe["model"]["global_pool"] = "auto"  # the MAE export's pooling_hint says avg
    proc = launch(
        write_recipe(run_dir.parent / "tiny_finetune_compiled.yaml", recipe),
        extra_env={"MIMPIPE_CACHE_DIR": str(cache)},
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


def test_compiled_finetune_evaluates_resumes_and_exports_for_timm(zero2_run, shards, tmp_path):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    output = _launch(shards, run_dir, zero2_run[0] / "export", cache)
    # 32 per step over 2 ranks and evaluation batches of 16: one batch size to compile for
    assert (
        "engine.compile (True): the objective's step at batch 16; model.blocks (2) at batches 16 compiled with "
        "inductor (default mode) on the first step" in output
    )
    first = re.search(
        r"first step: ([\d.]+) s, ([\d.]+) s of it torch.compile \(inductor cache (.+): (\d+) hits", output
    )
    assert first and 0 < float(first.group(2)) <= float(first.group(1))
    assert first.group(3) == str(cache / "inductor") and first.group(4) == "0"  # a cold cache of its own
    evals = [m for m in read_metrics(run_dir) if "val/top1" in m]
    assert [m["step"] for m in evals] == [2, 4] and all(m["val/samples"] == 203 for m in evals)
    assert all(0.0 <= m["val/top1"] <= 1.0 and m["val/loss"] > 0 for m in evals)

    resumed = tmp_path / "resumed"  # the same run, from its step-2 checkpoint
    shutil.copytree(run_dir, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000004")
    shutil.rmtree(resumed / "export")
    (resumed / "checkpoints" / "latest").write_text("step_00000002")
    (resumed / "metrics.jsonl").write_text("")
    output = _launch(shards, resumed, zero2_run[0] / "export", cache)
    assert "resumed from" in output
    warm = re.search(r"of it torch.compile \(inductor cache .+: (\d+) hits, (\d+) misses\)", output)
    assert warm and int(warm.group(1)) > 0 and warm.group(2) == "0"  # the relaunch compiled nothing anew
    torch.testing.assert_close(losses(resumed)[4], losses(run_dir)[4], rtol=1e-5, atol=0)

    state = load_file(run_dir / "export" / "model.safetensors")
    assert not [key for key in state if "_orig_mod" in key]
    model = timm.create_model(f"local-dir:{run_dir / 'export'}", pretrained=True)
    model.load_state_dict(state, strict=True)  # every key of the export, and only those
