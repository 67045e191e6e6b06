"""Recipe: the tiny MAE of tests/launching.py `pretrain_recipe` through ./launch.sh: the session's `zero2_run` recipe
(2 gloo processes, 6 steps) launched twice at once into one run_dir, and launched once into a run_dir whose lease this
test takes right after launch.sh's pre-flight; and a 30-step run of one process killed with kill -9 and relaunched,
from its own host and, as a SLURM requeue on another node, from another "host" (`MIMPIPE_LEASE_HOST`). A run_dir has
one owner (core/launch/lease.py, docs/run_dir.md): the second launch stops before it trains, with one line and exit
code 2; a killed owner is taken over at once where its process is seen gone, after its lease timeout elsewhere; a
finished run leaves no lease and relaunches as before."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from core.launch.lease import LEASE_FILE, here, new_lease
from tests.launching import REPO, launch, launch_env, losses, pretrain_recipe, read_metrics, write_recipe

pytestmark = [pytest.mark.dist, pytest.mark.faults]  # launches into a used run_dir, owners killed: `make test-faults`

IN_USE = r"run_dir: {run_dir} is in use by host {host} pid \d+{job} since [\d-]+ [\d:]+, last heartbeat \d+ s ago; "
LONG = {"schedule": {"steps": 30, "warmup_steps": 2}, "logging": {"every_steps": 1, "image_every_steps": 0}}


def _start(recipe: Path, log: Path, extra_env: dict) -> subprocess.Popen:
    """./launch.sh with one process, in its own session: launch.sh execs the stage, so the pid is rank 0's."""
    with open(log, "w") as out:
        return subprocess.Popen(
            [str(REPO / "launch.sh"), str(recipe)], cwd=REPO, env=launch_env(1, extra_env), stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def _kill_owner_after_a_checkpoint(proc: subprocess.Popen, run_dir: Path, log: Path) -> dict:
    """Waits for the run's first checkpoint, kill -9s the process its lease names (launch.sh's own, one process) and
    returns the lease it left."""
    deadline = time.monotonic() + 180
    while not (run_dir / "checkpoints" / "latest").exists():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.1)
    lease = json.loads((run_dir / "lease.json").read_text())
    assert lease["pid"] == proc.pid and lease["stale_after_s"] == 10.0
    os.kill(lease["pid"], signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    return json.loads((run_dir / "lease.json").read_text())  # kill -9 leaves it, with its last heartbeat


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_of_two_launches_at_once_one_trains_as_a_lone_run_and_the_other_stops_with_one_line(
    zero2_run, shards, tmp_path
):
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "tiny_mae.yaml", pretrain_recipe(shards, run_dir))  # zero2_run's, without W&B
    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(lambda _: launch(recipe), range(2)))
    codes = sorted(proc.returncode for proc in procs)
    assert codes == [0, 2], [proc.stdout[-3000:] for proc in procs]  # refused: torchrun's agent exits as its ranks
    winner, loser = sorted(procs, key=lambda proc: proc.returncode)

    # Both passed the pre-flight; rank 0 of the loser found the winner's lease at its stage's start and told its ranks.
    lines = [line for line in loser.stdout.splitlines() if "run_dir:" in line]
    assert len(lines) == 1, loser.stdout[-3000:]
    pattern = re.escape("[mimpipe] refused: ") + IN_USE.format(run_dir=re.escape(str(run_dir)), host=r"\S+", job="")
    assert re.match(pattern, lines[0]) and "--take-over-run-dir" in lines[0], lines[0]
    # Every rank exits 2 (torchrun SIGTERMs the other once one has, which may kill it as it ends: a fresh clone's CI
    # saw rank 1 first, then rank 0 killed by SIGTERM after it had printed its line); no failure report
    assert "[mimpipe] torchrun:" not in loser.stdout
    assert "[mimpipe] stage" not in loser.stdout and "Traceback" not in loser.stdout

    # The winner trained as a lone run does, bit for bit, each step logged once, and left no lease.
    assert losses(run_dir) == losses(zero2_run[0]) and len(losses(run_dir)) == 6
    assert [m["step"] for m in read_metrics(run_dir) if "train/loss" in m] == list(range(1, 7))
    assert not (run_dir / "configs").exists()  # one launch kept its config: the loser wrote nothing
    assert not (run_dir / "lease.json").exists()
    assert "taking over" not in winner.stdout


