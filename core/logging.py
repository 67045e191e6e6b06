"""Rank-0 run logging: TensorBoard under `run_dir/tb`, the same scalars in `run_dir/metrics.jsonl`, and console
progress. Every other rank gets a logger whose methods do nothing, so call sites need no rank checks."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


class MetricsLogger:
    """Writes scalars, images and text for one run; inert unless `enabled` (rank 0)."""

    def __init__(self, run_dir: Path, *, enabled: bool, tensorboard: bool = True, total_steps: int = 0):
        self.enabled = enabled
        self.total_steps = total_steps
        self._writer = None
        self._jsonl = None
        self._start = time.perf_counter()
        self._start_step = 0
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(run_dir / "metrics.jsonl", "a")  # noqa: SIM115  (closed in close())
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(run_dir / "tb"))

    def mark_start(self, step: int) -> None:
        """Restart the ETA clock (after resume, or after the first step's warm-up)."""
        self._start, self._start_step = time.perf_counter(), step

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        for name, value in values.items():
            if self._writer is not None:
                self._writer.add_scalar(name, value, step)
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), **values}) + "\n")
        self._jsonl.flush()

    def image(self, tag: str, step: int, image: torch.Tensor) -> None:
        """`image`: (3, H, W) float in [0, 1]."""
        if self.enabled and self._writer is not None:
            self._writer.add_image(tag, image.clamp(0, 1), step)

    def text(self, tag: str, step: int, text: str) -> None:
        if self.enabled and self._writer is not None:
            self._writer.add_text(tag, f"```\n{text}\n```", step)

    def console(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)

    def progress(self, step: int, values: dict[str, float]) -> None:
        """One console line: step, loss, throughput and ETA."""
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self._start
        done = max(1, step - self._start_step)
        eta = elapsed / done * (self.total_steps - step)
        shown = "  ".join(f"{k.split('/')[-1]} {v:.4g}" for k, v in values.items() if k in _CONSOLE_KEYS)
        width = len(str(self.total_steps))
        print(f"step {step:>{width}}/{self.total_steps}  {shown}  eta {_clock(eta)}", file=sys.stdout, flush=True)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._jsonl is not None:
            self._jsonl.close()


_CONSOLE_KEYS = (
    "train/loss",
    "train/lr",
    "perf/images_per_sec",
    "train/acc1",
    "train/mlm_acc",
    "train/codes_used",
    "train/skipped_steps",
)


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
