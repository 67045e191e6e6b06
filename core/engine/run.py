"""A stage's life, as both entry points run it: `start_stage` (config, process group, run dir, resume point, logger),
`start_engine` (the DeepSpeed engine with its checkpoint restored), `run_loop` (the loop, turned into an exit code)
and `finish_stage`."""

from __future__ import annotations

import argparse
import functools
import os
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from core.compat.deepspeed import is_partitioned, partition_report
from core.engine import preempt
from core.engine.checkpoint import RNGState, find_resume, load_checkpoint, load_states
from core.engine.compiled import describe_compiled
from core.engine.distributed import DistInfo, init_distributed, shutdown
from core.engine.failure import EXIT_REFUSED, StageExit, log_tracebacks_to
from core.engine.loop import LoopHooks, NonFiniteLossError, PreemptedError, train
from core.engine.parent_death import die_with_launcher
from core.engine.plan import launch_plan
from core.engine.precision import resolve_precision
from core.engine.rollback import TooManyRollbacksError
from core.engine.setup import parallelize
from core.engine.stage import StageRun
from core.engine.teacher import has_teacher, saved_teacher_missing, start_teacher
from core.engine.train_state import TrainState
from core.engine.utilisation import device_peak
from core.launch.accelerate import setting_conflicts
from core.launch.ckpt_files import choose_resume
from core.launch.disk import checkpoint_room
from core.launch.lease import TAKE_OVER_FLAG, HeldLease, acquire
from core.launch.rundir import ALLOW_FLAG, Relaunch, keep_launch_config, mark_finished, relaunch
from core.recipe.config import Config, dump_config, load_config
from core.report.logging import MetricsLogger
from data.quickstart import SYNTHETIC_WARNING
from data.specs import dataset_size, is_synthetic

EXIT_NONFINITE = 3
"""Process exit code after `engine.max_consecutive_nonfinite` non-finite steps in a row, or a loss spike after
`engine.max_rollbacks` rollbacks (see `run_loop`)."""


def start_stage(prog: str, argv: list[str] | None, *, resolve: Callable[[Config], None] | None = None) -> StageRun:
    """Parse `RECIPE [overrides] [--allow-config-change] [--take-over-run-dir]`, load the config, join the process
    group, take run_dir's lease (core/launch/lease.py), check that the launch may go on in run_dir
    (core/launch/rundir.py), keep its config, find the resume point.

    Resume order: this run_dir's `checkpoints/latest`, else from scratch (fine-tuning applies `model.init`
    first; a resumed checkpoint is loaded over it).

    Args:
        prog: The command, for the usage message.
        argv: The arguments after it.
        resolve: Completes in place what the recipe leaves to the run (fine-tuning's `model.global_pool: auto`),
            before the config is written to run_dir/config.yaml and logged, so that both say what the run used.

    Raises:
        StageExit: Another live launch holds run_dir, or it holds a run of another config (exit 2), or this run,
            finished (exit 0).
        ConfigError: The recipe or an override does not fit the schema (run_guarded: one line, exit 2, as launch.sh's
            check).
    """
    parser = argparse.ArgumentParser(prog=prog, description="Run a recipe: RECIPE [section.key=value ...]")
    parser.add_argument("recipe", help="YAML recipe")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.base_lr=1e-4")
    parser.add_argument(ALLOW_FLAG, action="store_true", help="resume run_dir even if its config differs")
    parser.add_argument(TAKE_OVER_FLAG, action="store_true", help="take run_dir over even if its lease is live")
    args = parser.parse_args(argv)
    cfg = load_config(args.recipe, args.overrides)
    log_tracebacks_to(cfg.run_dir)  # an error from here on leaves its traceback in run_dir/logs (see run_guarded)
    preempt.install()
    die_with_launcher()
    dist = init_distributed(cfg.engine.device)
    precision = resolve_precision(cfg, dist.device)  # `auto` made concrete before config.yaml is written
    launcher_warnings = check_launcher_settings(cfg, dist)
    lease = own_run_dir(cfg, dist, args.recipe, take_over=args.take_over_run_dir)  # before run_dir is read or written
    if resolve is not None:
        resolve(cfg)
    samples = cfg.data.samples_per_epoch or dataset_size(cfg.data.train)
    total_steps, warmup_steps = cfg.steps(samples)
    notes = check_relaunch(cfg, dist, total_steps, allow_change=args.allow_config_change)
    run_dir, config_yaml = prepare_run_dir(cfg, dist)
    resume = find_resume(run_dir, dist.rank, dist.world_size)
    state = TrainState()
    load_states(resume, {"train": state})  # the data position is needed before the engine; the RNGs come after it
    logger = MetricsLogger(
        run_dir,
        enabled=dist.is_main,
        tensorboard=cfg.logging.tensorboard,
        total_steps=total_steps,
        resume_step=None if resume is None else state.step,
        wandb=cfg.logging.wandb,
    )
    for note in notes:
        logger.console(f"[mimpipe] {note}")
    for warning in launcher_warnings:
        logger.console(f"[mimpipe] warning: {warning}")
    if precision.warning is not None:
        logger.console(f"[mimpipe] warning: {precision.warning}")
    synthetic = is_synthetic(cfg.data.train)
    if synthetic:
        logger.text("data/synthetic", 0, f"data.train holds {SYNTHETIC_WARNING}")
    if resume is None:  # TensorBoard would keep a run's first hparams anyway; the resumed config is in config.yaml
        logger.hparams(cfg.model_dump(mode="json"))
    # ZeRO-3 and the ranks but 0 log no perf/mfu (see start_meter), so nothing is measured for them
    measures = cfg.engine.zero_stage != 3 and dist.is_main
    peak = device_peak(cfg.engine.peak_tflops, cfg.engine.precision, dist.device) if measures else None
    return StageRun(
        cfg,
        args.recipe,
        dist,
        run_dir,
        config_yaml,
        samples,
        total_steps,
        warmup_steps,
        resume,
        state,
        logger,
        peak,
        precision.reason,
        synthetic_data=synthetic,
        lease=lease,
    )


