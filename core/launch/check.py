"""Pre-launch check used by launch.sh (through `python -m core.entry.launch_check`, which hands in each stage's own
checks): validate the recipe, the launch topology and the batch split for the world size the launch will have, and
pre-flight the recipe's files (core/launch/preflight.py), before any process starts; print
the plan (stderr; with --dry-run also the resolved config) and the module to run (stdout, the only thing launch.sh
reads). Every problem is one line on stderr, `launch.sh: KEY: ...`, and exit code 2. A run_dir whose run already
finished this schedule prints nothing on stdout and exits 0: launch.sh then starts nothing (core/launch/rundir.py).

The world size is nodes x processes per node, or, for a DeepSpeed hostfile, the sum of the processes on the hosts
used. Errors name the environment variable launch.sh took the value from.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from core.launch.lease import TAKE_OVER_FLAG
from core.launch.preflight import StageChecks, preflight
from core.launch.rundir import ALLOW_FLAG
from core.recipe.config import ConfigError, dump_config, load_config
from core.recipe.objective_kinds import copies_note

# The module launch.sh runs for each `stage` (the tokenizer is trained by the pretraining entry point).
STAGE_MODULES = {"pretrain": "pretrain", "tokenizer": "pretrain", "finetune": "finetune"}

# One hostfile entry as DeepSpeed's runner reads it: `worker-0 slots=8`.
HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)\s*$")


@dataclass(frozen=True)
class Topology:
    """Where the processes run: one (host, processes) pair per node, hosts unnamed for torchrun."""

    nodes: list[tuple[str | None, int]]
    node_rank: int | None
    """This launch's node, or None when the rendezvous assigns it or one launcher starts every node."""

    @property
    def world_size(self) -> int:
        return sum(num for _, num in self.nodes)

    def describe(self) -> str:
        num_nodes = len(self.nodes)
        counts = {num for _, num in self.nodes}
        if len(counts) == 1:
            per_node = counts.pop()
            text = f"{_plural(num_nodes, 'node')} x {_plural(per_node, 'process', 'es')} per node"
        else:
            text = f"{_plural(num_nodes, 'node')} ({', '.join(f'{host}: {num}' for host, num in self.nodes)})"
        text += f" = world size {self.world_size}"
        if self.node_rank is not None:
            text += f", this is node {self.node_rank}"
        return text


def _plural(num: int, word: str, suffix: str = "s") -> str:
    return f"{num} {word}" if num == 1 else f"{num} {word}{suffix}"


