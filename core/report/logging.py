"""Rank-0 run logging: TensorBoard under `run_dir/tb`, the same scalars in `run_dir/metrics.jsonl`, and console
progress, and Weights & Biases when `logging.wandb.enabled` (core/report/wandb_log.py). Every other rank gets a logger
whose methods do nothing, so call sites need no rank checks.

A resumed run logs each step once: what the interrupted run logged after the checkpoint's step is dropped from
metrics.jsonl (rewritten atomically before anything is appended) and from TensorBoard (`purge_step`: TensorBoard
discards the earlier events from that step on when it reads the new event file's start marker); W&B keeps the first
values of a step instead (see core/report/wandb_log.py)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from core.recipe.config import WandbConfig
from core.report.wandb_log import WandbSink, last_logged_step


class MetricsLogger:
    """Writes scalars, images, histograms, hparams and text for one run; inert unless `enabled` (rank 0).

    Args:
        run_dir: Where metrics.jsonl and tb/ go.
        enabled: Whether this process logs (rank 0).
        tensorboard: Also write TensorBoard events.
        total_steps: The schedule's length, for the console's ETA.
        resume_step: The step of the checkpoint a resumed run starts from: what was logged after it is dropped
            (see the module docstring). None for a fresh run.
        wandb: The recipe's `logging.wandb`; None or not `enabled`: no W&B.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        tensorboard: bool = True,
        total_steps: int = 0,
        resume_step: int | None = None,
        wandb: WandbConfig | None = None,
    ):
        self.enabled = enabled
        self.total_steps = total_steps
        self._run_dir, self._tensorboard = run_dir, tensorboard
        self._writer = None
        self._jsonl = None
        self._wandb = None
        self._start = time.perf_counter()
        self._start_step = 0
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            if wandb is not None and wandb.enabled:  # before metrics.jsonl is cut: it says what W&B holds
                held = -1 if resume_step is None else last_logged_step(run_dir / "metrics.jsonl")
                self._wandb = WandbSink(wandb, run_dir, done_through=held)
            self._open(resume_step)

    def _open(self, last_step: int | None) -> None:
        """Open metrics.jsonl and the TensorBoard writer, first dropping what was logged after `last_step` (None:
        keep everything)."""
        if last_step is not None:
            cut_metrics(self._run_dir / "metrics.jsonl", last_step)
        self._jsonl = open(self._run_dir / "metrics.jsonl", "a")  # noqa: SIM115  (closed in close())
        if self._tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if last_step is None else last_step + 1
            self._writer = SummaryWriter(log_dir=str(self._run_dir / "tb"), purge_step=purge)

    def rewind(self, step: int) -> None:
        """Drop what was logged after `step`, as a resume from it does: a rollback (core/engine/rollback.py) trains
        those steps again, and each step is logged once."""
        if self.enabled:
            self._close_files()
            self._open(step)
            if self._wandb is not None:
                self._wandb.rewind()

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
        if self._wandb is not None:
            self._wandb.log(step, values)

    def image(self, tag: str, step: int, image: torch.Tensor) -> None:
        """`image`: (3, H, W) float in [0, 1]."""
        if self.enabled and self._writer is not None:
            self._writer.add_image(tag, image.clamp(0, 1), step)
        if self._wandb is not None:
            self._wandb.log(step, {tag: self._wandb.image(image)})

    def histogram_counts(self, tag: str, step: int, counts: torch.Tensor) -> None:
        """A histogram of integer values from their counts: `counts[i]` samples of value i, one bucket per value."""
        if self._wandb is not None:
            self._wandb.log(step, {tag: self._wandb.histogram(counts)})
        if not (self.enabled and self._writer is not None):
            return
        counts = counts.detach().double().cpu()
        values = torch.arange(len(counts), dtype=torch.float64)
        used = values[counts > 0]
        self._writer.add_histogram_raw(
            tag,
            min=float(used.min()) if len(used) else 0.0,
            max=float(used.max()) if len(used) else 0.0,
            num=float(counts.sum()),
            sum=float((values * counts).sum()),
            sum_squares=float((values * values * counts).sum()),
            bucket_limits=(values + 0.5).tolist(),  # bucket i holds the values in (i - 0.5, i + 0.5]
            bucket_counts=counts.tolist(),
            global_step=step,
        )

    def hparams(self, config: dict) -> None:
        """The run's settings for TensorBoard's HPARAMS tab, which compares runs side by side.

        Writes the plugin's session-start summary (and a session end) into this run's own event file, and no
        experiment summary: TensorBoard then builds the table from every run's settings (the union of their keys, so
        an MAE run and a BEiT run with its target settings sit side by side) and offers every scalar tag as a
        metric column, showing each run's latest value, so it stays right however often the run is resumed.

        Args:
            config: The resolved config as a nested dict; logged as `flat_hparams(config)` (W&B: as it is).
        """
        if self._wandb is not None:
            self._wandb.config(config)
        if not (self.enabled and self._writer is not None):
            return
        from torch.utils.tensorboard.summary import hparams

        _, session_start, session_end = hparams(flat_hparams(config), {})  # the experiment summary is left out
        for summary in (session_start, session_end):
            self._writer.file_writer.add_summary(summary)
        self._writer.flush()

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
        self._close_files()
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None

    def _close_files(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._jsonl is not None:
            self._jsonl.close()


_CONSOLE_KEYS = (
    "train/loss",
    "train/lr",
    "perf/images_per_sec",
    "perf/mfu",
    "train/acc1",
    "train/mlm_acc",
    "train/codes_used",
    "train/skipped_steps",
)


def cut_metrics(path: Path, last_step: int) -> int:
    """Drop the lines of metrics.jsonl logged after `last_step`, atomically (a temporary file replaces it); a line
    that is not JSON (a write cut short by a kill) is dropped too. Returns how many lines were dropped."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            keep = json.loads(line)["step"] <= last_step
        except (ValueError, KeyError, TypeError):
            keep = False
        if keep:
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
    return dropped


def flat_hparams(config: dict, prefix: str = "") -> dict[str, float | int | str]:
    """A nested config as TensorBoard hparams: dotted keys, and only values the plugin accepts.

    Numbers and strings are kept, booleans become "true" / "false", None becomes "none", lists and tuples become
    their JSON text (e.g. data.mean "[0.5, 0.5, 0.5]"); nested dicts give dotted keys (optim.base_lr).
    """
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat |= flat_hparams(value, f"{name}.")
        elif isinstance(value, bool):
            flat[name] = "true" if value else "false"
        elif isinstance(value, int | float | str):
            flat[name] = value
        elif value is None:
            flat[name] = "none"
        else:
            flat[name] = json.dumps(value)
    return flat


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
