"""`StageRun`: what a stage holds from its start (core/engine/run.py) to its end, and what the loop, the data stream,
the rollback and the utilisation meter read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from core.engine.distributed import DistInfo
from core.engine.train_state import TrainState
from core.launch.lease import HeldLease
from core.recipe.config import Config
from core.report.logging import MetricsLogger


@dataclass
class StageRun:
    """Everything a stage entry point holds between its sections, and what the loop runs on."""

    cfg: Config
    recipe: str
    dist: DistInfo
    run_dir: Path
    config_yaml: str
    """The resolved config as run_dir/config.yaml holds it; every checkpoint saves it too."""
    samples: int | None
    total_steps: int
    warmup_steps: int
    resume: dict | None
    state: TrainState
    logger: MetricsLogger
    peak: tuple[float | None, str] | None = None
    """perf/mfu's peak TFLOP/s of one device and where it came from (`device_peak`), found by `start_stage` before the
    data workers start, which would take CPU from a matmul measured while they fill their first batches; None: the
    loop finds it."""
    precision_reason: str = ""
    """Why the run uses `cfg.engine.precision` (`core.launch.precision.PrecisionChoice.reason`), for the plan line."""
    synthetic_data: bool = False
    """data.train holds synthetic images (its index.json says so): the plan, TensorBoard and the stage's end say that
    the numbers mean nothing."""
    lease: HeldLease | None = None
    """Rank 0's lease on run_dir (core/launch/lease.py), given back when the stage ends; None on the other ranks."""
