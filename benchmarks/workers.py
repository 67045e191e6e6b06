"""What the interleaved benchmarks share: every measurement runs in a fresh worker process (`SCRIPT --worker SPEC`)
that makes its own one-process group and writes its timings as JSON to `spec["out"]`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_LAUNCHER_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT")


def worker_env(threads: int, **extra: str) -> dict[str, str]:
    """This process's environment for a worker: no launcher variables (each worker makes its own group on a free
    port), `threads` OpenMP threads, offline, DeepSpeed on the CPU accelerator; `extra` on top."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_KEYS}
    env.update(OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu", **extra)
    return env


def run_worker(script: str, spec: dict, env: dict[str, str], what: object) -> dict:
    """Run `script --worker SPEC` in the repository root and return the JSON it wrote to `spec["out"]`; a failed
    worker raises naming `what` with the end of its output."""
    command = [sys.executable, script, "--worker", json.dumps(spec)]
    proc = subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
    return json.loads(Path(spec["out"]).read_text())
