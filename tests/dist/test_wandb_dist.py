"""A launched run with `logging.wandb` offline (the `zero2_run` fixture): rank 0's W&B run holds what TensorBoard
and metrics.jsonl got: the same scalars at the same steps, the reconstruction pictures, the run's settings."""

from __future__ import annotations

import json

import pytest

from tests.helpers.wandb_files import history, offline_runs, records, run_ids
from tests.launching import read_metrics

pytestmark = pytest.mark.dist


def test_offline_wandb_run_holds_the_runs_scalars_and_pictures(zero2_run):
    run_dir, _ = zero2_run
    [run] = offline_runs(run_dir)  # one W&B run: rank 0's
    assert run_ids(run) == {(run_dir / "wandb_id").read_text().strip()}
    rows = history(run)
    logged = {}
    for line in read_metrics(run_dir):
        logged.setdefault(line["step"], {}).update({k: v for k, v in line.items() if k not in ("step", "time")})
    assert sorted(rows) == sorted(logged) == [1, 2, 3, 4, 5, 6]
    for step, scalars in logged.items():
        assert {key: rows[step][key] for key in scalars} == pytest.approx(scalars, rel=1e-12), step
    pictures = [step for step, row in rows.items() if row.get("train/reconstruction/_type") == "image-file"]
    assert pictures == [1, 3, 6]  # logging.image_every_steps 3, and the last step, as in TensorBoard
    config = {}
    for record in records(run):
        if record.WhichOneof("record_type") == "config":
            config |= {item.key: json.loads(item.value_json) for item in record.config.update}
    assert config["optim"]["base_lr"] == 1e-3 and config["logging"]["wandb"]["mode"] == "offline"
