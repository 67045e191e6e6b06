"""Recipe: defaults + the toy objective of tests/dist/nonfinite_worker.py, 2 gloo processes, ZeRO-2 in fp32, 16
steps, checkpoints every 4 (tests/dist/ckpt_fault_worker.py): a rank killed (SIGKILL) midway through writing the
checkpoint of step 8, then relaunched with a torn `latest`, then with bit rot in the newest checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from core.launch.ckpt_files import why_incomplete
from tests.helpers.files import rot_a_tensor
from tests.launching import REPO, free_port, torchrun

pytestmark = [pytest.mark.dist, pytest.mark.faults]


def test_a_rank_killed_mid_save_a_torn_latest_and_bit_rot_leave_a_resumable_run(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    cmd += [str(REPO / "tests" / "dist" / "ckpt_fault_worker.py"), str(tmp_path), "kill"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    killed = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr, killed.stderr[-3000:]
    ckpt_dir = tmp_path / "run" / "checkpoints"
    # the save of step 8 never finished: `latest` still names step 4, and step 8's folder is a stale partial one
    assert (ckpt_dir / "latest").read_text() == "step_00000004"
    assert "no completeness marker" in why_incomplete(ckpt_dir / "step_00000008")

    (ckpt_dir / "latest").write_bytes(b"step_000")  # and then `latest` torn as well (a crash of its own write)
    resumed = torchrun("ckpt_fault_worker.py", tmp_path, "resume")
    torn = f"[mimpipe] warning: {ckpt_dir / 'latest'} is unreadable or names no checkpoint"  # `step_000` is no tag
    assert torn in resumed.stdout
    assert f"{ckpt_dir / 'step_00000004'}, the newest complete one" in resumed.stdout
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank_{rank}.json").read_text())
        assert result["state"]["step"] == 16 and result["drawn"] == list(range(5, 17))  # from step 4's data position
    assert (ckpt_dir / "latest").read_text() == "step_00000016"
    tags = sorted(p.name for p in ckpt_dir.glob("step_*"))
    assert tags == [f"step_{s:08d}" for s in (4, 8, 12, 16)]  # step 8 written again, complete this time
    assert all(why_incomplete(ckpt_dir / tag) is None for tag in tags)

    # bit rot in rank 1's optimizer shard of step 16: sizes and marker intact, so only reading it back tells
    finished = [json.loads((tmp_path / f"rank_{rank}.json").read_text()) for rank in (0, 1)]
    shard = ckpt_dir / "step_00000016" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    rot_a_tensor(shard)
    assert why_incomplete(ckpt_dir / "step_00000016") is None
    again = torchrun("ckpt_fault_worker.py", tmp_path, "resume")
    rot = f"names step_00000016, which cannot be loaded: {shard.name} is damaged: its record "
    assert rot in again.stdout and f"{ckpt_dir / 'step_00000012'}, the newest complete one" in again.stdout
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank_{rank}.json").read_text())
        assert result["drawn"] == [13, 14, 15, 16]
        assert result["weights"] == finished[rank]["weights"]  # steps 13 to 16 again, exactly as the first time
