"""perf/mfu in a real launch: the tiny MAE recipe, one process, ZeRO-2."""

from __future__ import annotations

import re

import pytest

from tests.launching import launch, pretrain_recipe, read_metrics, write_recipe

pytestmark = pytest.mark.dist


def test_one_process_run_logs_mfu(shards, tmp_path):
    recipe = pretrain_recipe(shards, tmp_path / "run", schedule={"steps": 3, "warmup_steps": 1})
    proc = launch(write_recipe(tmp_path / "tiny_mae.yaml", recipe), nproc=1)
    assert proc.returncode == 0, proc.stdout[-4000:]
    plan = re.search(
        r"utilisation: ([\d.e+]+) GFLOP per optimizer step per rank .* peak ([\d.e+]+) TFLOP/s", proc.stdout
    )
    assert plan is not None, proc.stdout[-4000:]
    assert float(plan[1]) > 0 and float(plan[2]) > 0
    logged = [m for m in read_metrics(tmp_path / "run") if "perf/images_per_sec" in m]
    assert [m["step"] for m in logged] == [1, 2, 3]
    assert all(0 < m["perf/mfu"] <= 1 for m in logged)
    assert re.search(r"step 3/3 .* mfu [\d.e-]+ ", proc.stdout)
