"""Recipe: tiny MAE (tests/launching.py `pretrain_recipe`), 60 steps, through ./launch.sh as one process (launch.sh
becomes the rank) and as 2 gloo ranks under torchrun. Ctrl-C as a terminal sends it, SIGINT to the launch's whole
process group (docs/processes.md): the first stops every rank after the step under way with a checkpoint of it, exit
code 130, and the relaunch trains on to the same losses as an uninterrupted run; a second one stops the run at once
without saving. Either way one line says so, no traceback, nothing of the run is left, and `latest` names a complete
checkpoint."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from core.launch.ckpt_files import checkpoint_files, choose_resume, read_latest, why_damaged
from tests.launching import (
    MARKER,
    REPO,
    launch,
    launch_env,
    losses,
    marked_processes,
    pretrain_recipe,
    wait_gone,
    write_recipe,
)

pytestmark = [pytest.mark.dist, pytest.mark.faults]

STEPS = 60
SECTIONS = {
    "schedule": {"steps": STEPS, "warmup_steps": 2},
    "logging": {"every_steps": 1, "image_every_steps": 0},
}
RANKS = pytest.mark.parametrize("nproc", [1, 2], ids=["one_process", "torchrun_2_ranks"])
RECEIVED = "Ctrl-C received; stopping after the current step with a checkpoint"
SECOND = "[mimpipe] stopped by a second Ctrl-C, at once and without saving"


def _start(recipe: Path, log: Path, marker: str, nproc: int) -> subprocess.Popen:
    """./launch.sh in a session of its own, as a terminal's foreground job (its pid is the process group's id), every
    process of the run carrying `marker`."""
    with open(log, "w") as out:
        return subprocess.Popen(
            [str(REPO / "launch.sh"), str(recipe)], cwd=REPO, env=launch_env(nproc, {MARKER: marker}), stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def _wait_for(proc: subprocess.Popen, log: Path, done, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"run ended early ({proc.returncode}):\n{log.read_text()[-4000:]}"
        if done():
            return
        time.sleep(0.02)
    pytest.fail(f"no {what} within {timeout} s:\n{log.read_text()[-4000:]}")


def _training(run_dir: Path) -> bool:
    """Step 3 is in metrics.jsonl."""
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return any(json.loads(line)["step"] >= 3 for line in lines if line.endswith("}"))


def _interrupt(proc: subprocess.Popen, marker: str) -> set[int]:
    """Ctrl-C: SIGINT to the launch's process group. Returns the processes of the run just before."""
    running = marked_processes(marker)
    os.killpg(proc.pid, signal.SIGINT)
    return running


def _assert_nothing_left(running: set[int], marker: str, nproc: int, output: str) -> None:
    # launch.sh (torchrun's agent, or the one rank), the ranks, their fork servers, resource trackers and data workers
    assert len(running) >= (1 if nproc > 1 else 0) + 4 * nproc, running
    assert wait_gone(running, seconds=20) == set(), output[-2000:]
    assert marked_processes(marker) == set()


QUIET = ("Traceback", "KeyboardInterrupt", "torch/distributed/elastic", "[mimpipe] torchrun:", "[mimpipe] error")
"""Not in the output of a Ctrl-C: no traceback, no warning of torchrun's agent, no failure line."""


def _assert_no_traceback(output: str) -> None:
    for word in QUIET:
        assert word not in output, output[-4000:]


def _assert_resumable(run_dir: Path) -> str:
    """`latest` names a complete checkpoint whose files read back whole, the one a relaunch takes; returns its tag."""
    ckpt_dir = run_dir / "checkpoints"
    latest = read_latest(ckpt_dir)
    assert latest is not None
    assert why_damaged(ckpt_dir / latest, checkpoint_files(ckpt_dir / latest)) is None
    assert choose_resume(ckpt_dir) == (latest, None)
    return latest


