"""core/compat/deepspeed_muon.py: building an engine imports DeepSpeed's Muon module without compiling its kernels or
importing inductor's compiler; compiles after it are untouched."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.launching import REPO

# A fresh process: the test worker may have imported inductor's compiler already (the compiled tests).
SCRIPT = """
import importlib, os, sys
from pathlib import Path
import torch
from core.engine.distributed import DistInfo
from core.engine.setup import parallelize
from core.recipe.config import load_config

run_dir = Path(sys.argv[1])
os.environ["LOCAL_RANK"] = "0"
torch.distributed.init_process_group("gloo", store=torch.distributed.FileStore(str(run_dir / "store"), 1), rank=0,
                                     world_size=1)
cfg = load_config(None, [f"run_dir={run_dir}", "engine.zero_stage=1", "data.global_batch_size=4"])
parallelize(torch.nn.Linear(4, 2), cfg=cfg, dist=DistInfo(0, 0, 1, torch.device("cpu")), run_dir=run_dir)
muon = sys.modules["deepspeed.runtime.zero.muon.original_muon"]
print("built", hasattr(muon.zeropower_via_newtonschulz5, "__wrapped__"), "torch._inductor.compile_fx" in sys.modules,
      os.environ.get("TORCHDYNAMO_DISABLE"))
importlib.reload(muon)  # the same import outside the engine's construction: compiled, with inductor's compiler
print("reloaded", hasattr(muon.zeropower_via_newtonschulz5, "__wrapped__"), "torch._inductor.compile_fx" in sys.modules)
"""


def test_the_engine_imports_muon_uncompiled_and_a_later_import_compiles(tmp_path):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    env.pop("TORCHDYNAMO_DISABLE", None)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines() if line.startswith(("built", "reloaded"))]
    assert lines == [["built", "False", "False", "None"], ["reloaded", "True", "True"]], proc.stdout
