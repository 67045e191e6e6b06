"""Session fixtures for tests/dist and tests/gpu: synthetic shards and one finished tiny MAE run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launching import launch, pretrain_recipe, write_recipe, write_synthetic


@pytest.fixture(scope="session")
def shards(tmp_path_factory) -> dict[str, Path]:
    """Synthetic 16 px, 4 classes: train 512 samples in 8 shards, val 203 samples in 3 uneven shards."""
    root = tmp_path_factory.mktemp("shards")
    return {
        "train": write_synthetic(root / "train", "train", 512, 64, seed=0),
        "val": write_synthetic(root / "val", "val", 203, 70, seed=1),
    }


@pytest.fixture(scope="session")
def zero2_run(shards, tmp_path_factory):
    """6 steps of MAE, ZeRO-2, 2 processes, checkpoints at 3 and 6."""
    tmp = tmp_path_factory.mktemp("zero2")
    recipe = write_recipe(tmp / "tiny_mae.yaml", pretrain_recipe(shards, tmp / "run"))
    proc = launch(recipe)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return tmp / "run", proc.stdout
