"""bench_engine's worker: one configuration (a plain torch loop, the engine at a ZeRO stage, the official MAE code or
the autocast-Linear ceiling) timed in its own process, run as `engine_step.py --worker SPEC` by bench_engine.py, which
interleaves the configurations and writes the tables. The worker writes its per-step timings as JSON to spec["out"].
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

NEVER = 10**9  # logging / checkpoint period that never comes round in a benchmark run
# (fused, foreach) for torch.optim.AdamW; "forloop" is torch's default on CPU when fused is off.
OPTIMIZERS = {"fused": (True, False), "foreach": (False, True), "forloop": (False, False)}
OFFICIAL_RUNNERS = {"official": "official MAE code", "official-sdpa": "official MAE code, timm 1.0 SDPA attention"}
"""Spec kinds of the official code's runners (benchmarks/official_mae.py) and their names in the tables."""


def build_config(spec: dict):
    from core.recipe.config import load_config

    overrides = [
        f"run_dir={spec['run_dir']}",
        f"model.size={spec['model']}",
        f"model.img_size={spec['size']}",
        "model.patch_size=16",
        f"data.global_batch_size={spec['batch']}",
        f"engine.zero_stage={spec['zero_stage'] or 0}",
        f"engine.compile={str(spec['compiled']).lower()}",
        "engine.precision=bf16",
        "engine.device=cpu",
        f"schedule.steps={spec['warmup'] + spec['steps'] + 1}",
        "schedule.warmup_steps=1",
        f"logging.every_steps={NEVER}",
        "logging.image_every_steps=0",
        "logging.tensorboard=false",
        f"checkpoint.every_steps={NEVER}",
    ]
    return load_config(None, overrides)


def mae_builder(cfg):
    """The function the pretraining stage builds its MAE objective with (pretrain/objectives.py); under ZeRO-3 the
    engine calls it inside deepspeed.zero.Init."""
    from pretrain.objectives import objective_builder

    return objective_builder(cfg)


def patch_deepspeed_config(overrides: list[str]) -> None:
    """Applies `a.b=value` overrides to the DeepSpeed JSON the engine generates, to try a setup.py change."""
    import yaml

    from core.engine import setup

    generate = setup.deepspeed_config

    def patched(cfg, world_size: int) -> dict:
        ds_config = generate(cfg, world_size)
        for item in overrides:
            dotted, raw = item.split("=", 1)
            *parents, leaf = dotted.split(".")
            node = ds_config
            for part in parents:
                node = node[part]
            node[leaf] = yaml.safe_load(raw)
        return ds_config

    setup.deepspeed_config = patched


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (all cores, every process), from /proc/stat."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class Clock:
    """Readings at the start of every step; `timed` wraps a callable and adds its durations to the current step."""

    def __init__(self):
        self.marks: list[tuple[float, int, float, float]] = []  # (wall, page faults, own CPU s, machine busy CPU s)
        self.calls: dict[str, dict[int, float]] = {}

    def mark(self) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        own = usage.ru_utime + usage.ru_stime
        self.marks.append((time.perf_counter(), usage.ru_minflt, own, busy_cpu_seconds()))

    def timed(self, name: str, fn):
        per_step = self.calls.setdefault(name, {})

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            step = len(self.marks) - 1
            per_step[step] = per_step.get(step, 0.0) + time.perf_counter() - t0
            return out

        return wrapper

    def report(self, first: int, last: int) -> dict:
        """Per-step values for steps first..last-1, and the share of the machine that other processes used."""
        deltas = [[b[k] - a[k] for k in range(4)] for a, b in itertools.pairwise(self.marks)][first:last]
        wall, _, own, busy = (self.marks[last][k] - self.marks[first][k] for k in range(4))
        return {
            "step": [d[0] for d in deltas],
            "cpu": [d[2] for d in deltas],  # this process's own CPU seconds: its work, at --threads 1
            "faults": [d[1] for d in deltas],
            **{name: [calls.get(i, 0.0) for i in range(first, last)] for name, calls in self.calls.items()},
            "others_load": max(0.0, busy - own) / (wall * os.cpu_count()),
        }


