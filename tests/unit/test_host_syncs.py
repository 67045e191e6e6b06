"""The loop reads nothing back from the device on an ordinary step (core/engine/agreement.py): on a GPU every read
(`.item()`, `.tolist()`, `bool(tensor)`, ...) waits for the queued work and leaves the GPU idle while the host queues
the next step. On CPU nothing waits, so the reads are counted instead: each read method of torch.Tensor is wrapped to
record the step during which it was called. DeepSpeed's own waits (`get_accelerator().synchronize()`) are counted the
same way, with the accelerator made to answer as CUDA's does (it does not resolve data dependencies across streams by
itself, so DeepSpeed synchronises before reusing a buffer a side stream reduced).

Recipe: defaults with a toy objective through `parallelize` (one gloo rank), logging and checkpoints only at the end."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from torch import nn

from core.engine.loop import LoopHooks, train
from core.engine.setup import parallelize
from core.engine.stage import StageRun
from core.engine.train_state import TrainState
from core.recipe.config import dump_config, load_config
from core.report.logging import MetricsLogger
from data.pipeline import zero_counts

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero", "cpu", "numpy")
STEPS = 12


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, batch: dict) -> dict:
        return {"loss": self.lin(batch["image"]).pow(2).mean()}


def _count_reads(monkeypatch, current: list[int]) -> dict[int, list[str]]:
    """Wraps every read method of torch.Tensor; returns {step: [method, ...]} filled as the loop runs."""
    reads: dict[int, list[str]] = {}
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            if self.device.type != "meta":
                reads.setdefault(current[0], []).append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, functools.wraps(original)(counted))
    return reads


def _count_device_syncs(monkeypatch, current: list[int]) -> dict[int, int]:
    """Counts `get_accelerator().synchronize()` per step, the accelerator answering as CUDA's does."""
    from deepspeed.accelerator import get_accelerator

    accelerator, syncs = get_accelerator(), {}

    def counted(device_index=None):
        syncs[current[0]] = syncs.get(current[0], 0) + 1

    monkeypatch.setattr(accelerator, "resolves_data_dependency", lambda: False)
    monkeypatch.setattr(accelerator, "synchronize", counted)
    return syncs


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_an_ordinary_step_reads_nothing_back_and_a_sync_step_once(one_rank, tmp_path: Path, monkeypatch, stage):
    sync_every = 4
    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path}",
            f"schedule.steps={STEPS}",
            "schedule.warmup_steps=0",
            f"engine.zero_stage={stage}",
            f"engine.sync_every_steps={sync_every}",
            "data.global_batch_size=2",
            "logging.every_steps=100",
            "checkpoint.every_steps=100",
        ],
    )
    torch.manual_seed(0)
    engine, optimizer = parallelize(Toy(), cfg=cfg, dist=one_rank, run_dir=tmp_path)
    current = [0]

    def batches():
        while True:
            current[0] += 1  # the loop draws step k's batch first thing in step k
            yield {"image": torch.randn(2, 4), **zero_counts()}

    logger = MetricsLogger(tmp_path, enabled=False, tensorboard=False, total_steps=STEPS)
    run = StageRun(cfg, "", one_rank, tmp_path, dump_config(cfg), None, STEPS, 0, None, TrainState(), logger)
    reads = _count_reads(monkeypatch, current)
    device_syncs = _count_device_syncs(monkeypatch, current)
    train(run, engine, optimizer, batches(), LoopHooks())
    monkeypatch.undo()
    ordinary = [step for step in range(2, STEPS) if step % sync_every]  # step 1 also reports the first step's time
    assert {step: reads[step] for step in ordinary if step in reads} == {}
    assert device_syncs == {}  # one rank: no bucket is reduced on a side stream, none waited for
    assert reads[sync_every] == ["tolist"] and reads[2 * sync_every] == ["tolist"]