def check_launcher_settings(cfg: Config, dist: DistInfo) -> list[str]:
    """The settings `accelerate launch` left in the environment against the recipe's (core/launch/accelerate.py):
    returns the warnings rank 0 logs. Every rank reads the same flags and the same config, so all stop or none.

    Raises:
        StageExit: On every rank, code `EXIT_REFUSED`, when one disagrees with the recipe; rank 0's carries the lines.
    """
    refusals, warnings = setting_conflicts(cfg, os.environ, dist.device.type)
    if refusals:
        lines = "\n".join(f"[mimpipe] refused: {refusal}" for refusal in refusals)
        raise StageExit(EXIT_REFUSED, lines if dist.is_main else None)
    return warnings


def own_run_dir(cfg: Config, dist: DistInfo, recipe: str, *, take_over: bool) -> HeldLease | None:
    """Rank 0 takes run_dir's lease (core/launch/lease.py) and tells every rank whether it got it, so that all of them
    stop or none: of two launches that passed launch.sh's pre-flight together, one trains. Rank 0 prints a takeover's
    warning. Returns rank 0's lease (None on the other ranks); the stage gives it back when it ends (`finish_stage`,
    and core/entry/stage.py whatever the way it ends).

    Raises:
        StageExit: On every rank, code `EXIT_REFUSED`, when another live launch holds run_dir; rank 0's carries the
            line to print.
    """
    held, told = None, [None]
    if dist.is_main:
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        got = acquire(
            cfg.run_dir,
            stage=cfg.stage,
            recipe=os.path.abspath(recipe),
            stale_after_s=cfg.checkpoint.lease_timeout_s,
            take_over=take_over,
        )
        held, told = got.held, [got.refusal]
        if got.note is not None:
            print(f"[mimpipe] warning: run_dir: {got.note}", file=sys.stderr, flush=True)
    if dist.world_size > 1:
        torch.distributed.broadcast_object_list(told, src=0)
    if told[0] is not None:
        raise StageExit(EXIT_REFUSED, f"[mimpipe] refused: run_dir: {told[0]}" if dist.is_main else None)
    return held


