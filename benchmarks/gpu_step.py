"""bench_gpu's worker: the real loop (`parallelize` + `train`) of one MAE recipe on one GPU, at one batch size, one
precision, eager or compiled, on one batch read once through the recipe's own data pipeline. Run as
`gpu_step.py --worker SPEC` by bench_gpu.py; writes JSON to spec["out"]: {"oom": true} when the batch does not fit,
else the per-step timings, the peak memory of the timed steps and the FLOPs of the loop's own perf/mfu meter.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
NEVER = 10**9  # logging / checkpoint period that never comes round in a benchmark run


def build_config(spec: dict):
    """The recipe with the spec's batch, precision and compile; the data read in this process (one batch of it)."""
    from core.recipe.config import load_config

    overrides = [
        f"run_dir={spec['run_dir']}",
        f"data.train={spec['shards']}",
        f"data.global_batch_size={spec['batch']}",
        "data.num_workers=0",
        "data.shuffle_buffer=0",
        "engine.device=cuda",
        "engine.grad_accum_steps=1",
        f"engine.precision={spec['precision']}",
        f"engine.compile={str(spec['compiled']).lower()}",
        "schedule.epochs=null",
        f"schedule.steps={spec['warmup'] + spec['steps'] + 1}",
        "schedule.warmup_epochs=null",
        "schedule.warmup_steps=1",
        f"logging.every_steps={NEVER}",
        "logging.image_every_steps=0",
        "logging.tensorboard=false",
        f"checkpoint.every_steps={NEVER}",
    ]
    return load_config(RECIPES / f"{spec['recipe']}.yaml", overrides)


def synced(clock, name: str, fn):
    """`fn` timed by `clock` as `name` from the moment the GPU has finished what was queued before it to the moment
    it has finished `fn`'s own work (kernels run asynchronously: without the syncs the time would be the launch's)."""
    import torch

    def then_sync(*args, **kwargs):
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        return out

    timed = clock.timed(name, then_sync)

    def wrapper(*args, **kwargs):
        torch.cuda.synchronize()
        return timed(*args, **kwargs)

    return wrapper


def record_meter(found: list) -> None:
    """Keep the perf/mfu meter the loop starts (core.engine.utilisation.start_meter) in `found`."""
    from core.engine import loop

    start = loop.start_meter

    def recording(run, module, batch):
        meter = start(run, module, batch)
        found.append(meter)
        return meter

    loop.start_meter = recording


def measure(spec: dict) -> dict:
    """`spec["warmup"]` untimed steps (torch.compile compiles in the first), then `spec["steps"]` timed ones."""
    import torch

    from benchmarks.engine_step import Clock, MeasurementDone, train_until_done
    from core.engine.distributed import init_distributed
    from core.engine.setup import parallelize
    from core.engine.stream import train_loader
    from pretrain.objectives import objective_builder, train_transform

    cfg = build_config(spec)
    dist = init_distributed("cuda")
    batch = next(iter(train_loader(cfg, dist, train_transform(cfg), labels=False, positions=None)))
    torch.manual_seed(0)
    run_dir = Path(spec["run_dir"])
    engine, optimizer = parallelize(objective_builder(cfg), cfg=cfg, dist=dist, run_dir=run_dir)
    clock, meters = Clock(), []
    engine.backward = synced(clock, "backward", engine.backward)
    engine.step = synced(clock, "step_phase", engine.step)
    record_meter(meters)
    warmup, steps = spec["warmup"], spec["steps"]

    def batches():
        for draw in range(warmup + steps):
            torch.cuda.synchronize()
            if draw == warmup:
                torch.cuda.reset_peak_memory_stats()  # the timed steps' peak, not the start-up's
            clock.mark()
            yield batch
        torch.cuda.synchronize()
        clock.mark()
        raise MeasurementDone  # before the loop's last step, which would write a checkpoint

    train_until_done(cfg, engine, optimizer, batches(), dist=dist, run_dir=run_dir)
    meter = meters[0] if meters else None
    timings = clock.report(warmup, warmup + steps)
    return {
        "step": timings["step"],
        "backward": timings["backward"],
        "step_phase": timings["step_phase"],
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "flops_per_step": None if meter is None else meter.flops_per_step,
        "peak_flops": None if meter is None else meter.peak_flops,
    }


def is_out_of_memory(err: BaseException) -> bool:
    """CUDA's allocator raises OutOfMemoryError; code compiled by inductor or DeepSpeed's may re-raise it as a
    RuntimeError with the same message, and cuBLAS reports a workspace it could not allocate its own way."""
    import torch

    text = str(err)
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in text or "ALLOC_FAILED" in text


def worker(spec: dict) -> None:
    try:
        result = measure(spec)
    except RuntimeError as err:
        if not is_out_of_memory(err):
            raise
        result = {"oom": True}
    Path(spec["out"]).write_text(json.dumps(result))


if __name__ == "__main__":
    if sys.argv[1:2] != ["--worker"]:
        sys.exit("usage: python -m benchmarks.gpu_step --worker SPEC_JSON (run by benchmarks.bench_gpu)")
    worker(json.loads(sys.argv[2]))
