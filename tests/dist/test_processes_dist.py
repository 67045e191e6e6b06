"""Recipe: tiny MAE (tests/launching.py `pretrain_recipe`) with the kNN monitor, through ./launch.sh with 2 gloo
processes; and tests/dist/eval_stress_worker.py under torchrun. How a run's processes start and end (docs/processes.md):
nothing is left when the launcher is killed with SIGKILL, a SIGTERM during the kNN pass ends in a checkpoint of that
step, a hung evaluation loader stops the run with one line, and hundreds of evaluations at 2 ranks never hang.

Slow evaluation shards are `pipe:` shards whose command sleeps before it writes the tar: a reader that hangs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.launching import (
    MARKER,
    REPO,
    launch,
    launch_env,
    marked_processes,
    pretrain_recipe,
    read_metrics,
    torchrun,
    wait_gone,
    write_recipe,
)

pytestmark = [pytest.mark.dist, pytest.mark.faults]

LONG = {"schedule": {"steps": 400, "warmup_steps": 2}, "logging": {"every_steps": 1, "image_every_steps": 0}}


def _marker(tmp_path: Path) -> str:
    return f"{tmp_path.name}-{os.getpid()}-{time.monotonic_ns()}"


def _start(recipe: Path, log: Path, marker: str) -> subprocess.Popen:
    """./launch.sh in its own session, every process of the run carrying `marker`; launch.sh execs torchrun, so the
    pid is torchrun's agent."""
    with open(log, "w") as out:
        return subprocess.Popen(
            [str(REPO / "launch.sh"), str(recipe)], cwd=REPO, env=launch_env(2, {MARKER: marker}), stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def _wait_for_step(proc: subprocess.Popen, run_dir: Path, log: Path, step: int, timeout: float = 180) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"run ended early ({proc.returncode}):\n{log.read_text()[-4000:]}"
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        if any(json.loads(line)["step"] >= step for line in lines if line.endswith("}")):
            return
        time.sleep(0.2)
    pytest.fail(f"no step {step} within {timeout} s:\n{log.read_text()[-4000:]}")


def _kill_marked(marker: str) -> None:
    for pid in marked_processes(marker):
        os.kill(pid, signal.SIGKILL)


def _sleeping_shards(shards: dict[str, Path], seconds: int) -> list[str]:
    """The val shards as `pipe:` shards that write nothing for `seconds`."""
    return [f"pipe:sleep {seconds} && cat {tar}" for tar in sorted(shards["val"].glob("*.tar"))]


def test_kill9_of_the_launcher_leaves_no_process_of_the_run(shards, tmp_path):
    """SIGKILL to launch.sh (torchrun's agent: it cannot pass anything on) mid-run: the ranks get their parent-death
    signal, their data workers follow them, then the fork servers; within seconds nothing of the run is left."""
    run_dir, log, marker = tmp_path / "run", tmp_path / "run.log", _marker(tmp_path)
    recipe = write_recipe(tmp_path / "tiny_mae_long.yaml", pretrain_recipe(shards, run_dir, **LONG))
    proc = _start(recipe, log, marker)
    try:
        _wait_for_step(proc, run_dir, log, 3)
        running = marked_processes(marker)
        # torchrun, 2 ranks, and per rank its fork server, resource tracker and data worker
        assert len(running) >= 9, (running, log.read_text()[-2000:])
        proc.kill()
        proc.wait(timeout=10)
        killed = time.monotonic()
        assert wait_gone(running, seconds=20) == set(), log.read_text()[-2000:]
        assert marked_processes(marker) == set()
        print(f"kill -9 of the launcher: {len(running)} processes gone after {time.monotonic() - killed:.1f} s")
    finally:
        _kill_marked(marker)


def test_sigterm_during_the_knn_pass_checkpoints_that_step(shards, tmp_path):
    """The kNN pass of step 2 waits on query shards that write nothing for 300 s when torchrun gets SIGTERM: the
    ranks stop the pass, save step 2 and exit with code 4 within seconds; no kNN figure is logged for it."""
    run_dir, log, marker = tmp_path / "run", tmp_path / "run.log", _marker(tmp_path)
    knn = {"enabled": True, "every_steps": 2, "bank": {"max_samples": 64}, "query": {"shards": []}}
    knn["query"]["shards"] = _sleeping_shards(shards, 300)
    recipe = pretrain_recipe(shards, run_dir, **LONG, checkpoint={"every_steps": 1000}, eval={"knn": knn})
    proc = _start(write_recipe(tmp_path / "tiny_mae_knn.yaml", recipe), log, marker)
    try:
        _wait_for_step(proc, run_dir, log, 2)  # step 2 is logged before its kNN pass starts
        time.sleep(2)
        os.kill(proc.pid, signal.SIGTERM)
        sent = time.monotonic()
        code = proc.wait(timeout=240)
        seconds = time.monotonic() - sent
        output = log.read_text()
        print(f"SIGTERM during the kNN pass -> exit {code} after {seconds:.1f} s")
        assert code == 1, output[-4000:]  # torchrun's own code; its ranks' is 4
        assert re.search(r"preempted: SIGTERM received, stopped after step 2 of 400 .*\(exit code 4\)", output), output
        assert "rank 0: SIGTERM received" in output and "rank 1: SIGTERM received" in output
        assert seconds < 240  # the pass was cut short: the query shards write nothing for 300 s
        assert (run_dir / "checkpoints" / "latest").read_text() == "step_00000002"
        for rank in (0, 1):
            saved = json.loads((run_dir / "checkpoints" / "step_00000002" / f"rank_{rank:05d}.json").read_text())
            assert saved["train"]["step"] == 2
        assert not any("knn/top1" in m for m in read_metrics(run_dir))
    finally:
        _kill_marked(marker)  # the sleeping shard commands outlive the workers that started them


def test_a_hung_evaluation_loader_stops_the_run_with_one_line(shards, tmp_path):
    """Query shards that never come, `data.loader_timeout_s` 10 s: each rank stops with the one-line error naming
    its data worker, instead of waiting forever."""
    run_dir, marker = tmp_path / "run", _marker(tmp_path)
    knn = {"enabled": True, "every_steps": 2, "bank": {"max_samples": 64}, "query": {"shards": []}}
    knn["query"]["shards"] = _sleeping_shards(shards, 3600)
    recipe = pretrain_recipe(shards, run_dir, eval={"knn": knn}, data={"loader_timeout_s": 10})
    try:
        proc = launch(write_recipe(tmp_path / "tiny_mae_hung.yaml", recipe), extra_env={MARKER: marker})
        assert proc.returncode == 1, proc.stdout[-4000:]
        error = r"\[mimpipe\] error: data worker 0 of rank (\d) gave no batch for 10 s \(pid \d+"
        assert re.search(error, proc.stdout), proc.stdout[-4000:]
        assert "data.loader_timeout_s=10" in proc.stdout
    finally:
        _kill_marked(marker)


def test_hundreds_of_evaluations_at_two_ranks_never_hang(shards):
    """50 rounds of a kNN pass and a fine-tuning evaluation (100 evaluations, 300 loaders of 2 workers each)
    in ranks that run threads; every round gives the same figures. (100 rounds took 262 s of CI's test-faults.)"""
    proc = torchrun("eval_stress_worker.py", shards["train"], shards["val"], 50, timeout=900)
    assert "rounds 50" in proc.stdout, proc.stdout[-2000:]