def check_relaunch(cfg: Config, dist: DistInfo, total_steps: int, *, allow_change: bool) -> list[str]:
    """Whether this launch may go on in `cfg.run_dir` (core/launch/rundir.py), decided by rank 0 and told to every
    rank, so that all of them stop or none. Returns what rank 0 logs about it (the settings a resume changes).

    Raises:
        StageExit: On every rank: code `EXIT_REFUSED` when the checkpoint the resume would load there was written
            by another config (and no `--allow-config-change`), 0 when the run there already finished this schedule.
            Rank 0's carries the line to print.
    """
    told = [relaunch(cfg, total_steps, allow_change=allow_change) if dist.is_main else None]
    if dist.world_size > 1:
        torch.distributed.broadcast_object_list(told, src=0)
    verdict: Relaunch = told[0]
    refusal = verdict.refusal(cfg.run_dir)
    if refusal is not None:
        raise StageExit(EXIT_REFUSED, f"[mimpipe] refused: run_dir: {refusal}" if dist.is_main else None)
    notes = verdict.notes(cfg.run_dir)
    if verdict.finished:
        raise StageExit(0, f"[mimpipe] {notes[-1]}" if dist.is_main else None)
    return notes


def check_room(run: StageRun, objective: nn.Module | Callable[[], nn.Module]) -> None:
    """Whether the filesystem of run_dir has room for the checkpoints the run keeps (core/launch/disk.py), decided
    by rank 0 and told to every rank, so that all of them stop or none; rank 0 logs what it found. An objective
    given as its builder is built on the meta device for the estimate, the RNGs left as they were (every rank must
    build the real one from the same state).

    Raises:
        StageExit: On every rank, code `EXIT_REFUSED`, when there is no room; rank 0's carries the line to print.
    """
    told: list[str | None] = [None]
    if run.dist.is_main:
        problem, note = checkpoint_room(run.cfg, functools.partial(_meta_module, objective))
        told = [problem]
        if problem is None:
            run.logger.console(f"[mimpipe] {note}")
    if run.dist.world_size > 1:
        torch.distributed.broadcast_object_list(told, src=0)
    if told[0] is not None:
        raise StageExit(EXIT_REFUSED, f"[mimpipe] refused: run_dir: {told[0]}" if run.dist.is_main else None)


def _meta_module(objective: nn.Module | Callable[[], nn.Module]) -> nn.Module:
    if isinstance(objective, nn.Module):
        return objective
    rng = RNGState().state_dict()
    try:
        with torch.device("meta"):
            return objective()
    finally:
        RNGState().load_state_dict(rng)


def start_engine(
    run: StageRun,
    objective: nn.Module | Callable[[], nn.Module],
    *,
    after_build: Callable[[nn.Module], object] | None = None,
):
    """DeepSpeed engine for `objective` (built under the shared seed), the checkpoint restored; prints the plan.
    `objective` may be the function that builds it; `after_build` is called with what it built (see `parallelize`)."""
    cfg, dist = run.cfg, run.dist
    check_room(run, objective)
    universal = run.resume is not None and run.resume["universal"]
    engine, optimizer = parallelize(
        objective, cfg=cfg, dist=dist, run_dir=run.run_dir, load_universal=universal, after_build=after_build
    )
    seed_everything(cfg.seed + dist.rank)  # per-rank randomness (masks, drop path) from here on
    run.logger.console(
        launch_plan(
            cfg,
            dist,
            total_steps=run.total_steps,
            warmup_steps=run.warmup_steps,
            samples=run.samples,
            precision_reason=run.precision_reason,
            synthetic=run.synthetic_data,
        )
    )
    compiled = describe_compiled(engine.module)
    if compiled:
        run.logger.console(
            f"[mimpipe] engine.compile ({cfg.engine.compile}): {compiled} compiled with inductor "
            f"({cfg.engine.compile_mode} mode) on the first step; other batch sizes run eagerly"
        )
    elif cfg.engine.compile is True:
        run.logger.console(
            "[mimpipe] engine.compile: the objective has no transformer blocks to compile; it runs eagerly"
        )
    if is_partitioned(engine.module):
        run.logger.console(f"[mimpipe] ZeRO-3 partitioned parameters: {partition_report(engine.module)}")
    if run.resume is not None:
        refuse_without_teacher(run, engine)
        load_checkpoint(engine, run_dir=run.run_dir, resume=run.resume, states={"rng": RNGState()})
        run.logger.console(
            f"[mimpipe] resumed from {run.run_dir / 'checkpoints' / run.resume['tag']} at step {run.state.step}"
        )
        if "from_world_size" in run.resume:
            run.logger.console(
                f"[mimpipe] world size changed from {run.resume['from_world_size']} to {dist.world_size}: model and "
                f"optimizer state loaded from {run.resume['load_tag']}; the new data streams first read what the old "
                "ones left unread (docs/resume.md)"
            )
    tag_dir = None if run.resume is None else run.run_dir / "checkpoints" / run.resume["tag"]
    teacher_note = start_teacher(engine, tag_dir, universal=run.resume is not None and run.resume["universal"])
    if teacher_note is not None:
        run.logger.console(teacher_note)
    return engine, optimizer


