"""The environment ./launch.sh gives a CPU run's processes: the cores split between them (OMP_NUM_THREADS) and idle
OpenMP threads that sleep (OMP_WAIT_POLICY=PASSIVE), each unless the user set it.

PYTHON is a stand-in that runs the pre-flight (`-m core.launch`) with this interpreter and, where launch.sh would
start torchrun, prints the variables instead."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launching import REPO, pretrain_recipe, write_recipe

pytestmark = pytest.mark.skipif(
    shutil.which("nvidia-smi") is not None, reason="launch.sh sets these for CPU runs, and nvidia-smi is here"
)


def _launched_env(tmp_path: Path, shards, nproc: int, **env: str) -> dict[str, str]:
    python = tmp_path / "python"
    python.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ "$1 $2" == "-m core.torchrun" ]]; then\n'
        '    echo "OMP_NUM_THREADS=${OMP_NUM_THREADS:-} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-}"; exit 0\n'
        "fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    recipe = write_recipe(tmp_path / "tiny.yaml", pretrain_recipe(shards, tmp_path / "run"))
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    proc = subprocess.run(
        [str(REPO / "launch.sh"), str(recipe)],
        cwd=REPO,
        env={**base, "PYTHON": str(python), "NPROC_PER_NODE": str(nproc), "MASTER_PORT": "29999", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("OMP_NUM_THREADS=")]
    return dict(pair.split("=", 1) for pair in line.split())


def test_cpu_runs_split_the_cores_and_let_idle_openmp_threads_sleep(tmp_path, shards):
    env = _launched_env(tmp_path, shards, nproc=1)
    assert env == {"OMP_NUM_THREADS": str(len(os.sched_getaffinity(0))), "OMP_WAIT_POLICY": "PASSIVE"}
    assert _launched_env(tmp_path, shards, nproc=2)["OMP_NUM_THREADS"] == str(max(len(os.sched_getaffinity(0)) // 2, 1))


def test_the_users_openmp_settings_are_kept(tmp_path, shards):
    env = _launched_env(tmp_path, shards, nproc=2, OMP_NUM_THREADS="3", OMP_WAIT_POLICY="ACTIVE")
    assert env == {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"}
