"""What an `accelerate launch` command line asks for, read with accelerate's own parser: the one place mimpipe reaches
into accelerate, an optional dependency imported only by a process that `accelerate launch --cpu` started
(core/launch/accelerate.py).

accelerate's CPU launcher starts ONE process per `accelerate launch` and gives it no process count: with
`--num_processes 2` it only sets MASTER_ADDR and MASTER_PORT, and leaves starting the others to mpirun
(`--mpirun_hostfile`). The count is read here from the launching command line, through accelerate's
`launch_command_parser` and its `_validate_launch_command`, which merges a config file (`--config_file`) and fills
the defaults exactly as `accelerate launch` did.

Patches (`PATCHES`, by name):
    launch_args  `accelerate.commands.launch.launch_command_parser()` parses the arguments after `launch`, and
                 `_validate_launch_command(args)` returns them completed (first item of what it returns)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from core.compat.checks import CompatError, Library, run_checks

WRITTEN_FOR = "1.15"
"""The accelerate release series this was written against (checked on 1.15.0; pyproject's dev extra pins it)."""


class AccelerateCompatError(CompatError):
    """The installed accelerate no longer has an internal that this module relies on."""


ACCELERATE = Library("accelerate", "accelerate", __name__, WRITTEN_FOR, "accelerate>=1.15,<1.16", AccelerateCompatError)


@dataclass(frozen=True)
class LaunchRequest:
    """The processes an `accelerate launch` command asked for."""

    num_processes: int
    """In all, over every machine (accelerate's `--num_processes`)."""
    num_machines: int
    machine_rank: int
    main_process_ip: str | None
    main_process_port: int | None
    """None when neither the command nor its config file set one (accelerate then exports 29500)."""
    mpirun_hostfile: str | None
    """Set when accelerate started the processes with mpirun (ranks then come from MPI's variables)."""


def _launch_args(patch: str):
    module = ACCELERATE.module_named(patch, "accelerate.commands.launch")
    parser = ACCELERATE.attr(patch, module, "launch_command_parser")
    validate = ACCELERATE.method(
        patch, module, "_validate_launch_command", params=("args",), uses=("num_processes", "num_machines")
    )
    return parser, validate


PATCHES = {"launch_args": _launch_args}


def check(*names: str) -> None:
    """Run the checks of the named patches (default: all); raises AccelerateCompatError at the first that fails."""
    run_checks(PATCHES, names)


def launch_request(launch_argv: list[str]) -> LaunchRequest:
    """What `accelerate launch LAUNCH_ARGV` asked for, config file and defaults included.

    Raises:
        ValueError: The arguments do not parse as accelerate's (its own message).
        AccelerateCompatError: accelerate's parser or its validation is gone or changed.
    """
    make_parser, validate = _launch_args("launch_args")
    parser = make_parser()
    try:
        args = parser.parse_args(launch_argv)
    except SystemExit as exit_:  # argparse has printed why
        raise ValueError(f"accelerate launch {' '.join(launch_argv)}: its arguments do not parse") from exit_
    # accelerate logs the defaults it filled in ("The following values were not passed ..."): it said so already
    quiet = logging.getLogger("accelerate")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        args = validate(args)[0]
    finally:
        quiet.setLevel(level)
    port = getattr(args, "main_process_port", None)
    return LaunchRequest(
        num_processes=int(args.num_processes or 1),
        num_machines=int(args.num_machines or 1),
        machine_rank=int(getattr(args, "machine_rank", 0) or 0),
        main_process_ip=getattr(args, "main_process_ip", None),
        main_process_port=int(port) if port else None,
        mpirun_hostfile=getattr(args, "mpirun_hostfile", None),
    )