def refuse_without_teacher(run: StageRun, engine) -> None:
    """A resume of an objective with an EMA teacher from a checkpoint that has none (another objective's run, kept
    with `--allow-config-change`) stops before anything loads: every rank reads the same checkpoint and stops, rank 0
    with one line.

    Raises:
        StageExit: Code `EXIT_REFUSED`, on every rank; rank 0's carries the line.
    """
    if not has_teacher(engine.module):
        return
    tag_dir = run.run_dir / "checkpoints" / run.resume["tag"]
    missing = saved_teacher_missing(engine, tag_dir)
    if missing:
        line = (
            f"[mimpipe] refused: checkpoint {tag_dir} has no EMA teacher ({len(missing)} tensors missing, e.g. "
            f"{missing[0]}): it was written by an objective without one; start a new run_dir, or warm-start from "
            "its export with model.init"
        )
        raise StageExit(EXIT_REFUSED, line if run.dist.is_main else None)


def run_loop(run: StageRun, engine, optimizer, batches: Iterator[dict], hooks: LoopHooks | None = None) -> int:
    """The training loop; returns the process exit code.

    Returns:
        0 when every step ran; `EXIT_NONFINITE` (3) after too many non-finite steps in a row or too many rollbacks;
        `EXIT_PREEMPTED` (4) after a SIGTERM, `EXIT_INTERRUPTED` (130) after a Ctrl-C, once the checkpoint of the
        step reached is saved. On a non-zero code the logger is closed and the stage should return the code.
    """
    preempt.install()  # normally done by start_stage already; SIGTERM and Ctrl-C are only deferred while the loop runs
    try:
        train(run, engine, optimizer, batches, hooks or LoopHooks())
    except (NonFiniteLossError, TooManyRollbacksError, PreemptedError) as err:
        code = err.code if isinstance(err, PreemptedError) else EXIT_NONFINITE
        run.logger.console(f"[mimpipe] {err} (exit code {code})")
        run.logger.close()  # TensorBoard keeps events in memory for up to two minutes
        return code
    finally:
        preempt.restore()
    return 0


def finish_stage(run: StageRun) -> None:
    """End a stage whose last step ran and whose export is written: `finished.json` (a relaunch with the same schedule
    then does nothing), the TensorBoard hint, the logger closed, run_dir's lease given back, the process group
    closed."""
    if run.dist.is_main:  # the checkpoint a relaunch judges by (core/launch/rundir.py), `latest`'s unless torn
        mark_finished(run.run_dir, run.state.step, choose_resume(run.run_dir / "checkpoints")[0])
    run.logger.console(f"[mimpipe] TensorBoard: tensorboard --logdir {run.run_dir / 'tb'}")
    if run.synthetic_data:
        run.logger.console(f"[mimpipe] this run trained on {SYNTHETIC_WARNING}")
    run.logger.close()
    if run.lease is not None:
        run.lease.release()  # a relaunch may start at once: it finds the run finished
    shutdown()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def prepare_run_dir(cfg: Config, dist: DistInfo) -> tuple[Path, str]:
    """Create run_dir and keep this launch's resolved config (rank 0): run_dir/config.yaml for the first launch,
    configs/launch_NNNN.yaml for each later one (`keep_launch_config`)."""
    run_dir = Path(cfg.run_dir)
    config_yaml = dump_config(cfg)
    if dist.is_main:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        keep_launch_config(run_dir, config_yaml)
    return run_dir, config_yaml
