"""The environment and process count ./launch.sh gives a node's processes: the cores split between them
(OMP_NUM_THREADS) and idle OpenMP threads that sleep (OMP_WAIT_POLICY=PASSIVE), each unless the user set it, on CPU
and GPU nodes; NCCL's error handling the ranks expect (TORCH_NCCL_ASYNC_ERROR_HANDLING), through torchrun's agent to
the ranks; one process per GPU the node may use (CUDA_VISIBLE_DEVICES, the SLURM step); and the refusal to start
on a node whose GPUs torch cannot use.

PYTHON is a stand-in that runs launch.sh's own Python steps (`-m core.launch.gpus`, `-m core.entry.launch_check`) with
this interpreter and, where launch.sh would start torchrun (or, for one process, the stage itself), prints the
variables and the arguments instead. GPU nodes are a
stand-in nvidia-smi on PATH (tests/launching.py `fake_nvidia_smi`); this machine's torch sees no GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.engine.distributed import nccl_error_handling
from tests.launching import REPO, fake_nvidia_smi, fake_scontrol, pretrain_recipe, write_recipe

CORES = len(os.sched_getaffinity(0))
# Variables of the machine running the tests that would change what launch.sh derives.
HOST_VARS = (
    "OMP_NUM_THREADS",
    "OMP_WAIT_POLICY",
    "CUDA_VISIBLE_DEVICES",
    "NNODES",
    "NODE_RANK",
    "NPROC_PER_NODE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)


def _launch(tmp_path: Path, shards, *overrides: str, gpus: int | None = None, **env: str):
    """Run ./launch.sh on the tiny recipe with `overrides` and `env` (and a node of `gpus` fake GPUs); returns the
    CompletedProcess."""
    python = tmp_path / "python"
    python.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ "$1 $2" == "-m core.launch.torchrun" || "$1 $2" == "-m pretrain" ]]; then\n'
        '    echo "OMP_NUM_THREADS=${OMP_NUM_THREADS:-} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-}"\n'
        '    echo "ARGS: $*"; exit 0\n'
        "fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    return _run_launch_sh(tmp_path, shards, python, *overrides, gpus=gpus, MASTER_PORT="29999", **env)


def _run_launch_sh(tmp_path: Path, shards, python: Path, *overrides: str, gpus: int | None = None, **env: str):
    """./launch.sh on the tiny recipe with PYTHON=`python`, without the test machine's HOST_VARS and SLURM's."""
    recipe = write_recipe(tmp_path / "tiny.yaml", pretrain_recipe(shards, tmp_path / "run"))
    base = {k: v for k, v in os.environ.items() if k not in HOST_VARS and not k.startswith("SLURM_")}
    path = base["PATH"] if gpus is None else f"{fake_nvidia_smi(tmp_path / 'bin', gpus)}:{base['PATH']}"
    return subprocess.run(
        [str(REPO / "launch.sh"), str(recipe), *overrides],
        cwd=REPO,
        env={**base, "PATH": path, "PYTHON": str(python), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _launched_env(tmp_path: Path, shards, *overrides: str, gpus: int | None = None, **env: str) -> dict[str, str]:
    """The OpenMP variables and the processes ("NPROC") of a launch that reaches torchrun (its `--nproc-per-node`) or,
    for one process on one node, starts the stage without it ("1")."""
    proc = _launch(tmp_path, shards, *overrides, gpus=gpus, **env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("OMP_NUM_THREADS=")]
    (args,) = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("ARGS:")]
    nproc = args[args.index("--nproc-per-node") + 1] if args[:2] == ["-m", "core.launch.torchrun"] else "1"
    assert (nproc == "1") == (args[:2] == ["-m", "pretrain"]), args  # one process: no torchrun agent
    return {**dict(pair.split("=", 1) for pair in line.split()), "NPROC": nproc}


def test_cpu_runs_split_the_cores_and_let_idle_openmp_threads_sleep(tmp_path, shards):
    env = _launched_env(tmp_path, shards, NPROC_PER_NODE="1")
    assert env == {"OMP_NUM_THREADS": str(CORES), "OMP_WAIT_POLICY": "PASSIVE", "NPROC": "1"}
    env = _launched_env(tmp_path, shards, NPROC_PER_NODE="2")
    assert env["OMP_NUM_THREADS"] == str(max(CORES // 2, 1))


def test_the_users_openmp_settings_are_kept(tmp_path, shards):
    env = _launched_env(tmp_path, shards, NPROC_PER_NODE="2", OMP_NUM_THREADS="3", OMP_WAIT_POLICY="ACTIVE")
    assert env == {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE", "NPROC": "2"}


def _ranks_nccl_error_handling(tmp_path: Path, shards, **env: str) -> list[str]:
    """TORCH_NCCL_ASYNC_ERROR_HANDLING as each of the 2 ranks a real torchrun agent, started by ./launch.sh, gives it
    ("unset" where it has none): PYTHON runs launch.sh's steps and torchrun's agent as they are, with each rank's
    stage (`-m pretrain RECIPE ...`) replaced by a shell that prints the variable."""
    python = tmp_path / "python"
    python.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ "$1 $2" == "-m core.launch.torchrun" ]]; then\n'
        "    options=(); shift 2\n"
        '    while [[ "$1" != "-m" ]]; do options+=("$1"); shift; done\n'
        f'    exec {sys.executable} -m core.launch.torchrun "${{options[@]}}" --no-python bash -c \\\n'
        "        'echo \"rank $RANK: ${TORCH_NCCL_ASYNC_ERROR_HANDLING:-unset}\"'\n"
        "fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    proc = _run_launch_sh(tmp_path, shards, python, NPROC_PER_NODE="2", **env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))


def test_nccl_error_handling_reaches_the_ranks_through_torchrun_as_the_engine_sets_it(tmp_path, shards, monkeypatch):
    """torchrun's agent gives its ranks the variable from its own environment, else 1 (tear the process down from
    NCCL's watchdog): the ranks' own default (core/engine/distributed.py) applies only if launch.sh exports it."""
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    nccl_error_handling()  # what a rank started without a launcher sets
    expected = os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
    assert _ranks_nccl_error_handling(tmp_path, shards) == [f"rank 0: {expected}", f"rank 1: {expected}"]
    # The user's own choice is kept (docs/fault_tolerance.md: the ranks set it unless it is set).
    assert _ranks_nccl_error_handling(tmp_path, shards, TORCH_NCCL_ASYNC_ERROR_HANDLING="3") == [
        "rank 0: 3",
        "rank 1: 3",
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that sees no GPU")
def test_gpu_nodes_run_one_process_per_visible_gpu_and_split_the_cores(tmp_path, shards):
    # 8 GPUs, of which CUDA_VISIBLE_DEVICES shows 2; engine.device=cpu, since this torch cannot use them.
    env = _launched_env(tmp_path, shards, "engine.device=cpu", gpus=8, CUDA_VISIBLE_DEVICES="2,3")
    assert env == {"OMP_NUM_THREADS": str(max(CORES // 2, 1)), "OMP_WAIT_POLICY": "PASSIVE", "NPROC": "2"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that sees no GPU")
def test_gpus_that_torch_cannot_use_stop_the_launch_with_one_line(tmp_path, shards):
    proc = _launch(tmp_path, shards, "engine.device=auto", gpus=4)  # what a recipe leaves by default
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.splitlines()
    assert line.startswith("launch.sh: engine.device: 'auto', but nvidia-smi sees 4 GPUs (driver 470.57.02) and ")
    assert f"torch {torch.__version__} (built for CUDA {torch.version.cuda}) cannot use them" in line
    assert "OMP_NUM_THREADS=" not in proc.stdout  # torchrun was not started
    assert not (tmp_path / "run").exists()


def test_slurm_step_gives_the_nodes_master_and_gpus_per_node(tmp_path, shards):
    """`srun -N 2 --gpus-per-node=4 ./launch.sh` on the second node of a step that runs on the last two of a job's
    four 8-GPU nodes: the step's nodes, its first host as master, 4 processes; CUDA_VISIBLE_DEVICES narrows further."""
    fake_scontrol(tmp_path / "bin", {"gpu-3,gpu-4": ["gpu-3", "gpu-4"]})  # _launch's fake nvidia-smi goes beside it
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_JOB_NODELIST": "gpu-1,gpu-2,gpu-3,gpu-4",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "gpu-3,gpu-4",
        "SLURM_NODEID": "1",
        "SLURM_GPUS_ON_NODE": "4",
    }
    proc = _launch(tmp_path, shards, "engine.device=cpu", "--dry-run", gpus=8, **slurm)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--nnodes 2 --node-rank 1 --nproc-per-node 4 --master-addr gpu-3 --master-port 29999" in proc.stdout
    assert "2 nodes x 4 processes per node = world size 8, this is node 1" in proc.stderr
    proc = _launch(tmp_path, shards, "engine.device=cpu", "--dry-run", gpus=8, **slurm, CUDA_VISIBLE_DEVICES="0,1")
    assert proc.returncode == 0 and "--nnodes 2 --node-rank 1 --nproc-per-node 2 --master-addr gpu-3" in proc.stdout
