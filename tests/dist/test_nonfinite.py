"""Recipe: defaults + a toy objective (tests/dist/nonfinite_worker.py), 2 gloo processes, ZeRO 0 and 2 in fp32,
ZeRO-0 in fp16 (tests/dist/cpu_fp16.py)."""

from __future__ import annotations

import json

import pytest

from tests.launching import read_metrics, torchrun

pytestmark = [pytest.mark.dist, pytest.mark.faults]  # NaNs injected on purpose: `make test-faults`


# ZeRO-2 in fp32 is the next test's, with the host reading the agreement every 4 steps instead of every step.
@pytest.mark.parametrize(("zero_stage", "precision"), [(0, "fp32"), (0, "fp16")])
def test_nonfinite_loss_skips_update_on_every_rank_then_stops(tmp_path, zero_stage, precision):
    """Also: step 1's NaN gradients under a finite loss (rank 0 only, fp32) are skipped and counted alike."""
    torchrun("nonfinite_worker.py", tmp_path, zero_stage, precision, 1)
    grad_nan = precision != "fp16"
    ranks = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in (0, 1)]
    for result in ranks:
        snaps = {int(k): v for k, v in result["snapshots"].items()}
        assert (snaps[1] == snaps[2]) is grad_nan  # NaN gradients at step 1: no update on either rank
        assert snaps[2] != snaps[3]  # step 2 updated
        assert snaps[3] == snaps[4]  # NaN on rank 1 only at step 3: no rank updated
        assert snaps[4] != snaps[5]  # step 4 updated again
        assert snaps[5] == snaps[6] == snaps[7]  # steps 5 and 6 skipped
        assert "non-finite for 3 steps in a row" in result["error"] and "stopping at step 7" in result["error"]
        assert result["state"]["nonfinite_skipped"] == 4 + grad_nan
        assert result["masters"] is (True if precision == "fp16" else None)
    assert ranks[0]["snapshots"] == ranks[1]["snapshots"]
    # step 6 is inside the streak 5-7: its checkpoint is deferred, and the run stops at 7 before a finite step
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "step_00000004"
    assert not (tmp_path / "run" / "checkpoints" / "step_00000006").exists()
    skipped = {m["step"]: m["train/skipped_steps"] for m in read_metrics(tmp_path / "run")}
    assert skipped[1] == grad_nan and skipped[2] == grad_nan and skipped[3] == 1 + grad_nan
    assert skipped[6] == 3 + grad_nan


def test_updates_are_skipped_on_the_device_and_a_streak_between_reads_still_stops(tmp_path):
    """engine.sync_every_steps=4: the host reads the agreement at steps 4 and 8 only. Every non-finite step's update is
    still skipped at once on every rank; the streak 5-7 ended at step 8's finite loss, before the read, and stops the
    run all the same."""
    torchrun("nonfinite_worker.py", tmp_path, 2, "fp32", 4)
    ranks = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in (0, 1)]
    for result in ranks:
        snaps = {int(k): v for k, v in result["snapshots"].items()}
        assert snaps[2] != snaps[3] and snaps[3] == snaps[4] and snaps[4] != snaps[5]
        assert snaps[5] == snaps[6] == snaps[7] == snaps[8]  # 5, 6 and 7 skipped
        assert snaps[1] == snaps[2]  # NaN gradients on rank 0's partition: no rank stepped either partition
        assert "non-finite for 3 steps in a row" in result["error"] and "stopping at step 8" in result["error"]
        assert result["state"]["nonfinite_skipped"] == 5 and result["state"]["consecutive_nonfinite"] == 0
    assert ranks[0]["snapshots"] == ranks[1]["snapshots"]
    assert not (tmp_path / "run" / "checkpoints").exists()  # no checkpoint during or after the streak
