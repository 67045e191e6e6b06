"""Process-group set-up and the few collectives the loop needs.

torchrun sets RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (under launch.sh, and `accelerate launch`:
core/launch/accelerate.py); an MPI launcher's ranks (mpirun, `accelerate launch --cpu --mpirun_hostfile`) read theirs
from MPI's variables; a plain `python -m pretrain` run becomes a one-process group on loopback, so every code path is
the distributed one.
"""

from __future__ import annotations

import atexit
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from core.launch import gpus
from core.launch.accelerate import mpi_world
from core.launch.ports import free_port


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(preference: str) -> torch.device:
    """`auto` takes CUDA when torch sees a GPU, else the CPU, but never the CPU on a node whose GPUs torch cannot use.

    Raises:
        ValueError: `cuda` without a GPU, or GPUs that nvidia-smi lists and torch does not see (`core.launch.gpus`); the
            pre-flight refuses the same before launch.sh starts any process.
    """
    problem = gpus.cuda_unusable(preference)
    if problem is not None:
        raise ValueError(f"engine.device: {problem}")
    use_cuda = preference != "cpu" and torch.cuda.is_available()
    return torch.device("cuda") if use_cuda else torch.device("cpu")


def init_distributed(device_preference: str, timeout_s: int = 600) -> DistInfo:
    """Initialise DeepSpeed's process group (NCCL on GPU, gloo on CPU) and return this process's place in it.

    Args:
        device_preference: `engine.device`: "auto", "cuda" or "cpu".
        timeout_s: How long any collective may wait for the other ranks before it raises: the bound on a hang when
            a rank dies without its peers' connections dropping (a lost node). gloo enforces it per operation, NCCL
            through its watchdog. A rank that crashes on a live host fails its peers' collectives at once. Waits
            that can take longer (rank 0 converting a checkpoint) happen outside collectives.
    """
    device = pick_device(device_preference)
    if device.type == "cuda":
        nccl_error_handling()
    # DeepSpeed picks its accelerator at import time from this variable; set it before the first import.
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")
    if "RANK" not in os.environ:
        os.environ.update(world_from_launcher(os.environ))
    import deepspeed

    # DeepSpeed's ZeRO still calls this torch collective under its old name; the warning is noise for users.
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        deepspeed.init_distributed(dist_backend=backend, verbose=False, timeout=timedelta(seconds=timeout_s))
        # Leave the group before the interpreter finalises, on every way out (an exit code, an exception): a gloo
        # worker thread that drops its last tensor reference after Python has started finalising cannot take the GIL,
        # is ended by pthread_exit, and that unwinding through C++ aborts the process ("terminate called without an
        # active exception", SIGABRT instead of the exit code; 5 of 19 two-rank runs here that skipped it).
        atexit.register(shutdown)
    return DistInfo(dist.get_rank(), local_rank, dist.get_world_size(), device)


def world_from_launcher(env: Mapping[str, str]) -> dict[str, str]:
    """The variables a process without torchrun's RANK sets before joining: MPI's ranks (`mpi_world`; MASTER_ADDR
    and MASTER_PORT must be set, as `accelerate launch --cpu` sets them), else a one-process group on loopback.

    Raises:
        ValueError: An MPI world of several processes without MASTER_ADDR / MASTER_PORT.
    """
    world = mpi_world(env)
    if world is not None and int(world["WORLD_SIZE"]) > 1:
        if not (env.get("MASTER_ADDR") and env.get("MASTER_PORT")):
            raise ValueError(
                f"MPI started {world['WORLD_SIZE']} processes without MASTER_ADDR and MASTER_PORT: set both to rank "
                "0's host and a free port there (accelerate launch --main_process_ip, --main_process_port)"
            )
        return world
    return {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": env.get("MASTER_ADDR", "127.0.0.1"),
        "MASTER_PORT": env.get("MASTER_PORT") or str(free_port()),
    }


def nccl_error_handling() -> None:
    """Have NCCL's watchdog abort the communicators on a peer's error or a collective timeout and leave the process to
    raise (TORCH_NCCL_ASYNC_ERROR_HANDLING=2, "clean up only"), unless the user chose a mode.

    torch's default (3) ends the process from the watchdog thread: std::terminate, a C++ stack dump and SIGABRT,
    without the rank's one line. With 2 the error reaches the rank's Python code as an exception (DistBackendError,
    "NCCL communicator was aborted ..."), which core/engine/failure.py reports as a rank stopped by another, as under
    gloo. Should the abort itself hang, torch's heartbeat monitor (TORCH_NCCL_ENABLE_MONITORING) still ends the
    process. Not run here (no GPU): tests/unit/test_failure.py checks the mapping of NCCL's errors. Under torchrun the
    rank always finds the variable set (its agent passes its own on, else 1): launch.sh exports this 2 to the agent.
    """
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce (`sum` or `max`) that also works on a one-process group."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor


def all_gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's rows of `tensor` (N_r, ...), concatenated in rank order; ranks may hold different row counts.

    Collective: every rank must call it, with the same trailing shape and dtype. Rows are padded to the longest
    rank's count for the gather and the padding is dropped again.
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return tensor
    counts = [torch.zeros(1, dtype=torch.int64, device=tensor.device) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([len(tensor)], dtype=torch.int64, device=tensor.device))
    counts = [int(c) for c in counts]
    padded = tensor.new_zeros((max(counts), *tensor.shape[1:]))
    padded[: len(tensor)] = tensor
    gathered = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(gathered, padded)
    return torch.cat([rows[:count] for rows, count in zip(gathered, counts, strict=True)])


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
