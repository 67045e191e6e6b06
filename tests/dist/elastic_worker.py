"""Worker for test_elastic_dist.py (run under torchrun). Phase `train`: 3 steps of a tiny MAE at ZeRO-2, checkpoint
at step 3. Phase `resave`: resume the run dir's `latest` at this world size (through the universal checkpoint when
the world size changed) and save it again, untouched, as step + 100; prints how long finding the resume point took
(`rank R waited S s`). `slow=T` (after the phase): collectives time out after T seconds, and DeepSpeed's converter
starts T + 5 seconds late, so that rank 0's conversion outlasts the collective timeout."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from core.compat import deepspeed as ds_compat
from core.engine.checkpoint import find_resume, load_checkpoint, save_checkpoint
from core.engine.distributed import init_distributed
from core.engine.setup import parallelize
from core.engine.train_state import TrainState
from core.recipe.config import dump_config, load_config
from pretrain.objectives import objective_builder

OVERRIDES = [
    "model.size=tiny",
    "model.embed_dim=32",
    "model.depth=2",
    "model.num_heads=2",
    "model.img_size=16",
    "model.patch_size=4",
    "objective.decoder_embed_dim=32",
    "objective.decoder_depth=1",
    "objective.decoder_num_heads=2",
    "data.global_batch_size=8",
    "engine.zero_stage=2",
    "engine.device=cpu",
    "optim.base_lr=0.01",
]


def slow_down_conversion(delay_s: int) -> None:
    """DeepSpeed's converter, started `delay_s` late: a checkpoint far larger than this one."""
    command = ds_compat.universal_command
    delayed = f'sleep {delay_s}; exec "$0" "$@"'
    ds_compat.universal_command = lambda tag_dir, out_dir: ["sh", "-c", delayed, *command(tag_dir, out_dir)]


def main(run_dir: Path, phase: str, collective_timeout_s: int | None) -> None:
    cfg = load_config(None, [*OVERRIDES, f"run_dir={run_dir}"])
    if collective_timeout_s is not None:
        slow_down_conversion(collective_timeout_s + 5)
    dist = init_distributed("cpu", timeout_s=collective_timeout_s or 600)
    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    resume = None if phase == "train" else find_resume(run_dir, dist.rank, dist.world_size)
    print(f"rank {dist.rank} waited {time.monotonic() - start:.1f} s", flush=True)
    torch.manual_seed(0)
    engine, _ = parallelize(
        objective_builder(cfg), cfg=cfg, dist=dist, run_dir=run_dir, load_universal=bool(resume and resume["universal"])
    )
    step = 3
    if phase == "train":
        generator = torch.Generator().manual_seed(dist.rank)
        for _ in range(step):
            images = torch.randn(8 // dist.world_size, 3, 16, 16, generator=generator)
            engine.backward(engine({"image": images})["loss"])
            engine.step()
    else:
        load_checkpoint(engine, run_dir=run_dir, resume=resume, states={})
        step = resume["states"]["train"]["step"] + 100
    state = TrainState(step=step, batches_consumed=step)
    save_checkpoint(
        engine, run_dir=run_dir, step=step, dist=dist, states={"train": state}, config_yaml=dump_config(cfg),
        keep_last=10,
    )  # fmt: skip


if __name__ == "__main__":
    slow = [int(arg.removeprefix("slow=")) for arg in sys.argv[3:4]]
    main(Path(sys.argv[1]), sys.argv[2], collective_timeout_s=slow[0] if slow else None)
