"""Recipe: defaults + the toy objective of tests/dist/nonfinite_worker.py, 2 gloo processes, ZeRO-2 in fp32, 16
steps, checkpoints every 4, a loss spike injected on rank 1 (tests/dist/ckpt_fault_worker.py)."""

from __future__ import annotations

import json
import math

import pytest

from tests.launching import read_metrics, torchrun

pytestmark = [pytest.mark.dist, pytest.mark.faults]  # spikes and a full disk on purpose: `make test-faults`


def _ranks(out) -> list[dict]:
    return [json.loads((out / f"rank_{rank}.json").read_text()) for rank in (0, 1)]


def test_a_loss_spike_rolls_every_rank_back_and_training_goes_on_past_its_data(tmp_path):
    proc = torchrun("ckpt_fault_worker.py", tmp_path, "spike")
    # batch 11 spiked at step 11, seen at the read of step 12 (a checkpoint step, so step 12 was not saved then)
    assert "[mimpipe] loss spike: train/loss" in proc.stdout and "at step 11 > 20 x its running median" in proc.stdout
    assert "rolled back from step 12 to checkpoint step_00000008 (rollback 1 of at most 3)" in proc.stdout
    for result in _ranks(tmp_path):
        assert result["error"] is None
        assert result["state"]["step"] == 16 and result["state"]["rollbacks"] == 1
        # steps 9-12 ran twice: 20 batches, each drawn once; after the rollback the stream went on with batch 13
        assert result["drawn"] == list(range(1, 21)) and result["state"]["batches_consumed"] == 20
    assert _ranks(tmp_path)[0]["weights"] == _ranks(tmp_path)[1]["weights"]
    metrics = read_metrics(tmp_path / "run")
    # step 10, logged before the rollback, is dropped with it and logged again after it; step 12 only after it
    assert [m["step"] for m in metrics] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert all(math.isfinite(m["train/loss"]) and m["train/loss"] < 100 for m in metrics)
    assert [m["train/rollbacks"] for m in metrics] == [0, 0, 0, 0, 1, 1, 1, 1]
    ckpt_dir = tmp_path / "run" / "checkpoints"
    assert (ckpt_dir / "latest").read_text() == "step_00000016"
    assert sorted(p.name for p in ckpt_dir.glob("step_*")) == [f"step_{s:08d}" for s in (4, 8, 12, 16)]


def test_a_rerun_with_the_same_spike_gives_the_same_weights(tmp_path):
    for attempt in ("first", "second"):
        torchrun("ckpt_fault_worker.py", tmp_path / attempt, "spike")
    assert _ranks(tmp_path / "first")[0]["weights"] == _ranks(tmp_path / "second")[0]["weights"]
    assert _ranks(tmp_path / "first")[0]["state"]["rollbacks"] == 1


def test_a_full_disk_midway_through_a_save_and_too_many_rollbacks(tmp_path):
    """The save of step 8 fails with ENOSPC on rank 1 midway; the run goes on. At the spike, engine.max_rollbacks=0
    stops it with one line. `latest` names step 4 throughout, and no partial folder is left."""
    proc = torchrun("ckpt_fault_worker.py", tmp_path, "stop")
    assert "[mimpipe] warning: checkpoint of step 8 failed (rank 1: [Errno 28] No space left on device" in proc.stdout
    assert "partial folder removed, checkpoints/latest still names step_00000004" in proc.stdout
    for result in _ranks(tmp_path):
        assert result["error"].startswith("stopping: train/loss") and "after 0 rollbacks" in result["error"]
        assert (
            "engine.max_rollbacks=0" in result["error"]
            and "the last good checkpoint is step_00000004" in result["error"]
        )
        assert result["state"]["step"] == 11 and result["state"]["rollbacks"] == 0
    ckpt_dir = tmp_path / "run" / "checkpoints"
    assert (ckpt_dir / "latest").read_text() == "step_00000004"
    assert sorted(p.name for p in ckpt_dir.glob("step_*")) == ["step_00000004"]
