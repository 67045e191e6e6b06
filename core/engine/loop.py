"""The one training loop, shared by pretraining and fine-tuning.

Per optimizer step: set the lr, run `grad_accum_steps` micro-steps (forward, under the engine's own autocast for bf16;
backward), check on the device that the loss is finite on every rank, step (a step whose loss or gradients are
non-finite is skipped on the device), then log / evaluate / checkpoint every N steps (a checkpoint step inside a
non-finite streak is saved at the next read step after it).

Host syncs: none on an ordinary step. The host reads values back only on logging steps and every
`engine.sync_every_steps` (see core/engine/agreement.py): the ranks then agree whether one was asked to stop (SIGTERM
or Ctrl-C, see core/engine/preempt.py), how long the non-finite streak is, and whether a step's loss or gradient norm
spiked (core/engine/rollback.py: the loop then goes back to the last good checkpoint's step).
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from core.compat.deepspeed import loss_scale, scales_loss_itself, skipped_steps
from core.engine import preempt
from core.engine.agreement import StepAgreement
from core.engine.checkpoint import RNGState, SaveOutcome, save_checkpoint
from core.engine.compiled import compile_cache_report, compile_seconds
from core.engine.distributed import all_reduce
from core.engine.precision import to_device
from core.engine.rollback import SpikeWatch, roll_back
from core.engine.schedule import lr_at, weight_decay_at
from core.engine.stage import StageRun
from core.engine.stream import num_train_shards
from core.engine.train_state import TrainState
from core.engine.utilisation import start_meter
from core.recipe.config import Config


class NonFiniteLossError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss."""


