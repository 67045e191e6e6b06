"""Recipe: the tiny MAE of tests/dist (conftest `pretrain_recipe`) on CUDA, bf16 and fp16. Skipped without a GPU."""

from __future__ import annotations

import math

import pytest
import torch

from tests.launching import launch, losses, pretrain_recipe, write_recipe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_tiny_mae_trains_on_cuda(shards, tmp_path, precision):
    recipe = pretrain_recipe(
        shards, tmp_path / "run", engine={"zero_stage": 2, "precision": precision, "device": "cuda"}
    )
    proc = launch(write_recipe(tmp_path / "tiny_mae_cuda.yaml", recipe), nproc=1)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "on cuda" in proc.stdout
    steps = losses(tmp_path / "run")
    assert sorted(steps) == [1, 2, 3, 4, 5, 6] and all(math.isfinite(v) for v in steps.values())
