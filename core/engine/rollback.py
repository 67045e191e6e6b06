"""Loss-spike recovery: when the loss or the gradient norm of a step jumps past `engine.spike_factor` times its
running median, every rank goes back to the last good checkpoint and trains on from there with the data that comes
next.

Nothing is read on the host per step: each step's loss (this rank's) and squared gradient norm (global: see
setup.py `Guarded`) stay on the device until the loop's next read step (core/engine/agreement.py), where one
all-reduce averages the losses over the ranks and one `.tolist()` brings them back. Every rank then holds the same
values and the same history, so every rank takes the same decision without another collective. A read step that is
also a checkpoint step checks before saving: a spike is never checkpointed.

A rollback loads model and optimizer of the checkpoint `latest` names (or the newest complete one, as a resume
would); the step, and with it the learning-rate schedule, continue from the checkpoint's step. The data stream is
not rewound: the batches that led to the spike are skipped, and `TrainState`'s data position and counters keep their
live values. After `engine.max_rollbacks` rollbacks the next spike stops the run.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

import torch

from core.engine.checkpoint import best_checkpoint
from core.engine.distributed import all_reduce
from core.engine.stage import StageRun
from core.launch.ckpt_files import step_of

WATCHED = ("train/loss", "train/grad_norm")


class TooManyRollbacksError(RuntimeError):
    """A loss spike after `engine.max_rollbacks` rollbacks."""


def is_spike(history: deque[float], value: float, factor: float) -> bool:
    """Whether `value` is past `factor` times the median of a full `history` (a history still filling up judges
    nothing: the first `engine.spike_window` steps of a run are never a spike)."""
    return len(history) == history.maxlen and value > factor * statistics.median(history)


class SpikeWatch:
    """The per-step values on the device, and on the host the history each new value is judged against."""

    def __init__(self, factor: float, window: int, device: torch.device):
        self.factor = factor
        self.device = device
        self.pending: list[tuple[int, torch.Tensor]] = []
        """(step, [this rank's loss, the global squared gradient norm]) of the steps since the last read."""
        self.history = {name: deque(maxlen=window) for name in WATCHED}

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    def record(self, step: int, loss: torch.Tensor, grad_sq_norm: torch.Tensor | None) -> None:
        """Keep one step's values on the device (no host sync). `grad_sq_norm` None: DeepSpeed stepped without the
        optimizer (an fp16 overflow), so there is no norm to judge."""
        if not self.enabled:
            return
        sq_norm = torch.full((), math.nan, device=self.device) if grad_sq_norm is None else grad_sq_norm.float()
        self.pending.append((step, torch.stack([loss.detach().float(), sq_norm])))

    def check(self, world_size: int) -> str | None:
        """At a read step, on every rank alike (one all-reduce): the first spike among the steps since the last
        read, as a console fragment, else None. Finite values that are no spike join the history; a non-finite
        one is the non-finite guard's (agreement.py), not a spike."""
        if not self.pending:
            return None
        steps = [step for step, _ in self.pending]
        values = torch.stack([v for _, v in self.pending])  # (S, 2)
        self.pending = []
        values[:, 0] = all_reduce(values[:, 0].contiguous()) / world_size
        for step, (loss, sq_norm) in zip(steps, values.tolist(), strict=True):
            norm = math.sqrt(sq_norm) if sq_norm >= 0 else math.nan
            for name, value in zip(WATCHED, (loss, norm), strict=True):
                if not math.isfinite(value):
                    continue
                history = self.history[name]
                if self.enabled and is_spike(history, value, self.factor):
                    median = statistics.median(history)
                    return f"{name} {value:.4g} at step {step} > {self.factor:g} x its running median {median:.4g}"
                history.append(value)
        return None


def roll_back(run: StageRun, engine, step: int, spike: str) -> bool:
    """Go back to the last good checkpoint after `spike`, seen at the read of `step` (every rank alike).

    Returns:
        False when there is no checkpoint to go back to yet (the run goes on, said on the console).

    Raises:
        TooManyRollbacksError: When `engine.max_rollbacks` rollbacks were made already.
    """
    cfg, state = run.cfg, run.state
    tag = best_checkpoint(run.run_dir, run.dist)
    if tag is None:
        run.logger.console(f"[mimpipe] warning: {spike}, but there is no checkpoint to roll back to yet; going on")
        return False
    if state.rollbacks >= cfg.engine.max_rollbacks:
        raise TooManyRollbacksError(
            f"stopping: {spike}, after {state.rollbacks} rollbacks (engine.max_rollbacks={cfg.engine.max_rollbacks}); "
            f"the last good checkpoint is {tag}. Lower optim.base_lr or check the data."
        )
    resume = run.resume if run.resume is not None and run.resume["tag"] == tag else None
    load_tag = tag if resume is None else resume["load_tag"]  # a checkpoint of another world size: its universal one
    path, _ = engine.load_checkpoint(
        str(run.run_dir / "checkpoints"), tag=load_tag, load_optimizer_states=True, load_lr_scheduler_states=False
    )
    if path is None:
        raise ValueError(f"could not load checkpoint {run.run_dir / 'checkpoints' / load_tag} to roll back to")
    state.step = step_of(tag)
    state.consecutive_nonfinite = 0
    state.rollbacks += 1
    run.logger.rewind(state.step)  # the steps after the checkpoint are trained again: each is logged once
    run.logger.console(
        f"[mimpipe] loss spike: {spike}; rolled back from step {step} to checkpoint {tag} (rollback "
        f"{state.rollbacks} of at most {cfg.engine.max_rollbacks}); training goes on with the data after the spike"
    )
    return True