def run_plain(cfg, spec: dict, batch: dict, clock: Clock) -> int:
    """Forward under autocast, backward, AdamW step, zero_grad: what the engine's step does, without the engine.

    Returns:
        Model FLOPs of one step (core.engine.utilisation.count_step_flops), counted after the timed steps when
        spec["flops"] says so (the first round), else None.
    """
    import torch
    from timm.optim import param_groups_weight_decay

    from core.engine.setup import set_attention
    from core.engine.utilisation import count_step_flops

    torch.manual_seed(0)
    objective = mae_builder(cfg)()
    set_attention(objective, cfg.engine.attention, torch.device("cpu"))  # the kernel the engine picks
    skip = objective.no_weight_decay()
    groups = param_groups_weight_decay(objective, weight_decay=cfg.optim.weight_decay, no_weight_decay_list=skip)
    fused, foreach = OPTIMIZERS[spec["optimizer"]]
    optimizer = torch.optim.AdamW(
        groups, lr=cfg.peak_lr, betas=cfg.optim.betas, eps=cfg.optim.eps, fused=fused, foreach=foreach
    )
    optimizer.step = clock.timed("optimizer", optimizer.step)

    def step_phase() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step_phase = clock.timed("step_phase", step_phase)
    backward = clock.timed("backward", torch.Tensor.backward)
    for _ in range(spec["warmup"] + spec["steps"]):
        clock.mark()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = objective(batch)["loss"]
        backward(loss)
        step_phase()
    clock.mark()
    return count_step_flops(objective, batch, precision="bf16", device=torch.device("cpu")) if spec["flops"] else None


class MeasurementDone(Exception):
    """Raised by the benchmark's batch stream once every timed step has been drawn."""


def run_engine(cfg, spec: dict, batch: dict, clock: Clock) -> None:
    """The real loop on the real DeepSpeed engine; the clock reads at every batch draw."""
    import torch

    from core.engine.distributed import init_distributed
    from core.engine.setup import parallelize

    dist = init_distributed("cpu")
    run_dir = Path(spec["run_dir"])
    patch_deepspeed_config(spec["ds"])
    torch.manual_seed(0)
    engine, optimizer = parallelize(mae_builder(cfg), cfg=cfg, dist=dist, run_dir=run_dir)
    fused, foreach = OPTIMIZERS[spec["optimizer"]]
    for group in optimizer.param_groups:  # torch's AdamW reads both flags from the group at every step
        group["fused"], group["foreach"] = fused, foreach
    optimizer.step = clock.timed("optimizer", optimizer.step)
    engine.step = clock.timed("step_phase", engine.step)
    engine.backward = clock.timed("backward", engine.backward)

    def batches():
        for _ in range(spec["warmup"] + spec["steps"]):
            clock.mark()
            yield batch
        clock.mark()
        raise MeasurementDone  # before the loop's last step, which would also write a checkpoint

    train_until_done(cfg, engine, optimizer, batches(), dist=dist, run_dir=run_dir)


def train_until_done(cfg, engine, optimizer, batches, *, dist, run_dir: Path) -> None:
    """`core.engine.loop.train` on `batches` (which end by raising MeasurementDone), without logging or checkpoints."""
    from core.engine.loop import LoopHooks, train
    from core.engine.stage import StageRun
    from core.engine.train_state import TrainState
    from core.recipe.config import dump_config
    from core.report.logging import MetricsLogger

    total = cfg.schedule.steps
    logger = MetricsLogger(run_dir, enabled=False, tensorboard=False, total_steps=total)
    with contextlib.suppress(MeasurementDone):
        run = StageRun(
            cfg=cfg,
            recipe="",
            dist=dist,
            run_dir=run_dir,
            config_yaml=dump_config(cfg),
            samples=None,
            total_steps=total,
            warmup_steps=1,
            resume=None,
            state=TrainState(),
            logger=logger,
        )
        train(run, engine, optimizer, batches, LoopHooks())


def worker(spec_json: str) -> None:
    """Runs one configuration and writes its timings to spec['out'] as JSON."""
    import torch

    from data.pipeline import zero_counts

    spec = json.loads(spec_json)
    cfg = build_config(spec)
    images = torch.randn(spec["batch"], 3, spec["size"], spec["size"], generator=torch.Generator().manual_seed(0))
    batch = {"image": images, **zero_counts()}  # image: (B, C, H, W)
    clock = Clock()
    extra = {}
    if spec["kind"] == "ceiling":
        from benchmarks.ceiling import TRIALS, measure_ceiling

        extra = measure_ceiling(spec, clock)
        result = clock.report(0, TRIALS)
    else:
        if spec["kind"] in OFFICIAL_RUNNERS:
            from benchmarks.official_mae import run_official

            extra["flops"] = run_official(spec, images, clock)
        elif spec["zero_stage"] is None:
            extra["flops"] = run_plain(cfg, spec, batch, clock)
        else:
            run_engine(cfg, spec, batch, clock)
        result = clock.report(spec["warmup"], spec["warmup"] + spec["steps"])
    result.update(extra)
    result["max_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    Path(spec["out"]).write_text(json.dumps(result))


if __name__ == "__main__":
    if sys.argv[1:2] != ["--worker"]:
        sys.exit("usage: python -m benchmarks.engine_step --worker SPEC_JSON (run by benchmarks.bench_engine)")
    worker(sys.argv[2])
