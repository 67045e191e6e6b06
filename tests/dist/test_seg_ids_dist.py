"""`finetune predict` writes the dataset's own ids. Recipe: `seg_recipe` below, a tiny ViT under the linear head trained
from scratch on a tiny set in ADE20K's release layout (ids 1..3 in the annotations, 0 = "other"), written with
`python -m data write --source segfolder` with and without reduce-zero-label; each image one flat colour, one class,
so a per-pixel model learns it exactly. Predicted on the raw validation images, the masks equal the original
annotations on every labelled pixel; with `--training-ids` they equal them after the reduction. (A set written
without the reduction keeps the annotations' ids in its shards and `predict` writes them unchanged:
tests/unit/test_seg_ids.py; Fashion-MNIST scenes, such a set, are predicted and scored in test_segmentation_dist.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from data.__main__ import main as data_main
from tests.launching import REPO, TINY_MODEL, launch, write_recipe

pytestmark = pytest.mark.dist

COLOURS = [(200, 30, 30), (30, 200, 30), (30, 30, 200)]  # class ids 1, 2, 3 in the annotations


def ade_layout(root: Path) -> Path:
    """images/{training,validation}/*.jpg and annotations/.../*.png: image i is flat colour i % 3 (a little noise),
    its annotation that class's id (1-3) with its top 4 rows 0, "other"."""
    rng = np.random.default_rng(0)
    for folder, count in (("training", 24), ("validation", 6)):
        for kind in ("images", "annotations"):
            (root / kind / folder).mkdir(parents=True)
        for i in range(count):
            colour = np.array(COLOURS[i % 3], dtype=np.int16)
            pixels = np.clip(colour + rng.integers(-10, 11, (32, 32, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / "images" / folder / f"img{i:03d}.jpg", quality=95)
            annotation = np.full((32, 32), i % 3 + 1, dtype=np.uint8)
            annotation[:4] = 0
            Image.fromarray(annotation).save(root / "annotations" / folder / f"img{i:03d}.png")
    return root


def seg_recipe(shards: Path, run_dir: Path) -> dict:
    return {
        "stage": "finetune",
        "run_dir": str(run_dir),
        "model": {**TINY_MODEL, "img_size": 32},
        "data": {"train": str(shards / "train"), "val": str(shards / "val"), "global_batch_size": 8, "num_workers": 1},
        "objective": {"kind": "segmentation", "head": "linear", "aux_weight": 0.0, "photometric": False},
        "optim": {"base_lr": 4e-3, "lr_base_batch": 8},
        "schedule": {"steps": 30, "warmup_steps": 2},
        "engine": {"device": "cpu", "zero_stage": 0},
        "checkpoint": {"every_steps": 30},
        "logging": {"every_steps": 10, "image_every_steps": 0},
        "eval": {"every_steps": 30},
    }


def train_and_predict(root: Path, tmp: Path, name: str, *flags: str) -> tuple[Path, dict]:
    """Shards of the layout (with `flags` for `data write`), a run, and `finetune predict` of the raw validation
    images: (the masks' folder, the run's manifest)."""
    shards = tmp / f"{name}_shards"
    for split in ("train", "val"):
        data_main(["write", "--source", "segfolder", "--path", str(root), "--split", split,
                   "--out", str(shards / split), "--shard-size", "12", *flags])  # fmt: skip
    run_dir = tmp / f"{name}_run"
    proc = launch(write_recipe(tmp / f"{name}.yaml", seg_recipe(shards, run_dir)), nproc=1)
    assert proc.returncode == 0, proc.stdout[-4000:]
    masks = tmp / f"{name}_masks"
    for out, extra in ((masks, []), (masks.with_name(f"{masks.name}_training"), ["--training-ids"])):
        cmd = [sys.executable, "-m", "finetune", "predict", str(run_dir / "export"),
               "--images", str(root / "images" / "validation"), "--out", str(out), *extra]  # fmt: skip
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
    return masks, json.loads((run_dir / "export" / "mimpipe.json").read_text())


def read(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        assert image.mode == "P"
        return np.array(image)


def test_masks_carry_the_dataset_s_own_ids_and_the_training_ids_on_request(tmp_path):
    root = ade_layout(tmp_path / "ADEChallengeData2016")
    masks, manifest = train_and_predict(root, tmp_path, "reduced")
    assert manifest["segmentation"]["reduce_zero_label"] is True and manifest["segmentation"]["num_classes"] == 3
    annotations = sorted((root / "annotations" / "validation").glob("*.png"))
    for annotation in annotations:
        truth = np.array(Image.open(annotation))
        labelled = truth != 0  # "other" is never predicted, never scored
        predicted = read(masks / annotation.name)
        assert (predicted[labelled] == truth[labelled]).all(), annotation.name  # the annotation's own ids
        assert set(np.unique(predicted)) <= {1, 2, 3}
        training = read(masks.with_name(f"{masks.name}_training") / annotation.name)
        assert (training[labelled] == truth[labelled] - 1).all()  # after the reduction: 0..2
    legend = json.loads((masks / "classes.json").read_text())
    assert [(c["id"], c["training_id"]) for c in legend] == [(1, 0), (2, 1), (3, 2)]
    training_legend = json.loads((masks.with_name(f"{masks.name}_training") / "classes.json").read_text())
    assert [c["id"] for c in training_legend] == [0, 1, 2]
