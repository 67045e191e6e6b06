"""Recipe: the session's finished tiny MAE run (tests/dist/conftest.py `zero2_run`: 6 steps, checkpoints at 3 and 6,
2 gloo processes), copied and relaunched through ./launch.sh or a plain torchrun. A run_dir is one run: another
config is refused before any process starts; the finished run relaunched does nothing; a longer schedule continues
it, and its metrics hold each step once."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.launching import REPO, free_port, launch, launch_env, read_metrics

pytestmark = [pytest.mark.dist, pytest.mark.faults]  # relaunches into a used run_dir: `make test-faults`


def copy_run(zero2_run, dst: Path) -> tuple[Path, Path]:
    """A copy of the finished run at `dst` and its recipe (the run's config.yaml, run_dir pointed at the copy)."""
    shutil.copytree(zero2_run[0], dst)
    recipe = dst.with_suffix(".yaml")
    recipe.write_text((dst / "config.yaml").read_text().replace(str(zero2_run[0]), str(dst)))
    return dst, recipe


def snapshot(run_dir: Path) -> dict[str, tuple[int, str]]:
    """Every file of the run with its mtime and content hash."""
    return {
        str(path.relative_to(run_dir)): (path.stat().st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest())
        for path in sorted(run_dir.rglob("*"))
        if path.is_file()
    }


def test_changed_config_is_refused_and_finished_run_does_nothing(zero2_run, tmp_path):
    run_dir, recipe = copy_run(zero2_run, tmp_path / "run")
    before = snapshot(run_dir)

    proc = launch(recipe, "optim.base_lr=3e-3", "objective.mask_ratio=0.5", timeout=120)
    assert proc.returncode == 2, proc.stdout[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("launch.sh:")]
    assert lines == [
        f"launch.sh: run_dir: {run_dir} holds a run of another config (checkpoints/step_00000006; "
        "objective.mask_ratio: 0.75 -> 0.5, optim.base_lr: 0.001 -> 0.003); pass run_dir=NEW_DIR to start a new run, "
        "or --allow-config-change to continue this one with the new config"
    ], proc.stdout
    assert "[mimpipe] stage" not in proc.stdout and "Traceback" not in proc.stdout  # no process started

    proc = launch(recipe, "logging.every_steps=2", timeout=120)  # same schedule; a cadence may change
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert f"[mimpipe] {run_dir} holds a finished run (step 6, checkpoints/step_00000006, exported)" in proc.stdout
    assert "[mimpipe] stage" not in proc.stdout and "step 1/" not in proc.stdout
    assert snapshot(run_dir) == before  # no training, no export, no config, no log line

    # The recipe leaves engine.precision at auto; the run's config holds what it resolved to on this machine, and the
    # recipe relaunched resolves it the same way: the same run, not another config.
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["engine"]["precision"] in ("bf16", "fp32")
    original = zero2_run[0].parent / "tiny_mae.yaml"
    assert yaml.safe_load(original.read_text()).get("engine", {}).get("precision", "auto") == "auto"
    proc = launch(original, f"run_dir={run_dir}", timeout=120)
    assert proc.returncode == 0 and "holds a finished run (step 6" in proc.stdout, proc.stdout[-3000:]
    assert snapshot(run_dir) == before


def test_a_finished_run_whose_latest_was_truncated_still_does_nothing(zero2_run, tmp_path):
    """`checkpoints/latest` cut short to `step_000` (not step 0: core/launch/ckpt_files.py `read_latest`): the relaunch
    is judged by the checkpoint its resume would load, step 6, so the finished run does nothing and no process starts
    (before: the pre-flight read step 0, the ranks started, resumed at step 6 with a warning and exported again)."""
    run_dir, recipe = copy_run(zero2_run, tmp_path / "run")
    (run_dir / "checkpoints" / "latest").write_text("step_000")
    before = snapshot(run_dir)

    proc = launch(recipe, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert [line for line in proc.stdout.splitlines() if "[mimpipe]" in line or "launch.sh" in line] == [
        f"[mimpipe] {run_dir} holds a finished run (step 6, checkpoints/step_00000006, exported): nothing to do; "
        "lengthen the schedule (schedule.steps / schedule.epochs) to continue it, or pass run_dir=NEW_DIR to start a "
        "new run"
    ], proc.stdout[-3000:]
    assert snapshot(run_dir) == before  # no training, no export, no config, no log line; `latest` left as it was


def test_plain_torchrun_entry_point_decides_the_same(zero2_run, tmp_path):
    """Without launch.sh's pre-flight the stage refuses (rank 0 decides, every rank exits 2) and finds the run
    finished (every rank exits 0) itself."""
    run_dir, recipe = copy_run(zero2_run, tmp_path / "run")
    before = snapshot(run_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    env = launch_env(nproc=2)

    refused = subprocess.run(
        [*cmd, "-m", "pretrain", str(recipe), "optim.base_lr=3e-3"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert refused.returncode != 0
    lines = [line for line in refused.stderr.splitlines() if line.startswith("[mimpipe] refused:")]
    assert lines == [
        f"[mimpipe] refused: run_dir: {run_dir} holds a run of another config (checkpoints/step_00000006; "
        "optim.base_lr: 0.001 -> 0.003); pass run_dir=NEW_DIR to start a new run, or --allow-config-change to "
        "continue this one with the new config"
    ], refused.stderr[-3000:]
    assert re.search(r"exitcode\s*:\s*2\b", refused.stderr), refused.stderr[-3000:]  # torchrun's report of the ranks

    finished = subprocess.run([*cmd, "-m", "pretrain", str(recipe)], cwd=REPO, env=env, capture_output=True, text=True)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert f"[mimpipe] {run_dir} holds a finished run (step 6" in finished.stdout
    assert snapshot(run_dir) == before


def test_longer_schedule_continues_and_each_step_is_logged_once(zero2_run, tmp_path):
    run_dir, recipe = copy_run(zero2_run, tmp_path / "run")
    first_config = (run_dir / "config.yaml").read_text()
    with (run_dir / "metrics.jsonl").open("a") as f:  # as if the run had logged steps 7-8 after its last checkpoint
        f.writelines(json.dumps({"step": step, "train/loss": -1.0}) + "\n" for step in (7, 8))

    proc = launch(recipe, "schedule.steps=8")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert f"[mimpipe] resuming {run_dir} with changed settings: schedule.steps: 6 -> 8" in proc.stdout
    assert "resumed from" in proc.stdout and "at step 6" in proc.stdout
    metrics = [m for m in read_metrics(run_dir) if "train/loss" in m]
    assert [m["step"] for m in metrics] == list(range(1, 9)) and all(m["train/loss"] > 0 for m in metrics)
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    assert [event.step for event in events.Scalars("train/loss")] == list(range(1, 9))

    assert (run_dir / "config.yaml").read_text() == first_config  # the first launch's, kept
    assert "steps: 8" in (run_dir / "configs" / "launch_0002.yaml").read_text()
    assert json.loads((run_dir / "finished.json").read_text()) == {"step": 8, "tag": "step_00000008"}
    assert json.loads((run_dir / "export" / "mimpipe.json").read_text())["step"] == 8
