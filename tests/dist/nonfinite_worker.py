"""Worker for test_nonfinite.py (run under torchrun): a toy objective whose loss is NaN on chosen (step, rank)
pairs, trained by the real loop on a real DeepSpeed engine (in fp16 its fp16 optimizer skips those steps itself).
Writes what it saw to OUT/rank_R.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

from core.engine.distributed import init_distributed
from core.engine.fp16 import fp32_master_weights
from core.engine.loop import LoopHooks, NonFiniteLossError, train
from core.engine.setup import parallelize
from core.engine.stage import StageRun
from core.engine.train_state import TrainState
from core.recipe.config import dump_config, load_config
from core.report.logging import MetricsLogger
from data.pipeline import zero_counts
from tests.dist.cpu_fp16 import allow_cpu_fp16

NAN_AT = {(3, 1), (5, 0), (6, 0), (7, 1)}  # (step, rank): 3 alone, then 5, 6, 7 in a row -> stop at 7
GRAD_NAN_AT = {(1, 0)}  # (step, rank): a finite loss whose gradients are NaN (not in fp16, which skips it itself)


class NaNGrad(torch.autograd.Function):
    """The identity forward; its backward hands back NaN: non-finite gradients under a finite loss."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("nan"))


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, batch: dict) -> dict:
        out = self.lin(batch["image"])
        if batch["grad_nan"]:
            out = NaNGrad.apply(out)
        return {"loss": (out**2).mean() * batch["scale"]}


def main(out: Path, zero_stage: int, precision: str, sync_every: int) -> None:
    """`sync_every` 1: the host reads the ranks' agreement at every step (checkpoint every 2, logging every step);
    otherwise only every `sync_every` steps (no logging or checkpoint before the last step)."""
    if precision == "fp16":
        allow_cpu_fp16()
    cfg = load_config(
        None,
        [
            f"run_dir={out / 'run'}",
            "schedule.steps=8",
            "engine.max_consecutive_nonfinite=3",
            f"engine.zero_stage={zero_stage}",
            f"engine.precision={precision}",
            "engine.fp16_initial_scale_power=8",  # the toy's gradients times 2^16 would overflow fp16
            "data.global_batch_size=4",
            f"engine.sync_every_steps={sync_every}",
            f"checkpoint.every_steps={2 if sync_every == 1 else 100}",
            f"logging.every_steps={1 if sync_every == 1 else 100}",
            "optim.base_lr=0.1",
        ],
    )
    dist = init_distributed("cpu")
    torch.manual_seed(0)
    engine, optimizer = parallelize(Toy(), cfg=cfg, dist=dist, run_dir=out)
    masters_equal_weights = None  # fp16: no update may reach the fp32 master weights before the first step
    if precision == "fp16":
        masters = fp32_master_weights(engine, engine.module)
        masters_equal_weights = all(torch.equal(masters[n], p.float()) for n, p in engine.module.named_parameters())
    snapshots: dict[int, list[float]] = {}

    def batches():
        for step in range(1, 100):
            snapshots[step] = [v for p in engine.module.parameters() for v in p.detach().flatten().tolist()]
            scale = float("nan") if (step, dist.rank) in NAN_AT else 1.0
            grad_nan = precision != "fp16" and (step, dist.rank) in GRAD_NAN_AT
            batch = {"image": torch.randn(2, 4), "scale": torch.tensor(scale), **zero_counts()}
            yield {**batch, "grad_nan": grad_nan}

    logger = MetricsLogger(out / "run", enabled=dist.is_main, tensorboard=False, total_steps=8)
    state = TrainState()
    try:
        run = StageRun(
            cfg=cfg,
            recipe="",
            dist=dist,
            run_dir=out / "run",
            config_yaml=dump_config(cfg),
            samples=None,
            total_steps=8,
            warmup_steps=0,
            resume=None,
            state=state,
            logger=logger,
        )
        train(run, engine, optimizer, batches(), LoopHooks())
        error = None
    except NonFiniteLossError as err:
        error = str(err)
    logger.close()
    result = {"snapshots": snapshots, "error": error, "state": state.__dict__, "masters": masters_equal_weights}
    (out / f"rank_{dist.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
