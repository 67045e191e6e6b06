"""Recipes: tiny MAE (tests/launching.py `pretrain_recipe`, 32 px) and a tiny fine-tune with `data.label_field`, one
process each through ./launch.sh, on img2dataset-style shards (jpg + txt + json, no .cls; tests/foreign_shards.py)
as a user would point them at web-scale data."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from tests.foreign_shards import CAPTION_ONLY, TRUNCATED, write_img2dataset_shards
from tests.launching import REPO, TINY_MODEL, launch, losses, pretrain_recipe, read_metrics, write_recipe

pytestmark = pytest.mark.dist

MODEL_32PX = {**TINY_MODEL, "img_size": 32, "patch_size": 8}


@pytest.fixture(scope="module")
def laion(tmp_path_factory):
    """Two shards of 20 keys each: 32 decodable images of every kind, 4 caption-only samples, 4 truncated JPEGs."""
    folder = tmp_path_factory.mktemp("laion")
    write_img2dataset_shards(folder, repeat=4)
    return folder


def test_mae_pretraining_on_unlabelled_shards_skips_and_counts_bad_samples(laion, tmp_path):
    recipe = pretrain_recipe(
        {"train": f"{laion}/{{00000..00001}}.tar"}, tmp_path / "run", model=MODEL_32PX,
        data={"global_batch_size": 8, "num_workers": 1, "shuffle_buffer": 0},
        schedule={"steps": 3, "warmup_steps": 1}, engine={"zero_stage": 0}, checkpoint={"every_steps": 3},
    )  # fmt: skip
    proc = launch(write_recipe(tmp_path / "mae_laion.yaml", recipe), nproc=1)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert sorted(losses(tmp_path / "run")) == [1, 2, 3] and all(
        math.isfinite(v) for v in losses(tmp_path / "run").values()
    )
    # 24 images: one whole shard (its 4 bad samples) and 8 of the other (1 or 2 of its bad ones) in either order.
    corrupt = [m["data/corrupt_samples"] for m in read_metrics(tmp_path / "run") if "data/corrupt_samples" in m]
    assert corrupt == sorted(corrupt) and corrupt[-1] in (5, 6)
    assert (
        f"skipping sample {CAPTION_ONLY}" in proc.stdout and f"corrupt image jpg of sample {TRUNCATED}" in proc.stdout
    )
    assert "needs an image and a .cls entry" not in proc.stdout
    assert (tmp_path / "run" / "export" / "model.safetensors").is_file()


def test_finetuning_with_label_field_on_indexed_json_labelled_shards(laion, tmp_path):
    index = [sys.executable, "-m", "data", "index", str(laion), "--label-field", "label"]
    done = subprocess.run(index, cwd=REPO, capture_output=True, text=True, check=True)
    assert "indexed 36 samples in 2 shards (4 classes from .json field label; without an image: 4)" in done.stdout
    recipe = {
        "stage": "finetune",
        "run_dir": str(tmp_path / "run"),
        "model": {**MODEL_32PX, "global_pool": "avg"},
        "data": {
            "train": str(laion), "val": str(laion), "label_field": "label", "global_batch_size": 8, "num_workers": 1,
            "eval_batch_size_per_device": 8, "eval_crop_pct": 1.0,
        },
        "objective": {"kind": "classification"},
        "optim": {"base_lr": 1e-3},
        "schedule": {"epochs": 1, "warmup_steps": 1},  # 36 indexed samples / 8 -> 5 steps
        "engine": {"device": "cpu", "zero_stage": 0},
        "checkpoint": {"every_steps": 5},
        "logging": {"every_steps": 1},
        "eval": {"every_steps": 5},
    }  # fmt: skip
    proc = launch(write_recipe(tmp_path / "finetune_laion.yaml", recipe), nproc=1)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "warmup 1 of 5 steps (~1.11 epochs of 36 samples)" in proc.stdout
    assert sorted(losses(tmp_path / "run")) == [1, 2, 3, 4, 5]
    (final,) = [m for m in read_metrics(tmp_path / "run") if "val/top1" in m]
    assert final["step"] == 5 and final["val/samples"] == 32  # every decodable image once, with its JSON label
