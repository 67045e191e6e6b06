"""What the ranks agree on at every optimizer step, kept on the device, and read by the host every few steps.

A host read (`.item()`, `.tolist()`) waits until the device has run everything queued before it, so a read on every
step leaves a GPU idle while the host queues the next step's work. The decisions that must be taken at every step
stay on the device: whether any rank's loss was non-finite is an all-reduced 0-d tensor, which the fused optimizer
takes as its `found_inf` to skip the update (core/engine/setup.py `Guarded`, which also skips it for non-finite
gradients under a finite loss), and the streak counters follow both on the device. What the host must know
(whether a rank was asked to stop, whether the streak is too long to go on) is read together in one all-reduce and
one `.tolist()`, at steps every rank picks alike (core/engine/loop.py: logging, checkpoint and last steps, and every
`engine.sync_every_steps`); the loss-spike watch (core/engine/rollback.py) reads its values at the same steps.
"""

from __future__ import annotations

import torch

from core.engine import preempt
from core.engine.distributed import all_reduce
from core.engine.train_state import TrainState


class StepAgreement:
    """The non-finite veto of every step, and the counters the host reads back every few steps."""

    def __init__(self, device: torch.device, state: TrainState):
        self.device = device
        self.skipped = torch.zeros((), device=device)
        """Steps skipped for a non-finite loss or non-finite gradients since the last read."""
        self.streak = torch.tensor(float(state.consecutive_nonfinite), device=device)
        """Non-finite steps in a row up to now (carried over from a resumed checkpoint)."""
        self.longest = self.streak.clone()
        """The longest streak since the last read: one that ended between two reads still stops the run."""

    def nonfinite_loss(self, step_loss: torch.Tensor) -> torch.Tensor:
        """Whether any rank's `step_loss` (a 0-d tensor) is non-finite: 1.0 or 0.0, the same on every rank, left on
        the device (no host sync; one all-reduce of one value). The optimizer skips the update on it."""
        return all_reduce((~torch.isfinite(step_loss)).float(), op="max")

    def record(self, bad_loss: torch.Tensor, optimizer, precision: str) -> torch.Tensor:
        """Count the step just taken in the skipped steps and the streak when its loss or its gradients were
        non-finite (`optimizer`: the Guarded one, which checked the gradients on every rank); returns that flag.

        fp16: DeepSpeed's optimizer skips an overflow itself (a normal event of loss scaling, not counted); else an
        optimizer never called inside the step means DeepSpeed skipped it for a non-finite gradient norm it
        computed to clip.
        """
        if precision == "fp16":
            bad = bad_loss
        elif optimizer.nonfinite is None:
            bad = torch.ones((), device=self.device)
        else:
            bad = torch.maximum(bad_loss, optimizer.nonfinite)
        self.skipped += bad
        self.streak = (self.streak + 1.0) * bad  # a finite step ends the streak
        self.longest = torch.maximum(self.longest, self.streak)
        return bad

    def read(self, state: TrainState) -> tuple[int, bool]:
        """Move the counters into `state` (`nonfinite_skipped`, `consecutive_nonfinite`) and agree whether any rank
        was asked to stop. Every rank must call it at the same step (it runs an all-reduce).

        Returns:
            (the longest streak of non-finite steps since the last read, whether some rank received SIGTERM), the
            same on every rank.
        """
        stop = all_reduce(torch.tensor(float(preempt.stop_requested()), device=self.device), op="max")
        values = torch.stack([self.skipped, self.streak, self.longest, stop]).tolist()  # the one host sync
        skipped, streak, longest, stop = (int(v) for v in values)
        self.skipped.zero_()
        self.longest.copy_(self.streak)
        state.nonfinite_skipped += skipped
        state.consecutive_nonfinite = streak
        return longest, stop > 0
