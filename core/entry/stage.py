"""How `python -m pretrain` and `python -m finetune` run their stage (each `__main__` calls `run`).

Before the stage's own imports, `prestart` imports timm without timm's wandb import (core/compat/timm_import.py)
and, when the recipe has data workers, the data modules, then forks the data workers' fork server from this process
while it still runs one thread: the server holds torch, torchvision, timm and the data modules without importing
them again (seconds of CPU per rank; data/worker_process.py). The stage then runs guarded: an error is one console
line and a logged traceback (core/engine/failure.py). A command other than a training run (`export`, `evaluate`, ...)
piped into a reader that closes early ends quietly (core/compat/closed_pipe.py).

Torch-free until those imports. A recipe that does not load is left alone by `prestart`: the stage loads it again
and refuses it as launch.sh's check does (one line, exit code 2; core/engine/failure.py).

Started by `accelerate launch --cpu` for several processes (accelerate's CPU launcher starts one and leaves the rest
to mpirun), the process first turns into torchrun's agent for them (core/launch/accelerate.py `cpu_launch_command`).
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable

from core.compat.closed_pipe import quiet_on_closed_pipe
from core.engine.failure import run_guarded, stopped_by_ctrl_c
from core.launch.accelerate import SHUTDOWN_TIMEOUT_S, cpu_launch_command, parent_argv
from core.launch.imports import imports_without_collection
from core.launch.lease import release_held
from core.recipe.config import load_config
from data.worker_process import start_fork_server

StageMain = Callable[[list[str]], int]

SUBCOMMANDS = {"pretrain": ("export",), "finetune": ("convert", "predict", "inspect", "evaluate")}
"""Each stage's commands besides a training run (pretrain/stage.py, finetune/stage.py `main`): piped into a reader that
closes early, they end quietly (core/compat/closed_pipe.py)."""


def run(stage: str, argv: list[str] | None = None) -> int:
    """`python -m STAGE ARGS`: `prestart`, then the stage's `main(argv)` (default: sys.argv[1:]), guarded; returns
    the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        command = cpu_launch_command(stage, argv, os.environ, parent_argv())
    except ValueError as err:  # accelerate's arguments: one line, as launch.sh's check refuses
        print(f"[mimpipe] refused: {err}", file=sys.stderr, flush=True)
        return 2
    if command is not None:
        become(command)
    try:
        prestart(argv)
        with imports_without_collection():
            main = STAGES[stage]()
    except KeyboardInterrupt:  # Ctrl-C during the imports (seconds)
        return stopped_by_ctrl_c()
    quiet = bool(argv) and argv[0] in SUBCOMMANDS[stage]  # a training rank keeps its own handling of a closed pipe
    try:
        code = run_guarded(lambda: quiet_on_closed_pipe(lambda: main(argv)) if quiet else main(argv))
    finally:
        release_held()  # rank 0 gives run_dir's lease back however the stage ended (core/launch/lease.py)
    # Nothing the stage built is collected again: frozen, it spares the interpreter's exit a garbage collection over
    # every object of torch, DeepSpeed, timm and dynamo (1.1 s of CPU per rank at every launch's end).
    gc.freeze()
    return code


def become(command: list[str]) -> None:
    """Replace this process by `command` (same pid: the launcher that waits for it gets its exit code), with torchrun's
    grace for the ranks' checkpoint after a SIGTERM as launch.sh gives it."""
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT_S)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(command[0], command)


def prestart(argv: list[str]) -> None:
    """Import timm (without wandb) and, when `has_workers(argv)`, the data modules, then start the fork server as a
    fork of this process, which then holds them all without importing them again."""
    workers = has_workers(argv)
    with imports_without_collection():
        import core.compat.timm_import  # noqa: F401  (timm without wandb, before anything else imports timm)

        if workers:
            import data.masking  # noqa: F401  (the workers' modules: the server inherits them)
            import data.pipeline  # noqa: F401
            import data.transforms  # noqa: F401
    if workers:
        start_fork_server(forked=True)


def has_workers(argv: list[str]) -> bool:
    """Whether `argv` (`RECIPE [section.key=value ...] [--flags]`) names a recipe that loads and has data workers. A
    subcommand's arguments (`export RUN_DIR`, `convert SRC DST`) name no recipe; `evaluate` has workers unless
    `--num-workers 0` (finetune/report_card.py)."""
    if argv[:1] == ["evaluate"]:
        given = set(argv) | {f"{flag} {value}" for flag, value in zip(argv, argv[1:], strict=False)}
        return not given & {"--num-workers 0", "--num-workers=0"}
    words = [arg for arg in argv if not arg.startswith("-")]
    if not (words and words[0].endswith((".yaml", ".yml"))):
        return False
    try:
        return load_config(words[0], words[1:]).data.num_workers > 0
    except (OSError, ValueError):  # ValueError: ConfigError too
        return False


def _pretrain() -> StageMain:
    from pretrain.stage import main

    return main


def _finetune() -> StageMain:
    from finetune.stage import main

    return main


STAGES: dict[str, Callable[[], StageMain]] = {"pretrain": _pretrain, "finetune": _finetune}
"""Each stage's `main`, imported when called (after `prestart`)."""
