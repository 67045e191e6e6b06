"""What a launch does before its imports (core/entry/stage.py): launch.sh's check of a pretraining recipe, loading
a recipe and the entry points import no torch; the data workers' fork server starts only for a recipe with workers,
and it, like the rank, has timm without wandb.

Each case runs in a fresh interpreter: what a process has imported, and its fork server, are its own."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from core.entry.stage import has_workers
from tests.launching import REPO, write_synthetic

PROBE = """
import json, multiprocessing.forkserver, sys
from core.entry.stage import prestart
from data.worker_process import context
before = sorted(m for m in ("torch", "timm", "wandb") if m in sys.modules)
prestart(sys.argv[1:])
after = sorted(m for m in ("timm", "wandb") if m in sys.modules)
with open(f"/proc/{multiprocessing.forkserver._forkserver._forkserver_pid}/cmdline", "rb") as f, open(
    "/proc/self/cmdline", "rb"
) as own:
    server = "forked" if f.read() == own.read() else "exec'd"  # a fork runs this command line, not its own
queue = context().SimpleQueue()  # what a worker forked from the server holds
code = "import sys; q.put(sorted(m for m in ('timm', 'wandb') if m in sys.modules))"
process = context().Process(target=exec, args=(code, {"q": queue}))
process.start()
worker = queue.get()
process.join()
import timm.utils.summary, wandb  # the run's own wandb logger imports it (logging.wandb)
print(json.dumps({"before": before, "after": after, "server": server, "worker": worker,
                  "timm_has_wandb": hasattr(timm.utils.summary, "wandb"), "wandb": wandb.__name__}))
"""


def _recipe(tmp_path: Path, name: str, data: dict) -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"stage": "pretrain", "data": {"train": "shards/none", **data}}))
    return str(path)


def test_the_recipe_and_the_entry_points_import_no_torch_before_prestart(tmp_path):
    """Loading a recipe (launch.sh's check does, and every stage first) and importing the stage's start cost no
    torch import (seconds); prestart then imports timm, without wandb, and forks the fork server from the rank
    (not a fresh interpreter: the server's workers have timm without importing it); wandb still imports
    afterwards."""
    pytest.importorskip("wandb")
    recipe = _recipe(tmp_path, "workers.yaml", {"num_workers": 1})
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, recipe, "optim.base_lr=1e-3"], cwd=REPO, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "before": [], "after": ["timm"], "server": "forked", "worker": ["timm"], "timm_has_wandb": False,
        "wandb": "wandb",
    }, proc.stderr[-2000:]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["{no_workers}"], "num_workers 0: no worker to start"),
        (["{workers}", "data.num_wokers=2"], "a misspelt override: the stage reports it"),
        (["{workers}.missing"], "no such recipe: the stage reports it"),
        (["export", "runs/x"], "a subcommand"),
    ],
)
def test_no_fork_server_without_workers_or_a_recipe(tmp_path, argv, why):
    paths = {
        "no_workers": _recipe(tmp_path, "none.yaml", {"num_workers": 0}),
        "workers": _recipe(tmp_path, "workers.yaml", {"num_workers": 2}),
    }
    assert has_workers([paths["workers"], "optim.base_lr=1e-3", "--allow-config-change"])
    assert not has_workers([arg.format(**paths) for arg in argv]), why


def test_launch_sh_check_of_a_pretraining_recipe_imports_no_torch(tmp_path):
    """The check reads the recipe, the topology and the shards' first samples (launch.sh's seconds before the
    ranks start); torch, timm and webdataset are left to the ranks."""
    shards = write_synthetic(tmp_path / "train", "train", 8, 4, seed=0)
    recipe = _recipe(tmp_path, "check.yaml", {"train": str(shards), "num_workers": 1})
    code = textwrap.dedent("""
        import sys
        from core.entry.launch_check import main
        code = main(sys.argv[1:])
        print(code, sorted(m for m in ("torch", "timm", "webdataset") if m in sys.modules))
    """)
    proc = subprocess.run(
        [sys.executable, "-c", code, recipe, f"run_dir={tmp_path / 'run'}", "--nproc-per-node", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.stdout.splitlines()[-1] == "0 []", proc.stdout + proc.stderr
    assert "[mimpipe] pre-flight: run_dir writable; data.train: first sample of train-000000.tar" in proc.stderr
