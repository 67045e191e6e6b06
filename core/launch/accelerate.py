"""A stage started by `accelerate launch` (Hugging Face accelerate, as a process launcher only; training stays on
DeepSpeed, configured from the recipe): where it finds its world, and which of accelerate's settings it refuses.

What `accelerate launch ... -m pretrain RECIPE` gives the processes it starts (accelerate 1.15):

    mode                                  processes                    world in the environment
    --multi_gpu, --use_deepspeed,         torchrun, run inside         RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
    --use_fsdp (or a config saying so)    accelerate's own process     MASTER_ADDR, MASTER_PORT (torchrun's)
    --cpu (or no GPU and no mode)         ONE process per `accelerate  MASTER_ADDR, MASTER_PORT only (only when
                                          launch`                      --num_processes or --num_machines > 1)
    --cpu --mpirun_hostfile FILE          mpirun                       MPI's (OMPI_COMM_WORLD_*, PMI_*, MV2_*)

Every mode also exports ACCELERATE_MIXED_PRECISION (`--mixed_precision`, default "no"), ACCELERATE_DYNAMO_* (the
torch.compile settings) and OMP_NUM_THREADS (`--num_cpu_threads_per_process`, default 1); --cpu adds
ACCELERATE_USE_CPU, KMP_AFFINITY and KMP_BLOCKTIME; --use_deepspeed adds ACCELERATE_USE_DEEPSPEED and
ACCELERATE_DEEPSPEED_* / ACCELERATE_GRADIENT_* for the DeepSpeed settings given.

So under torchrun's modes the stage finds its world as under launch.sh. In the CPU mode the one process accelerate
started becomes torchrun's agent for the processes asked for (`cpu_launch_command`: their count read from the
`accelerate launch` command line, core/compat/accelerate.py), and under mpirun the ranks read MPI's variables
(`mpi_world`). accelerate's settings never change the run: one that disagrees with the recipe stops it
(`setting_conflicts`), and a compile backend, which mimpipe does not use, is warned about.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from core.compat.accelerate import LaunchRequest, launch_request
from core.launch.ports import free_port
from core.recipe.config import Config

SHUTDOWN_TIMEOUT_S = "120"
"""torchrun's grace for the ranks' checkpoint after a SIGTERM or Ctrl-C, as launch.sh sets it (docs/processes.md)."""

# (rank, world size, local rank, local world size) under each MPI, in the order accelerate reads them.
MPI_VARIABLES = (
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # MPICH / Intel MPI (hydra)
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
)

_TRUE = ("1", "true", "yes", "y", "on", "t")


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip().lower() in _TRUE


def mpi_world(env: Mapping[str, str]) -> dict[str, str] | None:
    """torchrun's RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE from an MPI launcher's variables (mpirun, or
    `accelerate launch --cpu --mpirun_hostfile`); None when no MPI started this process."""
    for rank, size, local_rank, local_size in MPI_VARIABLES:
        if rank in env and size in env:
            return {
                "RANK": env[rank],
                "WORLD_SIZE": env[size],
                "LOCAL_RANK": env.get(local_rank, "0"),
                "LOCAL_WORLD_SIZE": env.get(local_size, "1"),
            }
    return None


def launch_argv(parent_argv: list[str]) -> list[str] | None:
    """The arguments after `launch` of an `accelerate launch` command line (`accelerate launch ...`, `accelerate-launch
    ...`, `python -m accelerate.commands.launch ...`); None for another command."""
    for i, word in enumerate(parent_argv):
        name = Path(word).name
        if name == "accelerate-launch" or word == "accelerate.commands.launch":
            return parent_argv[i + 1 :]
        if name in ("accelerate", "accelerate.commands.accelerate_cli") and parent_argv[i + 1 : i + 2] == ["launch"]:
            return parent_argv[i + 2 :]
    return None


def parent_argv() -> list[str]:
    """The command line of this process's parent (Linux's /proc), [] when it cannot be read."""
    try:
        cmdline = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return []
    return [arg.decode(errors="replace") for arg in cmdline.split(b"\0")[:-1]]


def cpu_launch_command(
    module: str, argv: list[str], env: Mapping[str, str], launcher_argv: list[str]
) -> list[str] | None:
    """The torchrun command that starts the processes `accelerate launch --cpu` asked for, when this process is the
    one it started in their place (`python -m MODULE ARGV`); None when it is not, or one process was asked for.

    accelerate's CPU launcher sets MASTER_ADDR only for more than one process or machine, and no rank; torchrun's and
    MPI's processes have theirs. The process turns into torchrun's agent (core/launch/torchrun.py, as launch.sh starts
    it): `--num_processes` over `--num_machines` per machine, this machine `--machine_rank`, the master
    `--main_process_ip:--main_process_port` (one machine without a port: a free one, as launch.sh takes).

    Args:
        module: The stage's module (`pretrain`, `finetune`).
        argv: Its arguments.
        env: This process's environment.
        launcher_argv: The parent's command line (`parent_argv()`).
    """
    if "RANK" in env or mpi_world(env) is not None or not _flag(env, "ACCELERATE_USE_CPU") or "MASTER_ADDR" not in env:
        return None
    after_launch = launch_argv(launcher_argv)
    if after_launch is None:
        return None
    request = launch_request(after_launch)
    if (request.num_processes <= 1 and request.num_machines <= 1) or request.mpirun_hostfile:
        return None
    return torchrun_command(module, argv, request, env)


def torchrun_command(module: str, argv: list[str], request: LaunchRequest, env: Mapping[str, str]) -> list[str]:
    """`python -m core.launch.torchrun ... -m MODULE ARGV` for the processes of `request` on this machine."""
    machines = max(request.num_machines, 1)
    if request.num_processes % machines:
        raise ValueError(
            f"accelerate launch --num_processes {request.num_processes} does not split over --num_machines {machines}"
        )
    port = request.main_process_port
    if port is None:
        port = free_port() if machines == 1 else int(env.get("MASTER_PORT", "29500"))
    return [
        sys.executable, "-m", "core.launch.torchrun",
        "--nnodes", str(machines), "--node-rank", str(request.machine_rank),
        "--nproc-per-node", str(request.num_processes // machines),
        "--master-addr", request.main_process_ip or env.get("MASTER_ADDR", "127.0.0.1"), "--master-port", str(port),
        "-m", module, *argv,
    ]  # fmt: skip


def _equal(given: str, want: object) -> bool:
    try:
        return float(given) == float(want)
    except (TypeError, ValueError):
        return given.strip().lower() == str(want).lower()


# accelerate's variable, its flag, the recipe key that decides instead, and that key's value in `cfg`.
_MUST_AGREE = (
    ("ACCELERATE_DEEPSPEED_ZERO_STAGE", "--zero_stage", "engine.zero_stage", lambda c: c.engine.zero_stage),
    (
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
        "--gradient_accumulation_steps",
        "engine.grad_accum_steps",
        lambda c: c.engine.grad_accum_steps,
    ),
    ("ACCELERATE_GRADIENT_CLIPPING", "--gradient_clipping", "optim.grad_clip", lambda c: c.optim.grad_clip),
    (
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
        "--offload_optimizer_device",
        "engine.offload_optimizer",
        lambda c: c.engine.offload_optimizer,
    ),
    (
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
        "--offload_param_device",
        "engine.offload_param",
        lambda c: c.engine.offload_param,
    ),
)
# accelerate's training back-ends other than a plain data-parallel start: mimpipe trains with DeepSpeed.
_OTHER_ENGINES = (
    ("ACCELERATE_USE_FSDP", "--use_fsdp"),
    ("ACCELERATE_USE_MEGATRON_LM", "--use_megatron_lm"),
    ("ACCELERATE_USE_PARALLELISM_CONFIG", "--use_parallelism_config"),
)


def setting_conflicts(cfg: Config, env: Mapping[str, str], device_type: str) -> tuple[list[str], list[str]]:
    """accelerate's settings in `env` against the run's: (refusals, warnings), one line each, [] when none.

    The recipe decides precision, ZeRO, accumulation, clipping, offload, compilation and the device; accelerate's
    flags for them are checked, never applied. `--mixed_precision no` is accelerate's default, so it says nothing.

    Args:
        cfg: The run's config, `engine.precision` already concrete (core/engine/precision.py).
        env: The environment (accelerate's variables, when it launched the stage).
        device_type: "cuda" or "cpu", the device the ranks train on.
    """
    refusals, warnings = [], []
    precision = env.get("ACCELERATE_MIXED_PRECISION", "no").strip().lower()
    if precision not in ("no", "", cfg.engine.precision):
        refusals.append(
            f"accelerate launch --mixed_precision {precision} (ACCELERATE_MIXED_PRECISION) against engine.precision "
            f"{cfg.engine.precision}: the recipe sets the precision; launch with engine.precision={precision}"
            if precision in ("bf16", "fp16")
            else f"accelerate launch --mixed_precision {precision} (ACCELERATE_MIXED_PRECISION): mimpipe trains in "
            "engine.precision (bf16, fp16 or fp32); drop --mixed_precision"
        )
    if _flag(env, "ACCELERATE_USE_CPU") and device_type != "cpu":
        refusals.append(
            f"accelerate launch --cpu (ACCELERATE_USE_CPU) against engine.device {cfg.engine.device}, which trains on "
            f"{device_type}: launch with engine.device=cpu"
        )
    for variable, flag, key, value in _MUST_AGREE:
        if variable in env and not _equal(env[variable], value(cfg)):
            refusals.append(
                f"accelerate launch {flag} {env[variable]} ({variable}) against {key} {value(cfg)}: the recipe sets "
                f"it (the DeepSpeed config is made from the recipe); launch with {key}={env[variable]}"
            )
    if env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        refusals.append(
            f"accelerate launch --deepspeed_config_file {env['ACCELERATE_DEEPSPEED_CONFIG_FILE']}: mimpipe makes the "
            "DeepSpeed config from the recipe (engine.*, run_dir/deepspeed.json); drop the file"
        )
    for variable, flag in _OTHER_ENGINES:
        if _flag(env, variable):
            refusals.append(
                f"accelerate launch {flag} ({variable}): mimpipe trains with DeepSpeed (engine.zero_stage); launch "
                "with --multi_gpu, or --cpu on CPUs"
            )
    dynamo = env.get("ACCELERATE_DYNAMO_BACKEND", "NO").strip().upper()
    if dynamo not in ("NO", ""):
        warnings.append(
            f"accelerate launch --dynamo_backend {dynamo.lower()} (ACCELERATE_DYNAMO_BACKEND) is ignored: "
            f"engine.compile ({cfg.engine.compile}) decides what is compiled"
        )
    return refusals, warnings
