"""Weights & Biases as a second sink of `MetricsLogger` (core/report/logging.py), on rank 0 only: the scalars, images,
histograms and the run's settings that go to TensorBoard go to one W&B run too (`logging.wandb`, docs/logging.md).

One run_dir is one W&B run: its id is written to `run_dir/wandb_id` at the first launch, and every later launch in
that run_dir (a resume, a relaunch) continues the run with that id. Offline (the default) each launch writes its own
`wandb/offline-run-*` folder under that id; `wandb sync` uploads them into the one run.

Each step is logged once. W&B cannot take back what it was given (TensorBoard's `purge_step` has no W&B
counterpart outside its `resume_from` beta, which needs the run on the server), so the first values a step got are
the ones kept: a resumed run, or one rolled back, sends W&B nothing up to the last step that W&B already holds (the
last step of metrics.jsonl before it is cut back to the checkpoint), and logs from the step after it."""

from __future__ import annotations

import json
import secrets
import string
from pathlib import Path

import numpy as np
import torch

from core.recipe.config import WANDB_INSTALL, WandbConfig

ID_FILE = "wandb_id"
"""The W&B run id of a run_dir, kept there so that every launch in it continues the one run."""


class WandbSink:
    """One W&B run, fed by `MetricsLogger` with monotonic steps; steps up to `done_through` are not sent.

    Args:
        cfg: The recipe's `logging.wandb` section.
        run_dir: The run's folder: the id file, and W&B's folder unless `cfg.dir` says otherwise.
        done_through: The last step the W&B run already holds (a resumed run's), -1 for none.
    """

    def __init__(self, cfg: WandbConfig, run_dir: Path, *, done_through: int = -1):
        try:
            import wandb
        except ImportError as exn:
            raise ImportError(f"logging.wandb.enabled needs wandb, which is not installed: {WANDB_INSTALL}") from exn
        self._wandb = wandb
        directory = Path(cfg.dir) if cfg.dir else run_dir
        for folder in (run_dir, directory):
            folder.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name or run_dir.resolve().name,
            dir=str(directory),
            mode=cfg.mode,
            id=run_id(run_dir),
            resume="allow",  # the first launch creates the run, later ones continue it
        )
        self._done_through = done_through
        self._last_step = done_through  # W&B takes steps in order: none below the last one sent

    def rewind(self) -> None:
        """The steps after a rollback's checkpoint are trained again: W&B keeps the values it already has."""
        self._done_through = self._last_step

    def log(self, step: int, values: dict) -> None:
        """Send `values` (scalars, or media made by `image` / `histogram`) at `step`, unless W&B holds it already."""
        if step <= self._done_through or step < self._last_step:
            return
        self._run.log(values, step=step)
        self._last_step = step

    def image(self, image: torch.Tensor):
        """`image`: (3, H, W) float in [0, 1] -> a W&B image of 8-bit (H, W, 3) pixels, as TensorBoard stores it."""
        pixels = (image.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8)
        return self._wandb.Image(pixels.permute(1, 2, 0).numpy())

    def histogram(self, counts: torch.Tensor):
        """`counts[i]` samples of value i -> a W&B histogram with buckets (i - 0.5, i + 0.5], one per value, or per
        run of `width` values where there are more values than W&B's bucket limit (a large codebook)."""
        counts = counts.detach().double().cpu().numpy()
        width = -(-len(counts) // self._wandb.Histogram.MAX_LENGTH)
        padded = np.pad(counts, (0, -len(counts) % width))
        edges = np.arange(0, len(padded) + 1, width, dtype=np.float64) - 0.5
        return self._wandb.Histogram(np_histogram=(padded.reshape(-1, width).sum(1), edges))

    def config(self, config: dict) -> None:
        """The run's settings, as W&B's run config (compared across runs in its table)."""
        self._run.config.update(config, allow_val_change=True)

    def close(self) -> None:
        self._run.finish()


def run_id(run_dir: Path) -> str:
    """The W&B run id kept in `run_dir/wandb_id`, made and written there at the first call (8 random lowercase
    letters and digits, as W&B makes its own)."""
    path = run_dir / ID_FILE
    if path.is_file():
        return path.read_text().strip()
    new = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    path.write_text(new + "\n")
    return new


def last_logged_step(metrics: Path) -> int:
    """The highest step in metrics.jsonl (-1 for none): what a resumed run's W&B run holds already, since the same
    scalars went to both (lines that are not JSON, cut short by a kill, are passed over)."""
    last = -1
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                last = max(last, int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue
    return last
