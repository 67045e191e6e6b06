"""Recipe: tiny MAE (tests/launching.py `pretrain_recipe`) through ./launch.sh with 2 gloo processes, seen by
`mimpipe status` (core/entry/status.py) as a separate process: the session's finished run (tests/dist/conftest.py
`zero2_run`, copied), and a 400-step run while it trains, then after SIGTERM stopped it. The status reads only: the
run_dir is the same, file for file, before and after."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.engine.checkpoint import resumable_tag
from core.entry.status import read_status
from tests.launching import REPO, launch_env, pretrain_recipe, read_metrics, write_recipe

pytestmark = pytest.mark.dist


def status(run_dir: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    """`mimpipe status RUN_DIR ARGS` as a process (the console script's module), with its wall time."""
    start = time.monotonic()
    cmd = [sys.executable, "-m", "core.entry.cli", "status", str(run_dir), *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    return proc, time.monotonic() - start


def snapshot(run_dir: Path) -> dict[str, tuple[int, str]]:
    """Every file of the run with its mtime and content hash."""
    return {
        str(path.relative_to(run_dir)): (path.stat().st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest())
        for path in sorted(run_dir.rglob("*"))
        if path.is_file()
    }


def harmonic_mean(rates: list[float]) -> float:
    return len(rates) / sum(1 / r for r in rates)


def test_a_finished_run(zero2_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(zero2_run[0], run_dir)
    before = snapshot(run_dir)
    proc, seconds = status(run_dir, "--json")
    print(f"mimpipe status --json: {seconds:.2f} s")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)

    metrics = read_metrics(run_dir)
    rates = [m["perf/images_per_sec"] for m in metrics if "perf/images_per_sec" in m][-5:]
    assert (got["stage"], got["objective"], got["step"], got["total_steps"]) == ("pretrain", "mae", 6, 6)
    assert got["lease"] == {"state": "none", "alive": False}  # given back when the run ended
    assert got["images_per_sec"] == pytest.approx(harmonic_mean(rates)) and got["rate_windows"] == 5
    assert got["monitors"] == {"train/loss": {"value": metrics[-1]["train/loss"], "step": 6}}
    checkpoints = [(c["tag"], c["state"], c["bytes"]) for c in got["checkpoints"]]
    on_disk = [sum(f.stat().st_size for f in (run_dir / "checkpoints" / tag).iterdir()) for tag, _, _ in checkpoints]
    assert checkpoints == [("step_00000003", "complete", on_disk[0]), ("step_00000006", "complete", on_disk[1])]
    assert got["checkpoint_bytes"] == sum(f.stat().st_size for f in (run_dir / "checkpoints").rglob("*") if f.is_file())
    assert got["latest"] == "step_00000006"
    assert got["resume"] == {"tag": "step_00000006", "step": 6, "note": None, "verified": False}
    assert got["finished"] == {"step": 6, "tag": "step_00000006", "relaunch_does_nothing": True}
    manifest = json.loads((run_dir / "export" / "mimpipe.json").read_text())
    assert (got["export"]["step"], got["export"]["method"]) == (6, "mae")
    assert got["export"]["num_params"] == manifest["num_params"]

    proc, seconds = status(run_dir)  # the screen
    print(f"mimpipe status: {seconds:.2f} s\n{proc.stdout}")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"{run_dir}  pretrain, mae on vit tiny at 16 px, patch 4 (config.yaml)"
    assert lines[1:3] == ["  state       not running (no lease)", lines[2]] and lines[2].startswith(
        "  step        6 / 6 (100.0%)"
    )
    assert "  resume      step_00000006 (step 6): the one latest names, complete" in lines
    assert "  finished    at step 6 (step_00000006): relaunching with this schedule does nothing" in lines
    assert snapshot(run_dir) == before  # nothing written

    # `latest` torn and step 6 damaged (a flipped byte, same size): status names what the resume code would take
    (run_dir / "checkpoints" / "latest").write_text("step_0000")
    model = run_dir / "checkpoints" / "step_00000006" / "mp_rank_00_model_states.pt"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(data)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        expected = resumable_tag(run_dir / "checkpoints")
    assert read_status(run_dir)["resume"]["tag"] == "step_00000006"  # markers and sizes: it looks complete
    got = read_status(run_dir, verify=True)["resume"]  # in this process: torch is imported already
    assert got == {"tag": expected, "step": 3, "note": printed.getvalue().strip(), "verified": True}
    assert expected == "step_00000003" and "passed over damaged" in got["note"] and "step_00000006" in got["note"]


@pytest.mark.faults  # a run signalled on purpose: `make test-faults`
def test_a_running_run_then_stopped(shards, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    long = {"schedule": {"steps": 400, "warmup_steps": 2}, "logging": {"every_steps": 1, "image_every_steps": 0}}
    recipe = write_recipe(
        tmp_path / "tiny_mae_long.yaml",
        pretrain_recipe(shards, run_dir, **long, checkpoint={"every_steps": 4, "keep_last": 400}),
    )
    with open(log, "w") as out:  # launch.sh execs torchrun: the pid is torchrun's
        proc = subprocess.Popen(
            [str(REPO / "launch.sh"), str(recipe)],
            cwd=REPO,
            env=launch_env(nproc=2),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        got = _status_once_trained(proc, run_dir, log, step=6)
        assert got["alive"] and got["lease"]["state"] == "live" and got["lease"]["recipe"] == str(recipe.resolve())
        assert got["lease"]["pid"] in _children(proc.pid)  # rank 0 holds it
        assert 6 <= got["step"] < 400 and got["total_steps"] == 400 and got["rate_windows"] == 5
        assert got["images_per_sec"] > 0 and got["eta_s"] == pytest.approx(
            (400 - got["step"]) * 32 / got["images_per_sec"]
        )
        complete = [c["step"] for c in got["checkpoints"] if c["state"] == "complete"]
        assert complete and all(step % 4 == 0 for step in complete) and complete[-1] <= got["step"], got["checkpoints"]
        assert {c["state"] for c in got["checkpoints"]} <= {"complete", "being written"}, got["checkpoints"]
        assert got["latest"] == f"step_{complete[-1]:08d}" or got["latest"] == f"step_{got['step'] // 4 * 4:08d}"
        assert got["resume"]["tag"] == got["latest"] and got["finished"] is None and got["export"] is None
        screen, _ = status(run_dir)
        print(screen.stdout)
        assert screen.stdout.splitlines()[1].startswith("  state       running: host ")
        assert " eta " in screen.stdout and "/ 400 (" in screen.stdout
    finally:
        os.kill(proc.pid, signal.SIGTERM)  # what `scancel --signal=TERM` does to the job's torchrun
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise

    proc, _ = status(run_dir, "--json")
    got = json.loads(proc.stdout)
    last = read_metrics(run_dir)[-1]["step"]
    assert got["lease"]["state"] == "none" and not got["alive"], log.read_text()[-3000:]
    assert got["step"] == last and got["resume"] == {
        "tag": f"step_{last:08d}",
        "step": last,
        "note": None,
        "verified": False,
    }


def _status_once_trained(proc: subprocess.Popen, run_dir: Path, log: Path, step: int, timeout: float = 120) -> dict:
    """`mimpipe status --json` once the run has logged `step` and holds its lease."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"run ended early ({proc.returncode}):\n{log.read_text()[-4000:]}"
        if (run_dir / "lease.json").exists() and (run_dir / "metrics.jsonl").exists():
            out, seconds = status(run_dir, "--json")
            got = json.loads(out.stdout)
            if (got["step"] or 0) >= step:
                print(f"mimpipe status --json on the running run: {seconds:.2f} s")
                return got
        time.sleep(0.5)
    pytest.fail(f"no step {step} within {timeout} s:\n{log.read_text()[-4000:]}")


def _children(pid: int) -> set[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return set(map(int, found))
