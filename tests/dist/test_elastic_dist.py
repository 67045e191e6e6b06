"""Elastic resume (tests/dist/elastic_worker.py under torchrun): a ZeRO-2 checkpoint written by 2 processes is
resumed by 1 and back by 2, and model and optimizer state survive both changes exactly. On the way back rank 0's
conversion outlasts the collective timeout, and rank 1 waits for it."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from core.compat.deepspeed import universal_command
from tests.launching import torchrun

pytestmark = [pytest.mark.dist, pytest.mark.faults]  # a relaunch at other world sizes: `make test-faults`

COLLECTIVE_TIMEOUT_S = 15  # of the run whose rank 0 converts for longer (elastic_worker.py `slow=`)


def _universal(tag_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Per parameter name: fp32 weight, exp_avg, exp_avg_sq and step, as DeepSpeed's universal converter reads them
    out of the ZeRO partitions of `tag_dir` (converted here unless the resume already did)."""
    out = tag_dir / "universal"
    if not out.is_dir():
        env = {**os.environ, "DS_ACCELERATOR": "cpu"}
        subprocess.run(universal_command(tag_dir, out), check=True, capture_output=True, env=env)
    states = {}
    for param_dir in sorted(p for p in (out / "zero").iterdir() if p.is_dir()):
        files = {f.stem: torch.load(f, weights_only=False) for f in param_dir.glob("*.pt")}
        states[param_dir.name] = {k: v["param"] if isinstance(v, dict) else v for k, v in files.items()}
    return states


def test_zero2_checkpoint_moves_from_2_to_1_process_and_back(tmp_path):
    run_dir = tmp_path / "run"
    torchrun("elastic_worker.py", run_dir, "train", nproc=2)  # step 3, world size 2
    torchrun("elastic_worker.py", run_dir, "resave", nproc=1)  # resumes step 3 (universal checkpoint), saves 103
    # Resumes step 103 (world size 1), saves step 203; rank 0 converts for longer than a collective may wait.
    proc = torchrun("elastic_worker.py", run_dir, "resave", f"slow={COLLECTIVE_TIMEOUT_S}", nproc=2)
    waited = float(re.search(r"rank 1 waited ([\d.]+) s", proc.stdout).group(1))
    assert waited > COLLECTIVE_TIMEOUT_S, proc.stdout  # a barrier would have timed out
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "step_00000003" / "universal").is_dir() and (ckpt / "step_00000103" / "universal").is_dir()
    written_by_2, after_1, after_2 = (_universal(ckpt / f"step_{s:08d}") for s in (3, 103, 203))
    assert "encoder.blocks.0.attn.qkv.weight" in written_by_2
    assert set(written_by_2) == set(after_1) == set(after_2)
    for name, state in written_by_2.items():
        if name != "encoder.pos_embed":  # MAE's fixed sin-cos: no optimizer state
            assert {"fp32", "exp_avg", "exp_avg_sq"} <= set(state), name
            assert float(state["exp_avg_sq"].abs().sum()) > 0, name  # trained for 3 steps
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(after_1[name][key]), torch.as_tensor(value)), (name, key)
            assert torch.equal(torch.as_tensor(after_2[name][key]), torch.as_tensor(value)), (name, key)