def test_a_launch_its_ranks_refuse_exits_2_through_launch_sh_with_the_refusal_once(shards, tmp_path):
    """2 ranks through ./launch.sh; this test's process takes run_dir's lease as a live launch would, right after
    launch.sh's pre-flight passed (so the ranks, not the pre-flight, find it): rank 0 refuses at its stage's start and
    tells rank 1, both exit 2, and torchrun's agent exits 2 too (core/launch/torchrun.py `exit_code`), with the
    refusal's one line and no failure report. The run_dir is left as it was: the holder's lease, nothing written."""
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "tiny_mae.yaml", pretrain_recipe(shards, run_dir))
    run_dir.mkdir()
    holder = new_lease("pretrain", "/elsewhere/tiny_mae.yaml", 300.0, time.time(), here())  # this process: live
    proc = subprocess.Popen(
        [str(REPO / "launch.sh"), str(recipe)], cwd=REPO, env=launch_env(2), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    watchdog = threading.Timer(300, _stop, (proc,))  # a hung launch ends the read below
    watchdog.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("[mimpipe] pre-flight:"):  # the ranks start now, and take seconds to import torch
                (run_dir / LEASE_FILE).write_bytes(holder.encode())
        code = proc.wait()
    finally:
        watchdog.cancel()
        _stop(proc)
    output = "\n".join(lines)
    assert code == 2, output[-4000:]
    refused = [line for line in lines if "run_dir:" in line]
    in_use = IN_USE.format(run_dir=re.escape(str(run_dir)), host=re.escape(here().host), job="")
    pattern = re.escape("[mimpipe] refused: ") + in_use
    assert len(refused) == 1 and re.match(pattern, refused[0]), output[-4000:]
    assert f"pid {os.getpid()} " in refused[0] and refused[0].endswith("--take-over-run-dir if you know it is gone")
    assert "[mimpipe] torchrun:" not in output and "Traceback" not in output and "[mimpipe] stage" not in output
    assert (run_dir / LEASE_FILE).read_bytes() == holder.encode()
    assert sorted(p.name for p in run_dir.iterdir()) == [LEASE_FILE]


def test_a_killed_owner_is_taken_over_at_once_on_its_host_and_a_finished_run_leaves_no_lease(shards, tmp_path):
    run_dir = tmp_path / "run"
    recipe = write_recipe(
        tmp_path / "long.yaml", pretrain_recipe(shards, run_dir, checkpoint={"lease_timeout_s": 10.0}, **LONG)
    )
    log = tmp_path / "first.log"
    first = _start(recipe, log, {})
    try:
        old = _kill_owner_after_a_checkpoint(first, run_dir, log)
    finally:
        _stop(first)

    proc = launch(recipe, nproc=1)  # this host sees that process gone: no wait for its timeout
    assert proc.returncode == 0, proc.stdout[-4000:]
    warnings = [line for line in proc.stdout.splitlines() if "taking over" in line]
    assert warnings == [
        f"[mimpipe] warning: run_dir: taking over {run_dir} from host {old['host']} pid {old['pid']}, started "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(old['started']))}: that process is gone"
    ], proc.stdout[-4000:]
    assert "resumed from" in proc.stdout
    assert [m["step"] for m in read_metrics(run_dir) if "train/loss" in m] == list(range(1, 31))
    assert not (run_dir / "lease.json").exists()

    proc = launch(recipe, nproc=1, timeout=120)  # finished: as before, nothing to do
    assert proc.returncode == 0 and "holds a finished run (step 30" in proc.stdout, proc.stdout[-3000:]
    assert not (run_dir / "lease.json").exists()


def test_a_slurm_requeue_on_another_host_waits_until_the_old_heartbeat_is_stale(shards, tmp_path):
    run_dir = tmp_path / "run"
    recipe = write_recipe(
        tmp_path / "long.yaml", pretrain_recipe(shards, run_dir, checkpoint={"lease_timeout_s": 10.0}, **LONG)
    )
    job = {"SLURM_JOB_ID": "4242", "NNODES": "1"}  # NNODES: launch.sh reads no SLURM node list
    log = tmp_path / "first.log"
    first = _start(recipe, log, {**job, "MIMPIPE_LEASE_HOST": "node-a"})
    try:
        old = _kill_owner_after_a_checkpoint(first, run_dir, log)
    finally:
        _stop(first)

    # node-b cannot see node-a's processes: its pid being gone here says nothing. Refused while the heartbeat is recent.
    requeued = {**job, "MIMPIPE_LEASE_HOST": "node-b"}
    proc = launch(recipe, nproc=1, timeout=120, extra_env=requeued)
    assert proc.returncode == 2, proc.stdout[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("launch.sh:")]
    pattern = "launch.sh: " + IN_USE.format(run_dir=re.escape(str(run_dir)), host="node-a", job=r" \(SLURM job 4242\)")
    assert len(lines) == 1 and re.match(pattern, lines[0]), proc.stdout[-3000:]
    assert f"pid {old['pid']} " in lines[0] and "[mimpipe] stage" not in proc.stdout

    time.sleep(max(0.0, old["heartbeat"] + old["stale_after_s"] + 0.5 - time.time()))
    proc = launch(recipe, nproc=1, extra_env=requeued)  # the old heartbeat has stopped for its timeout
    assert proc.returncode == 0, proc.stdout[-4000:]
    warnings = [line for line in proc.stdout.splitlines() if "taking over" in line]
    assert len(warnings) == 1, proc.stdout[-4000:]
    old_owner = f"host node-a pid {old['pid']} (SLURM job 4242)"
    assert warnings[0].startswith(f"[mimpipe] warning: run_dir: taking over {run_dir} from {old_owner}, started ")
    assert warnings[0].endswith("s ago, past its 10 s timeout")
    assert [m["step"] for m in read_metrics(run_dir) if "train/loss" in m] == list(range(1, 31))
    assert not (run_dir / "lease.json").exists()