def _positive(text: str, name: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{name}={text!r} is not a positive integer")
    return int(text)


def parse_nnodes(text: str) -> int:
    """NNODES as torchrun takes it, N or MIN:MAX; a range must be fixed (MIN == MAX).

    An elastic range is refused: torchrun would restart the workers at whatever size the rendezvous reaches, and
    each such restart would resume through the universal-checkpoint conversion (see core/engine/checkpoint.py),
    which is made for a deliberate relaunch at another size, not for membership that changes under a running job.
    """
    low, sep, high = text.partition(":")
    num = _positive(low, "NNODES")
    if sep and _positive(high, "NNODES") != num:
        raise ValueError(
            f"NNODES={text}: an elastic node range is not supported. Set a fixed NNODES; MAX_RESTARTS still "
            "restarts failed workers at that size, and relaunching with another NNODES resumes the run's checkpoint "
            "at the new world size."
        )
    return num


def read_hostfile(path: Path, num_nodes: int | None, nproc_per_node: int | None) -> list[tuple[str, int]]:
    """The (host, processes) pairs DeepSpeed's runner will use: the first `num_nodes` hosts, each with its slots or
    `nproc_per_node` (its --num_nodes / --num_gpus)."""
    hosts: dict[str, int] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = HOSTFILE_LINE.match(line)
        if not match:
            raise ValueError(f"HOSTFILE {path}:{number}: expected `host slots=N`, got {line!r}")
        host, slots = match.group(1), int(match.group(2))
        if host in hosts:
            raise ValueError(f"HOSTFILE {path}:{number}: host {host} is listed twice")
        if slots < 1:
            raise ValueError(f"HOSTFILE {path}:{number}: {host} has no slots")
        hosts[host] = slots
    if not hosts:
        raise ValueError(f"HOSTFILE {path} lists no hosts")
    if num_nodes is not None and num_nodes > len(hosts):
        raise ValueError(f"NNODES={num_nodes} but HOSTFILE {path} lists {len(hosts)} hosts")
    return [(host, nproc_per_node or slots) for host, slots in list(hosts.items())[:num_nodes]]


def topology(args: argparse.Namespace) -> Topology:
    """Check the launch variables launch.sh passed on and lay out the nodes."""
    nproc = _positive(args.nproc_per_node, "NPROC_PER_NODE") if args.nproc_per_node else None
    if args.hostfile:
        num_nodes = _positive(args.nnodes, "NNODES (with HOSTFILE)") if args.nnodes else None
        return Topology(read_hostfile(Path(args.hostfile), num_nodes, nproc), node_rank=None)
    if nproc is None:
        raise ValueError("NPROC_PER_NODE is not set")
    num_nodes = parse_nnodes(args.nnodes or "1")
    node_rank = None
    if args.node_rank is not None:
        if not args.node_rank.isdigit() or int(args.node_rank) >= num_nodes:
            raise ValueError(f"NODE_RANK={args.node_rank!r} is not a node of NNODES={num_nodes} (0..{num_nodes - 1})")
        node_rank = int(args.node_rank)
    return Topology([(None, nproc)] * num_nodes, node_rank)


def check_launch(argv: list[str] | None, stages: Mapping[str, Callable[[], StageChecks]]) -> int:
    """Check a launch (see the module docstring) and print the module to run; returns the exit code.

    Args:
        argv: `RECIPE [overrides] [launch options]`, as launch.sh passes them.
        stages: For each `stage`, a function returning that stage's checks (imported only for the stage launched).
    """
    parser = argparse.ArgumentParser(prog="python -m core.entry.launch_check")
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--nnodes", help="NNODES: N (or N:N); with --hostfile, how many of its hosts to use")
    parser.add_argument("--nproc-per-node", help="NPROC_PER_NODE; with --hostfile, replaces every host's slots")
    parser.add_argument("--node-rank", help="NODE_RANK, when this launch starts one given node")
    parser.add_argument("--hostfile", help="DeepSpeed hostfile: nodes and processes come from its `slots=`")
    parser.add_argument("--launcher", default="torchrun", help="how the processes meet, for the plan")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument(ALLOW_FLAG, action="store_true", help="resume run_dir even if its checkpoint's config differs")
    parser.add_argument(TAKE_OVER_FLAG, action="store_true", help="take run_dir over even if its lease is live")
    args = parser.parse_args(argv)
    try:
        topo = topology(args)
        cfg = load_config(args.recipe, args.overrides)
        per_device = cfg.batch_size_per_device(topo.world_size)
    except (ConfigError, ValueError, OSError) as err:
        print(f"launch.sh: {err}", file=sys.stderr)
        return 2
    module = STAGE_MODULES[cfg.stage]
    findings = preflight(
        cfg,
        stages[cfg.stage](),
        world_size=topo.world_size,
        allow_change=args.allow_config_change,
        take_over=args.take_over_run_dir,
        owner_check=len(topo.nodes) == 1 or bool(args.hostfile) or topo.node_rank == 0,
    )
    for problem in findings.problems:
        print(f"launch.sh: {problem.line()}", file=sys.stderr)
    if findings.problems:
        return 2
    for note in findings.relaunch.notes(cfg.run_dir):
        print(f"[mimpipe] {note}", file=sys.stderr)
    for warning in findings.warnings:
        print(f"[mimpipe] warning: {warning}", file=sys.stderr)
    for note in findings.notes:
        print(f"[mimpipe] {note}", file=sys.stderr)
    if findings.relaunch.finished:
        return 0  # nothing on stdout: launch.sh starts no process
    if args.dry_run:
        print(dump_config(cfg), file=sys.stderr)
    copies = copies_note(cfg.objective, per_device)
    print(
        f"[mimpipe] plan: {topo.describe()}; {args.launcher}\n"
        f"[mimpipe] plan: global batch {cfg.data.global_batch_size} = {per_device} per device x "
        f"{cfg.engine.grad_accum_steps} accumulation x {topo.world_size} ranks{copies}, "
        f"lr {cfg.peak_lr:.4g}, "
        f"ZeRO-{cfg.engine.zero_stage}, {cfg.engine.precision} ({findings.precision.reason})\n"
        f"[mimpipe] pre-flight: {'; '.join(findings.passed)}",
        file=sys.stderr,
    )
    print(module)
    return 0
