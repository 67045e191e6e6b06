"""Non-resampled streams over shards of very different sizes, 2 ranks x 2 data workers, through ./launch.sh: the run
length comes from the shards' index.json counts, and no rank waits for another that ran out of data."""

from __future__ import annotations

import pytest

from data.specs import dataset_size, resolve_shards
from tests.launching import launch, losses, pretrain_recipe, write_recipe, write_synthetic

pytestmark = pytest.mark.dist

SIZES = (3, 40, 7, 90, 12)  # samples per shard; 152 in all


def test_uneven_shards_two_ranks_two_workers_finish_every_step(tmp_path):
    shards = []
    for i, size in enumerate(SIZES):  # one shard per directory, each with its own index.json
        shards += resolve_shards(str(write_synthetic(tmp_path / f"part{i}", "train", size, size, seed=i)))
    assert dataset_size(shards) == sum(SIZES)
    recipe = pretrain_recipe(
        {"train": shards},
        tmp_path / "run",
        data={"resampled": False, "num_workers": 2, "global_batch_size": 8, "shuffle_buffer": 16},
        checkpoint={"every_steps": 1000},
        logging={"every_steps": 1, "image_every_steps": 0},
    )
    recipe["data"]["train"] = shards
    recipe["schedule"] = {"epochs": 2, "warmup_steps": 2}
    proc = launch(write_recipe(tmp_path / "uneven.yaml", recipe), timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:]
    # 2 passes over 152 samples at 8 per step: 38 steps on both ranks, although in each pass one rank's shards hold
    # far more samples than the other's (e.g. 90 + 3 against 40 + 7 + 12).
    assert "warmup 2 of 38 steps" in proc.stdout
    assert sorted(losses(tmp_path / "run")) == list(range(1, 39))