class PreemptedError(RuntimeError):
    """A rank received SIGTERM or Ctrl-C: every rank stopped after the same step and saved a checkpoint of it; `code`
    is the exit code, the same on every rank (`preempt.EXIT_INTERRUPTED` when any rank received Ctrl-C, else
    `preempt.EXIT_PREEMPTED`)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def _max_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _grad_norm(engine, optimizer) -> float | None:
    """Global gradient norm of the step just taken (before clipping).

    With clipping DeepSpeed computed it; otherwise it is the squared norm the Guarded optimizer measured (summed over
    the ranks' partitions under ZeRO-1/2/3; the same full replica on every rank under ZeRO-0).
    """
    norm = engine.get_global_grad_norm()
    if norm is not None and engine.gradient_clipping() > 0:
        return float(norm.item() if isinstance(norm, torch.Tensor) else norm)
    sq_norm = optimizer.grad_sq_norm
    return None if sq_norm is None else float(sq_norm.float().sqrt())


@dataclass
class LoopHooks:
    """What a stage adds to the loop, each called with the step number."""

    evaluate: Callable[[int], dict[str, float]] | None = None
    """Every `eval.every_steps` and at the last step; returns the scalars to log."""
    log_images: Callable[[int], None] | None = None
    """Every `logging.image_every_steps`, and at the first and last step."""
    after_update: Callable[[int, torch.Tensor], None] | None = None
    """After every optimizer step, with a 0-d device tensor that is 1.0 where the update was applied and 0.0 where it
    was skipped (non-finite): e.g. an EMA of the weights that follows applied updates only, without a host sync."""


def train(run: StageRun, engine, optimizer, batches: Iterator[dict], hooks: LoopHooks) -> TrainState:
    """Run optimizer steps `run.state.step + 1 .. run.total_steps`; returns the final state (also checkpointed).

    Args:
        run: The stage: config, ranks, run_dir, schedule length, train state (updated in place) and logger.
        engine: The DeepSpeed engine.
        optimizer: The Guarded optimizer it steps.
        batches: The endless per-rank stream of micro-batches.
        hooks: What the stage adds (evaluation, pictures, an EMA).

    Raises:
        NonFiniteLossError: After `engine.max_consecutive_nonfinite` non-finite steps in a row.
        TooManyRollbacksError: At a loss spike after `engine.max_rollbacks` rollbacks (core/engine/rollback.py).
        PreemptedError: After the step during which some rank received SIGTERM or Ctrl-C, once its checkpoint is
            saved.
    """
    cfg, dist, state, logger = run.cfg, run.dist, run.state, run.logger
    total_steps, warmup_steps = run.total_steps, run.warmup_steps
    accum, precision, device = cfg.engine.grad_accum_steps, cfg.engine.precision, dist.device
    micro_batch = cfg.batch_size_per_device(dist.world_size)
    window = _Window(device)
    agreement = StepAgreement(device, state)
    watch = SpikeWatch(cfg.engine.spike_factor, cfg.engine.spike_window, device)
    scale_loss = scales_loss_itself(engine)
    first_step = step = state.step + 1
    save_due = False  # a checkpoint step deferred by a non-finite streak: saved at the next read step without one
    meter = first_batch = None  # the FLOPs are counted after the first step, on its first micro-batch (start_meter)
    first = _FirstStep.begin()  # None after the first step of this launch
    while step <= total_steps:
        o = cfg.optim
        lr = lr_at(
            step, peak_lr=cfg.peak_lr, min_lr=o.min_lr, warmup_steps=warmup_steps, total_steps=total_steps,
            start_lr=o.start_lr,
        )  # fmt: skip
        wd = weight_decay_at(step, start=o.weight_decay, end=o.weight_decay_end, total_steps=total_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
            group["weight_decay"] = wd * group.get("wd_scale", 1.0)
        log_now = step % cfg.logging.every_steps == 0 or step == total_steps
        save_now = step % cfg.checkpoint.every_steps == 0 or step == total_steps
        read_now = log_now or save_now or step % cfg.engine.sync_every_steps == 0
        step_loss = torch.zeros((), device=device)
        for micro in range(accum):
            t0 = time.perf_counter()
            batch = next(batches)
            window.data_wait += time.perf_counter() - t0
            if first_batch is None:
                first_batch = batch
            state.consume(batch)
            inputs = to_device(batch, device, precision)  # first: it counts a JPEG the device cannot decode
            window.corrupt += batch["num_corrupt"]
            window.shard_reads += batch["num_shard_reads"]
            window.skipped_shards += batch["num_skipped_shards"]
            out = engine(inputs)  # bf16: the engine's autocast (setup.py)
            engine.backward(out["loss"] * loss_scale(engine) if scale_loss else out["loss"])
            step_loss += out["loss"].detach().float()
            window.add_scalars(out)
            if micro < accum - 1:
                engine.step()  # DeepSpeed only accumulates here; the optimizer runs at the boundary below
                continue
            bad_loss = agreement.nonfinite_loss(step_loss)  # (), 1.0 on every rank if any rank's loss was non-finite
            # DeepSpeed's fp16 optimizer already skips overflowing steps itself
            with optimizer.guard(skip=False if precision == "fp16" else bad_loss):
                engine.step()
            bad = agreement.record(bad_loss, optimizer, precision)  # the loss's or the gradients' veto
            if hooks.after_update is not None:
                hooks.after_update(step, 1.0 - bad)  # e.g. the EMA of the weights follows the update just applied
        watch.record(step, step_loss / accum, optimizer.grad_sq_norm)
        stop = read_now and _read_agreement(agreement, state, cfg, step)
        spike = watch.check(dist.world_size) if read_now else None
        if spike is not None and roll_back(run, engine, step, spike):  # before this step is logged or saved
            if stop:
                raise _preempted(step, total_steps, f"rolled back to step {state.step} after {spike}", device)
            window.drop_steps()
            step = state.step + 1
            continue
        log_now = log_now or stop  # the last step before a preemption is logged too
        window.add_step(step_loss / accum, micro_batch * accum * dist.world_size)
        if first is not None:
            logger.console(first.end(window, excluded=not log_now))
            counting = time.perf_counter()  # counted now, not before: training need not wait, only the first log
            meter = start_meter(run, engine.module, first_batch)
            window.start += time.perf_counter() - counting  # no part of the throughput
        if log_now:
            _log(run, window, meter, step, lr=lr, engine=engine, optimizer=optimizer)
        if not stop:  # a preempted run has seconds left (torchrun's and SLURM's grace): only the checkpoint counts
            extras_start = time.perf_counter()
            stop = _periodic_extras(cfg, step, first_step, total_steps, logger, hooks, device)
            window.start += time.perf_counter() - extras_start  # pictures and evaluation are not training throughput
        state.step = step
        save_due, saved = save_due or save_now, None
        if stop or (save_due and read_now):
            saved = _save_unless_nonfinite(run, engine, step, preempted=stop)
            save_due = saved is None  # deferred; a save that failed (a full disk) waits for the next checkpoint step
            if saved is not None:
                stop = stop or _anyone_stopping(device)  # a SIGTERM during the save: this checkpoint is the one
        if stop:
            where = f"with checkpoint {saved.tag_dir}" if saved is not None and saved.tag_dir is not None else None
            raise _preempted(step, total_steps, where, device)
        if first is not None:
            logger.mark_start(step)  # keep the first step's one-off set-up cost out of the ETA
            first = None
        step += 1
    return state


def _save_unless_nonfinite(run: StageRun, engine, step: int, *, preempted: bool) -> SaveOutcome | None:
    """The checkpoint of `step` (its outcome: saved, or skipped or failed, said on the console), unless the step is
    part of a non-finite streak: then None, deferred to the next read step without one (a preemption saves all the
    same: the skipped updates left the weights finite)."""
    if run.state.consecutive_nonfinite and not preempted:
        run.logger.console(
            f"[mimpipe] checkpoint of step {step} deferred: {run.state.consecutive_nonfinite} non-finite step(s) in a "
            "row up to it; it is saved at the next read step with a finite one"
        )
        return None
    saved = save_checkpoint(
        engine,
        run_dir=run.run_dir,
        step=step,
        dist=run.dist,
        states={"train": run.state, "rng": RNGState()},
        config_yaml=run.config_yaml,
        keep_last=run.cfg.checkpoint.keep_last,
    )
    if saved.note is not None:
        run.logger.console(saved.note)
    return saved


def _preempted(step: int, total_steps: int, checkpoint: str | None, device: torch.device) -> PreemptedError:
    """The stop after `step`, Ctrl-C's if any rank received one (one all-reduce: every rank stops at this same step),
    else SIGTERM's."""
    where = checkpoint or "without a new checkpoint (see the line above); checkpoints/latest names the last one"
    resume = "launch the same command again to resume from it"
    ctrl_c = all_reduce(torch.tensor(float(preempt.ctrl_c_received()), device=device), op="max")
    if ctrl_c.item():
        message = f"stopped by Ctrl-C after step {step} of {total_steps} {where}; {resume}"
        return PreemptedError(message, preempt.EXIT_INTERRUPTED)
    message = f"preempted: SIGTERM received, stopped after step {step} of {total_steps} {where}; {resume}"
    return PreemptedError(message, preempt.EXIT_PREEMPTED)


def _log(run: StageRun, window: _Window, meter, step: int, *, lr: float, engine, optimizer) -> None:
    """Flush the window's scalars to the metrics and the console."""
    cfg = run.cfg
    grad_norm = _grad_norm(engine, optimizer)
    values = window.flush(lr=lr, grad_norm=grad_norm, engine=engine, precision=cfg.engine.precision, state=run.state)
    if meter is not None:
        raised = meter.check_peak(values["perf/images_per_sec"])  # a CPU peak measured low: measured again
        if raised is not None:
            run.logger.console(raised)
        values["perf/mfu"] = meter.mfu(values["perf/images_per_sec"])
    if cfg.engine.spike_factor > 0:
        values["train/rollbacks"] = float(run.state.rollbacks)
    run.logger.scalars(step, values)
    run.logger.progress(step, values)
    state = run.state
    if run.dist.is_main and state.skipped_shards:  # the same sums on every rank: one raises, the one error line
        num_skipped, num_reads = state.skipped_shards, state.shard_reads
        cfg.data.read_policy().check_skipped(num_skipped, num_reads, num_train_shards(cfg), "over all ranks")


def _periodic_extras(
    cfg: Config, step: int, first_step: int, total_steps: int, logger, hooks: LoopHooks, device: torch.device
) -> bool:
    """Pictures every `logging.image_every_steps` (and at the first and last step), evaluation every
    `cfg.eval_every_steps` and at the last step. Both run before the step's checkpoint, so that it holds what the
    evaluation changed (the best score of a fine-tuning run).

    Returns:
        Whether to stop after this step, the same on every rank: an evaluation cut short by a SIGTERM or Ctrl-C
        (`preempt.StopAgreed`, nothing of it logged), or one that arrived while the extras ran.
    """
    image_every = cfg.logging.image_every_steps
    pictures = (
        hooks.log_images is not None and image_every and (step % image_every == 0 or step in (first_step, total_steps))
    )
    every = cfg.eval_every_steps
    evaluation = hooks.evaluate is not None and (step == total_steps or (every and step % every == 0))
    try:
        if pictures:
            hooks.log_images(step)
        if evaluation:
            logger.scalars(step, hooks.evaluate(step))
    except preempt.StopAgreed:
        return True
    return bool(pictures or evaluation) and _anyone_stopping(device)


def _anyone_stopping(device: torch.device) -> bool:
    """Whether some rank received SIGTERM or Ctrl-C, the same on every rank (one all-reduce and a host read: only after
    the rare steps with pictures, an evaluation or a save, so that the run stops with them instead of steps later)."""
    return bool(all_reduce(torch.tensor(float(preempt.stop_requested()), device=device), op="max").item())


def _read_agreement(agreement: StepAgreement, state: TrainState, cfg: Config, step: int) -> bool:
    """The host read of what the ranks agree on (see StepAgreement.read); raises after too many non-finite steps.

    Returns:
        Whether to stop after this step (some rank was asked to), the same on every rank.
    """
    longest, stop = agreement.read(state)
    if longest >= cfg.engine.max_consecutive_nonfinite:
        raise NonFiniteLossError(
            f"stopping at step {step}: the loss was non-finite for {longest} steps in a row "
            f"(engine.max_consecutive_nonfinite={cfg.engine.max_consecutive_nonfinite}); no update was applied for "
            f"them and the last checkpoint in checkpoints/latest is intact. Lower optim.base_lr or check the data."
        )
    return stop


@dataclass
class _FirstStep:
    """The first step's wall time and the compile time in it (torch.compile's, with `engine.compile`): one-off
    costs, reported once and kept out of the throughput (perf/images_per_sec, perf/mfu)."""

    start: float
    compile_start: float

    @classmethod
    def begin(cls) -> _FirstStep:
        return cls(time.perf_counter(), compile_seconds())

    def end(self, window: _Window, *, excluded: bool) -> str:
        """The launch-log line; with `excluded`, the throughput of `window` starts after this step (when the first
        step is itself a logging step, its window is already flushed, with the step in it)."""
        seconds = time.perf_counter() - self.start
        compiling = compile_seconds() - self.compile_start
        if excluded:  # the window holds this step alone: its time (and the set-up before it) starts afresh
            window.start, window.samples, window.data_wait = time.perf_counter(), 0, 0.0
        part = f", {compiling:.1f} s of it torch.compile ({compile_cache_report()})" if compiling else ""
        kept = "excluded from" if excluded else "included in"
        return f"[mimpipe] first step: {seconds:.1f} s{part}; {kept} perf/images_per_sec and perf/mfu"


class _Window:
    """Accumulates what is logged every `logging.every_steps`, as device tensors until the flush."""

    def __init__(self, device: torch.device):
        self.device = device
        self._reset()

    def _reset(self) -> None:
        self.loss = torch.zeros((), device=self.device)
        self.extra: dict[str, torch.Tensor] = {}
        self.steps = self.micro_steps = self.samples = 0
        self.data_wait = 0.0
        self.corrupt = torch.zeros((), dtype=torch.int64)
        self.shard_reads = torch.zeros((), dtype=torch.int64)
        self.skipped_shards = torch.zeros((), dtype=torch.int64)
        self.start = time.perf_counter()

    def drop_steps(self) -> None:
        """Forget the losses and scalars of the steps a rollback undid (the samples and time still count: they were
        trained on)."""
        self.loss = torch.zeros((), device=self.device)
        self.extra = {}
        self.steps = self.micro_steps = 0

    def add_scalars(self, out: dict) -> None:
        self.micro_steps += 1
        for key, value in out.items():
            if key != "loss" and isinstance(value, torch.Tensor) and value.dim() == 0:
                self.extra[key] = self.extra.get(key, 0) + value.detach().float()

    def add_step(self, loss: torch.Tensor, samples: int) -> None:
        self.loss += loss
        self.steps += 1
        self.samples += samples

    def flush(self, *, lr, grad_norm, engine, precision, state: TrainState) -> dict[str, float]:
        elapsed = time.perf_counter() - self.start
        names = ["train/loss", *(f"train/{k}" for k in self.extra)]
        means = torch.stack([self.loss / self.steps, *(v / self.micro_steps for v in self.extra.values())])
        world = torch.distributed.get_world_size()
        means = all_reduce(means.float()) / world
        counts = torch.stack([self.corrupt, self.shard_reads, self.skipped_shards]).to(self.device)
        corrupt, shard_reads, skipped_shards = all_reduce(counts).tolist()
        state.corrupt_samples += corrupt
        state.shard_reads += shard_reads
        state.skipped_shards += skipped_shards
        values = dict(zip(names, means.tolist(), strict=True))
        values["train/lr"] = lr
        if grad_norm is not None:
            values["train/grad_norm"] = grad_norm
        if precision == "fp16":
            values["train/loss_scale"] = float(loss_scale(engine))
            values["train/skipped_steps"] = float(skipped_steps(engine))
        else:
            values["train/skipped_steps"] = float(state.nonfinite_skipped)
        values["perf/images_per_sec"] = self.samples / elapsed
        values["perf/data_wait_fraction"] = self.data_wait / elapsed
        values["perf/max_memory_gb"] = _max_memory_gb(self.device)
        values["data/corrupt_samples"] = float(state.corrupt_samples)
        values["data/skipped_shards"] = float(state.skipped_shards)
        self._reset()
        return values
