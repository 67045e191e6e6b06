"""Worker for test_data2vec2_dist.py (run under torchrun): the pretraining stage's start, as pretrain/stage.py runs it
(`start_stage`, then `start_engine` with the warm start), on a run_dir whose latest checkpoint was written at another
world size; then the EMA teacher its next forward would see: every teacher parameter as ZeRO-3 gathers it (one it
keeps gathered is used as it is), against the value the checkpoint saved. Rank 0 writes OUT (JSON): per rank, the
teacher parameters that were kept gathered and those that differ from the checkpoint.

Usage: data2vec2_resume_worker.py OUT RECIPE [overrides]"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import deepspeed
import torch

from core.compat.deepspeed import is_released
from core.engine.distributed import shutdown
from core.engine.gather import saved_frozen
from core.engine.run import seed_everything, start_engine, start_stage
from pretrain.objectives import objective_builder
from pretrain.warm_start import warm_starter


def main(out: Path, argv: list[str]) -> None:
    run = start_stage("data2vec2_resume_worker.py", argv)
    seed_everything(run.cfg.seed)
    engine, _ = start_engine(run, objective_builder(run.cfg), after_build=warm_starter(run))
    saved = saved_frozen(run.run_dir / "checkpoints" / run.resume["tag"])
    teacher = dict(engine.module.teacher.encoder.named_parameters())
    kept = sorted(name for name, p in teacher.items() if not is_released(p))
    with deepspeed.zero.GatheredParameters(list(teacher.values())):
        differ = [
            name
            for name, p in teacher.items()
            if not torch.equal(p.data, saved[f"teacher.encoder.{name}"]().view_as(p))
        ]
    per_rank = [None] * run.dist.world_size
    torch.distributed.all_gather_object(per_rank, {"kept_gathered": kept, "differ": differ})
    if run.dist.is_main:
        out.write_text(json.dumps(per_rank))
    run.logger.close()
    if run.lease is not None:
        run.lease.release()
    shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
