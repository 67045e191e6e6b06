"""Weights & Biases beside TensorBoard (core/report/wandb_log.py, offline as the tests keep it: tests/conftest.py): the
offline run's files hold metrics.jsonl's scalars, its images and histograms; a resumed or rolled-back run continues
the one W&B run and sends no step twice; without wandb installed, `logging.wandb.enabled` fails at start-up."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from core.recipe.config import ConfigError, WandbConfig, load_config
from core.report.logging import MetricsLogger
from core.report.wandb_log import ID_FILE, WandbSink
from tests.helpers.wandb_files import history, offline_runs, run_ids

OFFLINE = WandbConfig(enabled=True, mode="offline", project="tests")


def jsonl(run_dir) -> dict[int, dict]:
    """metrics.jsonl by step, without its `time`."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {m.pop("step"): {k: v for k, v in m.items() if k != "time"} for m in map(json.loads, lines)}


def test_offline_run_holds_the_scalars_images_and_histograms(tmp_path):
    logger = MetricsLogger(tmp_path, enabled=True, tensorboard=False, wandb=OFFLINE)
    logger.hparams({"optim": {"base_lr": 1e-3}})
    for step in range(1, 5):
        logger.scalars(step, {"train/loss": 1.0 / step, "train/lr": 1e-3 * step})
    image = torch.zeros(3, 4, 6)
    image[0, 1, 2] = 1.0
    logger.image("pictures/recon", 4, image)
    logger.histogram_counts("train/code_usage", 4, torch.tensor([3.0, 0.0, 5.0]))
    logger.close()
    [run] = offline_runs(tmp_path)
    rows = history(run)
    logged = jsonl(tmp_path)
    assert {step: {k: rows[step][k] for k in scalars} for step, scalars in logged.items()} == logged
    assert rows[4]["pictures/recon/_type"] == "image-file"
    sent = np.asarray(Image.open(run.parent / "files" / rows[4]["pictures/recon/path"]).convert("RGB"))
    assert np.array_equal(sent, (image * 255).to(torch.uint8).permute(1, 2, 0).numpy())  # (H, W, 3) as TensorBoard's
    assert rows[4]["train/code_usage/values"] == [3, 0, 5]
    assert rows[4]["train/code_usage/bins"] == [-0.5, 0.5, 1.5, 2.5]
    assert run_ids(run) == {(tmp_path / ID_FILE).read_text().strip()}


def test_resumed_run_continues_the_run_and_sends_no_step_twice(tmp_path):
    first = MetricsLogger(tmp_path, enabled=True, tensorboard=False, wandb=OFFLINE)
    for step in range(1, 7):
        first.scalars(step, {"train/loss": float(step)})
    first.close()  # interrupted after step 6; the checkpoint is step 4's
    resumed = MetricsLogger(tmp_path, enabled=True, tensorboard=False, resume_step=4, wandb=OFFLINE)
    for step in (5, 6, 7, 8):
        resumed.scalars(step, {"train/loss": 100.0 + step})
    resumed.rewind(7)  # a rollback to step 7's checkpoint: step 8 is trained again
    resumed.scalars(8, {"train/loss": 1000.0})
    resumed.scalars(9, {"train/loss": 109.0})
    resumed.close()
    runs = offline_runs(tmp_path)
    assert len(runs) == 2 and run_ids(runs[0]) == run_ids(runs[1])  # one W&B run, one folder per launch
    sent = [{s: row["train/loss"] for s, row in history(run).items()} for run in runs]
    # W&B keeps the first values of a step: steps 5 and 6 stay the first launch's, step 8 the one before the rollback
    assert sent == [{1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, 5: 5.0, 6: 6.0}, {7: 107.0, 8: 108.0, 9: 109.0}]
    logged = jsonl(tmp_path)
    assert all(logged[step]["train/loss"] == sent[1][step] for step in (7, 9))


def test_steps_are_sent_in_order_and_a_repeated_step_adds_to_its_row(tmp_path):
    sink = WandbSink(OFFLINE, tmp_path)
    sink.log(2, {"train/loss": 2.0})
    sink.log(2, {"eval/top1": 0.5})
    sink.log(1, {"train/loss": 1.0})  # below the last step sent: W&B would refuse it
    sink.log(3, {"train/loss": 3.0})
    sink.close()
    assert history(offline_runs(tmp_path)[0]) == {2: {"train/loss": 2.0, "eval/top1": 0.5}, 3: {"train/loss": 3.0}}


def test_a_histogram_wider_than_wandbs_limit_merges_neighbouring_values(tmp_path):
    sink = WandbSink(OFFLINE, tmp_path)
    counts = torch.arange(1000, dtype=torch.float64)  # 1000 values, W&B takes at most 512 buckets
    histogram = sink.histogram(counts)
    sink.close()
    assert histogram.histogram == [float(2 * i + 2 * i + 1) for i in range(500)]
    assert histogram.bins[0] == -0.5 and histogram.bins[-1] == 999.5 and len(histogram.bins) == 501


def test_wandb_missing_fails_at_start_up_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError, as when not installed
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"run_dir={tmp_path}", "logging.wandb.enabled=true"])
    [line] = [line for line in str(err.value).splitlines() if "wandb" in line]
    assert line.strip() == ("logging.wandb.enabled needs wandb, which is not installed: pip install 'mimpipe[wandb]'")
    load_config(None, [f"run_dir={tmp_path}"])  # off (the default), it is not needed
    with pytest.raises(ImportError, match=r"pip install 'mimpipe\[wandb\]'"):
        WandbSink(WandbConfig.model_construct(enabled=True), tmp_path)


def test_the_run_id_is_kept_in_the_run_dir_and_wandb_dir_defaults_there(tmp_path):
    elsewhere = WandbConfig(enabled=True, mode="offline", dir=str(tmp_path / "wb"))
    WandbSink(elsewhere, tmp_path / "run").close()
    WandbSink(elsewhere, tmp_path / "run").close()
    runs = offline_runs(tmp_path / "wb")
    assert len(runs) == 2 and not offline_runs(tmp_path / "run")
    assert run_ids(runs[0]) == run_ids(runs[1]) == {(tmp_path / "run" / ID_FILE).read_text().strip()}
