"""A process that joined the group leaves it before the interpreter finalises, however it exits (core/engine/
distributed.py): otherwise a gloo worker thread can abort the process with SIGABRT at exit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.launching import REPO

SCRIPT = """
import sys
import torch
import torch.distributed as dist
from core.engine.distributed import init_distributed

destroy = dist.destroy_process_group
dist.destroy_process_group = lambda *a, **k: (print("left the group", flush=True), destroy(*a, **k))
init_distributed("cpu")
dist.all_reduce(torch.ones(3))
if sys.argv[1] == "raise":
    raise RuntimeError("boom")
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize(("how", "code"), [("0", 0), ("3", 3), ("raise", 1)])
def test_the_group_is_left_on_every_exit(how, code):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, how], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == code, proc.stderr[-2000:]
    assert proc.stdout.count("left the group") == 1
