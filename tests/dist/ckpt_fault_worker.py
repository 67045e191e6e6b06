"""Worker for test_rollback.py and test_checkpoint_faults.py (run under torchrun, 2 ranks, ZeRO-2, fp32): the toy
objective of nonfinite_worker.py trained by the real loop for 16 steps (checkpoints every 4, reads every 2), with a
fault injected on purpose. Writes what it saw to OUT/rank_R.json.

Modes:
    spike    the batch numbered SPIKE_BATCH carries a loss 1e4 times larger on rank 1 (engine.spike_factor=20).
    stop     the same spike with engine.max_rollbacks=0, and the save of step 8 fails on rank 1 with ENOSPC midway.
    kill     rank 1 is killed (SIGKILL) midway through writing its shard of the step-8 checkpoint.
    resume   no fault: resumes from run/checkpoints as a relaunch would.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
from pathlib import Path

import torch

from core.engine.checkpoint import RNGState, find_resume, load_checkpoint, load_states
from core.engine.distributed import init_distributed
from core.engine.loop import LoopHooks, train
from core.engine.rollback import TooManyRollbacksError
from core.engine.setup import parallelize
from core.engine.stage import StageRun
from core.engine.train_state import TrainState
from core.recipe.config import dump_config, load_config
from core.report.logging import MetricsLogger
from data.pipeline import zero_counts
from tests.dist.nonfinite_worker import Toy

SPIKE_BATCH = 11  # drawn at step 11; read (and a spike seen) at step 12, a checkpoint step
STEPS = 16


def _fail_save_of_step_8(rank: int, how: str) -> None:
    """Rank `rank`'s torch.save of any file of step_00000008 writes part of it, then fails as `how` says."""
    real_save = torch.save

    def save(obj, path, *args, **kwargs):
        if "step_00000008" in str(path) and int(os.environ["RANK"]) == rank:
            Path(path).write_bytes(b"partial")
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save(obj, path, *args, **kwargs)

    torch.save = save


def main(out: Path, mode: str) -> None:
    overrides = [
        f"run_dir={out / 'run'}",
        f"schedule.steps={STEPS}",
        "engine.zero_stage=2",
        "engine.precision=fp32",
        "data.global_batch_size=4",
        "engine.sync_every_steps=2",
        "checkpoint.every_steps=4",
        "checkpoint.keep_last=5",
        "logging.every_steps=2",
        "optim.base_lr=0.01",
        "engine.spike_factor=20",
        "engine.spike_window=4",
        f"engine.max_rollbacks={0 if mode == 'stop' else 3}",
    ]
    cfg = load_config(None, overrides)
    if mode in ("stop", "kill"):
        _fail_save_of_step_8(1, "kill" if mode == "kill" else "enospc")
    dist = init_distributed("cpu")
    (out / "run").mkdir(parents=True, exist_ok=True)
    resume = find_resume(out / "run", dist.rank, dist.world_size)
    state = TrainState()
    load_states(resume, {"train": state})
    torch.manual_seed(0)
    engine, optimizer = parallelize(Toy(), cfg=cfg, dist=dist, run_dir=out)
    if resume is not None:
        load_checkpoint(engine, run_dir=out / "run", resume=resume, states={"rng": RNGState()})
    drawn: list[int] = []  # the numbers of the batches this rank drew, in order

    def batches():
        generator = torch.Generator().manual_seed(dist.rank)
        number = 0
        while True:
            number += 1
            image = torch.randn(2, 4, generator=generator)
            if number <= state.batches_consumed:
                continue  # the data position of a resumed run
            drawn.append(number)
            scale = 1e4 if number == SPIKE_BATCH and dist.rank == 1 and mode in ("spike", "stop") else 1.0
            yield {"image": image, "scale": torch.tensor(scale), "grad_nan": False, **zero_counts()}

    logger = MetricsLogger(out / "run", enabled=dist.is_main, tensorboard=False, total_steps=STEPS)
    run = StageRun(cfg, "", dist, out / "run", dump_config(cfg), None, STEPS, 0, resume, state, logger)
    try:
        train(run, engine, optimizer, batches(), LoopHooks())
        error = None
    except TooManyRollbacksError as err:
        error = str(err)
    logger.close()
    weights = [v for p in engine.module.parameters() for v in p.detach().flatten().tolist()]
    result = {"drawn": drawn, "error": error, "state": state.__dict__, "weights": weights}
    (out / f"rank_{dist.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
