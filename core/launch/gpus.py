"""The GPUs this node's processes may use, counted without torch, and the check that torch can use them.

`python -m core.launch.gpus` prints the count; launch.sh takes its default processes per node from it. The count is the
smallest of what applies here:
- `nvidia-smi -L`: the GPUs the driver sees on the node (with no nvidia-smi, this limit is unknown);
- SLURM, inside a job: the GPUs of this step on this node (`SLURM_GPUS_ON_NODE`, which srun sets for the step and
  sbatch for the batch step; else the ids in `SLURM_STEP_GPUS`, else the job's `SLURM_JOB_GPUS`);
- `CUDA_VISIBLE_DEVICES`, when set: the devices CUDA will show (an empty value shows none). It only narrows: without
  nvidia-smi or SLURM naming GPUs, it does not make a CPU machine count as a GPU node.

`cuda_unusable` is the pre-flight's (and `pick_device`'s) refusal to fall back to the CPU when the node has GPUs that
torch cannot use, which is what a driver too old for torch's CUDA build looks like from inside torch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping

_NVIDIA_SMI_TIMEOUT_S = 60  # a hung driver must not hang the launch


def _nvidia_smi(*args: str) -> str | None:
    """nvidia-smi's stdout, or None when it is not installed; a failing or hanging nvidia-smi gives ''."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        proc = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=_NVIDIA_SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout if proc.returncode == 0 else ""


def nvidia_smi_gpus() -> int | None:
    """How many GPUs `nvidia-smi -L` lists (its `GPU N: ...` lines), or None when there is no nvidia-smi."""
    listing = _nvidia_smi("-L")
    return None if listing is None else sum(line.startswith("GPU ") for line in listing.splitlines())


def driver_version() -> str:
    """The NVIDIA driver version nvidia-smi reports (its first GPU's), or "unknown"."""
    versions = (_nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader") or "").split()
    return versions[0] if versions else "unknown"


def cuda_visible_count(value: str, num_physical: int | None = None) -> int:
    """How many devices CUDA shows under `CUDA_VISIBLE_DEVICES=value`.

    CUDA reads the comma-separated entries (indices, `GPU-...` or `MIG-...` UUIDs) up to the first invalid one: `-1`,
    a word such as SLURM's `NoDevFiles`, or an index the node does not have (`num_physical`, when known).
    """
    count = 0
    for entry in value.split(","):
        entry = entry.strip()
        valid_index = entry.isdigit() and (num_physical is None or int(entry) < num_physical)
        if not (valid_index or entry.startswith(("GPU-", "MIG-"))):
            break
        count += 1
    return count


def slurm_gpus(env: Mapping[str, str]) -> int | None:
    """The GPUs SLURM gave this step on this node, or None outside a SLURM job or when it names none."""
    if not env.get("SLURM_JOB_ID"):
        return None
    on_node = env.get("SLURM_GPUS_ON_NODE", "")
    if on_node.isdigit():
        return int(on_node)
    for name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):  # comma-separated GPU ids; the job's is the fallback
        if env.get(name):
            return len(env[name].split(","))
    return None


def visible_gpus(env: Mapping[str, str] = os.environ) -> int:
    """How many GPUs this node's processes may use (see the module docstring); 0 on a machine without any."""
    return _narrowed(nvidia_smi_gpus(), env)


def _narrowed(physical: int | None, env: Mapping[str, str]) -> int:
    """The node's `physical` GPUs (None: unknown) narrowed by SLURM's step and CUDA_VISIBLE_DEVICES."""
    known = [count for count in (physical, slurm_gpus(env)) if count is not None]
    if "CUDA_VISIBLE_DEVICES" in env and known:
        known.append(cuda_visible_count(env["CUDA_VISIBLE_DEVICES"], physical))
    return min(known, default=0)


def cuda_unusable(device: str, env: Mapping[str, str] = os.environ) -> str | None:
    """Why `engine.device: device` cannot run as meant, as one line for that key, or None when it can.

    `auto` and `cuda` are refused where nvidia-smi lists GPUs this node may use and torch sees none: `auto` would
    train on the CPU without a word. The line names the driver and torch's CUDA build, the usual mismatch.
    """
    if device == "cpu":
        return None
    physical = nvidia_smi_gpus()
    num_gpus = _narrowed(physical, env) if physical else 0
    if device == "auto" and num_gpus == 0:  # no GPU this node may use: the CPU is what `auto` means here
        return None
    # Imported only now: `python -m core.launch.gpus` and launch.sh's check on a CPU node need no torch (seconds).
    import torch

    if torch.cuda.is_available():
        return None
    if num_gpus == 0:
        return "'cuda', but torch sees no CUDA device" if device == "cuda" else None
    build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return (
        f"{device!r}, but nvidia-smi sees {num_gpus} GPU{'s' if num_gpus > 1 else ''} (driver {driver_version()}) "
        f"and torch {torch.__version__} ({build}) cannot use them; a driver too old for the CUDA build is the usual "
        "cause: update the driver or install a torch built for its CUDA, or set engine.device=cpu to train on the CPU"
    )


if __name__ == "__main__":
    print(visible_gpus())
