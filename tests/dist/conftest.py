"""Session fixtures of tests/dist: one finished tiny MAE run that several files read, resume or fine-tune from.
Runs are started with tests/launching.py: `launch` (./launch.sh, as a user) and `torchrun` (a worker script)."""

from __future__ import annotations

import pytest

from tests.launching import launch, pretrain_recipe, write_recipe


@pytest.fixture(scope="session")
def zero2_run(shards, tmp_path_factory):
    """6 steps of MAE, ZeRO-2, 2 processes, checkpoints at 3 and 6, W&B offline beside TensorBoard: (run_dir, launch
    output)."""
    tmp = tmp_path_factory.mktemp("zero2")
    wandb = {"wandb": {"enabled": True, "mode": "offline", "project": "tests"}}
    recipe = write_recipe(tmp / "tiny_mae.yaml", pretrain_recipe(shards, tmp / "run", logging=wandb))
    proc = launch(recipe)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return tmp / "run", proc.stdout