@RANKS
def test_ctrl_c_saves_the_step_and_the_relaunch_trains_on_as_if_uninterrupted(shards, tmp_path, nproc):
    """Ctrl-C at step 3 or soon after: every rank stops after the same step N, checkpoint N, exit code 130 and one
    line naming both; launching the same command again resumes at N and gives the losses of an uninterrupted run."""
    uninterrupted = tmp_path / "uninterrupted"
    recipe = write_recipe(tmp_path / "uninterrupted.yaml", pretrain_recipe(shards, uninterrupted, **SECTIONS))
    proc = launch(recipe, nproc=nproc)
    assert proc.returncode == 0, proc.stdout[-4000:]

    run_dir, log, marker = tmp_path / "run", tmp_path / "run.log", f"{tmp_path.name}-{time.monotonic_ns()}"
    recipe = write_recipe(tmp_path / "tiny_mae.yaml", pretrain_recipe(shards, run_dir, **SECTIONS))
    start = _start(recipe, log, marker, nproc)
    try:
        _wait_for(start, log, lambda: _training(run_dir), "step 3")
        running = _interrupt(start, marker)
        sent = time.monotonic()
        code = start.wait(timeout=120)
        seconds = time.monotonic() - sent
        output = log.read_text()
        print(f"Ctrl-C at {nproc} process(es) -> exit {code} after {seconds:.1f} s")
        assert code == 130, output[-4000:]
        stopped = re.findall(
            rf"^\[mimpipe\] stopped by Ctrl-C after step (\d+) of {STEPS} with checkpoint (\S+); launch the same "
            r"command again to resume from it \(exit code 130\)$",
            output,
            flags=re.MULTILINE,
        )
        assert len(stopped) == 1, output[-4000:]
        step, checkpoint = int(stopped[0][0]), Path(stopped[0][1])
        assert 3 <= step < STEPS and checkpoint == run_dir / "checkpoints" / f"step_{step:08d}"
        assert _assert_resumable(run_dir) == checkpoint.name
        for rank in range(nproc):
            assert json.loads((checkpoint / f"rank_{rank:05d}.json").read_text())["train"]["step"] == step
        assert max(losses(run_dir)) == step  # the step it stopped after is logged too, none after it
        # After the first line about it, only the step under way and the one line of the stop.
        after = output[output.index(RECEIVED) :].splitlines()[1:]
        assert all(line.startswith("step ") for line in after[:-1]) and after[-1].startswith("[mimpipe] stopped"), after
        assert output.count(RECEIVED) == 1  # one line per node (its local rank 0)
        _assert_no_traceback(output)
        _assert_nothing_left(running, marker, nproc, output)
    finally:
        for pid in marked_processes(marker):
            os.kill(pid, signal.SIGKILL)

    proc = launch(recipe, nproc=nproc)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert f"resumed from {checkpoint} at step {step}" in proc.stdout
    assert losses(run_dir) == losses(uninterrupted)  # every step once, bit for bit


@RANKS
def test_a_second_ctrl_c_stops_at_once_without_saving(shards, tmp_path, nproc):
    """Ctrl-C, then Ctrl-C again as soon as the run said it stops after this step (the second lands in the step or
    the save): every process ends within seconds, one line, exit code 130, no traceback; `latest` names a complete
    checkpoint (step 2's, or the stop's if its save got that far)."""
    run_dir, log, marker = tmp_path / "run", tmp_path / "run.log", f"{tmp_path.name}-{time.monotonic_ns()}"
    sections = {**SECTIONS, "checkpoint": {"every_steps": 2}}
    recipe = write_recipe(tmp_path / "tiny_mae.yaml", pretrain_recipe(shards, run_dir, **sections))
    start = _start(recipe, log, marker, nproc)
    try:
        _wait_for(start, log, lambda: _training(run_dir), "step 3")
        running = _interrupt(start, marker)
        _wait_for(start, log, lambda: RECEIVED in log.read_text(), "Ctrl-C line", timeout=60)
        os.killpg(start.pid, signal.SIGINT)
        sent = time.monotonic()
        code = start.wait(timeout=60)
        seconds = time.monotonic() - sent
        output = log.read_text()
        print(f"second Ctrl-C at {nproc} process(es) -> exit {code} after {seconds:.1f} s")
        assert code == 130, output[-4000:]
        assert seconds < 10, output[-4000:]
        assert output.count(SECOND) == 1, output[-4000:]
        _assert_no_traceback(output)
        _assert_nothing_left(running, marker, nproc, output)
        assert _assert_resumable(run_dir) >= "step_00000002"
    finally:
        for pid in marked_processes(marker):
            os.kill(pid, signal.SIGKILL)
