"""The `mimpipe` command (pyproject's console script): `mimpipe COMMAND ARGS...` runs what `python -m MODULE ARGS...`
runs, the module as `__main__` with the arguments passed on unchanged, so the two behave alike in every way (exit
codes, errors, the run's files). It starts one process; multi-process and multi-node runs go through ./launch.sh.

Piped into a reader that closes early (`mimpipe status RUN_DIR | head -1`), a command ends without a traceback, exit
code 141 (core/compat/closed_pipe.py); a training stage's ranks keep their own handling while they run."""

from __future__ import annotations

import runpy
import sys

from core.compat.closed_pipe import quiet_on_closed_pipe

COMMANDS = {
    "pretrain": ("pretrain", [], "pretrain (or train a BEiT tokenizer): mimpipe pretrain RECIPE [key=value ...]"),
    "finetune": (
        "finetune",
        [],
        "fine-tune or probe: mimpipe finetune RECIPE [key=value ...]; also `finetune convert`",
    ),
    "data": ("data", [], "write, index or inspect shards: mimpipe data write|index|inspect ..."),
    "export": (
        "pretrain",
        ["export"],
        "export a pretraining run's encoder: mimpipe export RUN_DIR [--step N] [--push-to-hub ORG/NAME [--private]]",
    ),
    "evaluate": (
        "finetune",
        ["evaluate"],
        "kNN, linear probe, few-shot, rank of encoders: mimpipe evaluate CHECKPOINT ... --train S --val S --out DIR",
    ),
    "status": ("core.entry.status", [], "one screen on a run: mimpipe status RUN_DIR [--json] [--verify]"),
}
"""Each command's module (run as `python -m` runs it), the arguments put before the user's, and its help line."""

USAGE = "usage: mimpipe {" + ",".join(COMMANDS) + "} ARGS..."


def help_text() -> str:
    """What `mimpipe --help` prints: the commands, their `python -m` equivalents, and where multi-GPU runs go."""
    width = max(map(len, COMMANDS))
    lines = [USAGE, "", "commands (each the same as `python -m MODULE ARGS...`):"]
    for name, (module, first, line) in COMMANDS.items():
        lines.append(f"  {name:<{width}}  {line}  [python -m {' '.join([module, *first])}]")
    lines += [
        "",
        "One process. Runs on several GPUs or nodes go through ./launch.sh RECIPE [key=value ...] (torchrun).",
        "`mimpipe COMMAND --help` shows a command's own options.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int | str | None:
    """Run `argv[0]`'s module as `__main__` with the rest of `argv` (default: sys.argv[1:]) as its arguments.

    Returns:
        What `sys.exit` takes: 0 after --help; 2 for a missing or unknown command; a command's own exit status (its
        SystemExit's code, as under `python -m`); 141 when stdout's reader closed the pipe.
    """
    return quiet_on_closed_pipe(lambda: run_command(sys.argv[1:] if argv is None else argv))


def run_command(argv: list[str]) -> int:
    """`main`'s work: the help, the unknown command's line, or the command's module run as `__main__`."""
    if not argv or argv[0] in ("-h", "--help"):
        print(help_text())
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(
            f"mimpipe: unknown command {argv[0]!r} (choose from {', '.join(COMMANDS)}; mimpipe --help)", file=sys.stderr
        )
        return 2
    module, first, _ = COMMANDS[argv[0]]
    sys.argv = [f"mimpipe {argv[0]}", *first, *argv[1:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
