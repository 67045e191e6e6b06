"""Recipe: tiny MAE (tests/launching.py `pretrain_recipe`), 400 steps, through ./launch.sh with 2 gloo processes,
interrupted for real: SIGTERM to torchrun (preemption), or SIGKILL to one rank (a crash)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launching import REPO, launch, launch_env, losses, pretrain_recipe, write_recipe

pytestmark = [pytest.mark.dist, pytest.mark.faults]  # killed and signalled runs: `make test-faults`

LONG = {"schedule": {"steps": 400, "warmup_steps": 2}, "logging": {"every_steps": 1, "image_every_steps": 0}}


def _start(recipe: Path, log: Path) -> subprocess.Popen:
    """./launch.sh in its own session (as a batch system would start it); output to `log`. launch.sh execs
    torchrun, so the returned pid is torchrun's."""
    with open(log, "w") as out:
        return subprocess.Popen(
            [str(REPO / "launch.sh"), str(recipe)],
            cwd=REPO,
            env=launch_env(nproc=2),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _wait_for_step(proc: subprocess.Popen, run_dir: Path, log: Path, step: int, timeout: float = 120) -> int:
    """Block until metrics.jsonl has logged `step` (or later); returns the last logged step."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"run ended early ({proc.returncode}):\n{log.read_text()[-4000:]}"
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        logged = [json.loads(line)["step"] for line in lines if line.endswith("}")]  # skip a half-written line
        if logged and max(logged) >= step:
            return max(logged)
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"no step {step} within {timeout} s:\n{log.read_text()[-4000:]}")


def _rank_pids(torchrun_pid: int) -> dict[int, int]:
    """{rank: pid} of torchrun's children, read from their environment."""
    children = subprocess.run(["pgrep", "-P", str(torchrun_pid)], capture_output=True, text=True).stdout.split()
    ranks = {}
    for pid in map(int, children):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        rank = next(v for v in environ if v.startswith(b"RANK=")).removeprefix(b"RANK=")
        ranks[int(rank)] = pid
    return ranks


def test_sigterm_checkpoints_the_step_reached_and_relaunch_resumes(shards, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "first.log"
    recipe = write_recipe(
        tmp_path / "tiny_mae_long.yaml", pretrain_recipe(shards, run_dir, **LONG, checkpoint={"every_steps": 1000})
    )
    proc = _start(recipe, log)
    _wait_for_step(proc, run_dir, log, 3)
    os.kill(proc.pid, signal.SIGTERM)  # what `scancel --signal=TERM` does to the job's torchrun
    sent = time.monotonic()
    code = proc.wait(timeout=60)
    output = log.read_text()
    print(f"SIGTERM -> torchrun exit {code} after {time.monotonic() - sent:.1f} s")

    # torchrun re-raises the SignalException it received (exit 1); the ranks exit with EXIT_PREEMPTED and say so.
    assert code == 1, output[-4000:]
    assert "rank 0: SIGTERM received" in output and "rank 1: SIGTERM received" in output
    stopped = re.search(r"preempted: SIGTERM received, stopped after step (\d+) of 400 .*\(exit code 4\)", output)
    assert stopped, output[-4000:]
    step = int(stopped.group(1))
    assert step >= 3 and max(losses(run_dir)) == step  # the last step is logged too
    tag = f"step_{step:08d}"
    assert (run_dir / "checkpoints" / "latest").read_text() == tag
    for rank in (0, 1):
        saved = json.loads((run_dir / "checkpoints" / tag / f"rank_{rank:05d}.json").read_text())
        assert saved["train"]["step"] == step

    proc = launch(recipe, f"schedule.steps={step + 2}")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "resumed from" in proc.stdout and f"at step {step}" in proc.stdout
    assert {step + 1, step + 2} <= set(losses(run_dir))
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step_{step + 2:08d}"


def test_killed_rank_stops_the_run_and_the_latest_checkpoint_loads(shards, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    recipe = pretrain_recipe(shards, run_dir, **LONG, checkpoint={"every_steps": 2, "keep_last": 2})
    proc = _start(write_recipe(tmp_path / "tiny_mae_long.yaml", recipe), log)
    _wait_for_step(proc, run_dir, log, 3)
    os.kill(_rank_pids(proc.pid)[1], signal.SIGKILL)
    killed = time.monotonic()
    try:
        code = proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the run did not stop within 90 s of a rank's death:\n{log.read_text()[-4000:]}")
    print(f"SIGKILL rank 1 -> torchrun exit {code} after {time.monotonic() - killed:.1f} s")
    output = log.read_text()
    assert code != 0 and "SIGKILL" in output, output[-4000:]

    tag = (run_dir / "checkpoints" / "latest").read_text()
    out = tmp_path / "export"
    cmd = [sys.executable, "-m", "pretrain", "export", str(run_dir), "--out", str(out)]
    export = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert export.returncode == 0, export.stderr[-3000:]
    assert json.loads((out / "mimpipe.json").read_text())["step"] == int(tag.removeprefix("step_")) >= 2
