"""The GPU benchmarks' worker: the real loop (`parallelize` + `train`) of one recipe on one device, at one batch size
and one set of engine settings, on one batch read once through the recipe's own data pipeline. Run as
`gpu_step.py --worker SPEC` by bench_gpu.py and gpu_lease.py; writes JSON to spec["out"]: {"oom": true} when the
batch does not fit, else each timed step's milliseconds, the timed steps' losses and peak memory, the compile
seconds and the FLOPs of the loop's own perf/mfu meter.

Steps are timed on the device's own clock: a CUDA event recorded as each step draws its batch, so the host never
waits inside the step (one synchronisation after the last). Step k's time is the GPU's time from event k to event
k + 1: all the work the host queued for that step, however far ahead of the GPU the host ran. On a CPU the events
are host clock readings (nothing is queued there). The loop's own host reads (every `engine.sync_every_steps`)
happen as in a real run.

Spec keys: recipe (a name in recipes/), batch, precision, compiled, shards, run_dir, warmup, steps, out; optional
device ("cuda"), overrides (more `key=value` recipe overrides, e.g. engine.zero_stage=0).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
NEVER = 10**9  # logging / checkpoint period that never comes round in a benchmark run


def build_config(spec: dict):
    """The recipe with the spec's batch, precision, compile and overrides; the data read in this process."""
    from core.recipe.config import load_config

    overrides = [
        f"run_dir={spec['run_dir']}",
        f"data.train={spec['shards']}",
        f"data.global_batch_size={spec['batch']}",
        "data.num_workers=0",
        "data.shuffle_buffer=0",
        f"engine.device={spec.get('device', 'cuda')}",
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
        *spec.get("overrides", []),
    ]
    return load_config(RECIPES / f"{spec['recipe']}.yaml", overrides)


def setup(spec: dict):
    """(cfg, dist, batch, engine, optimizer, run_dir): one process group, one batch of the recipe's pipeline, the
    engine built as a stage builds it."""
    import torch

    from core.engine.distributed import init_distributed
    from core.engine.setup import parallelize
    from core.engine.stream import train_loader
    from pretrain.objectives import objective_builder, train_transform

    cfg = build_config(spec)
    dist = init_distributed(cfg.engine.device)
    batch = next(iter(train_loader(cfg, dist, train_transform(cfg), labels=False, positions=None)))
    torch.manual_seed(0)
    run_dir = Path(spec["run_dir"])
    engine, optimizer = parallelize(objective_builder(cfg), cfg=cfg, dist=dist, run_dir=run_dir)
    return cfg, dist, batch, engine, optimizer, run_dir


class DeviceClock:
    """Marks on the device's own timeline (CUDA events; host readings on a CPU), read once at the end."""

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self.marks: list = []
        self._event = (lambda: torch.cuda.Event(enable_timing=True)) if self.cuda else None

    def mark(self) -> None:
        if self.cuda:
            event = self._event()
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        """Milliseconds between consecutive marks (waits for the device once)."""
        if not self.cuda:
            return [1e3 * (b - a) for a, b in zip(self.marks, self.marks[1:], strict=False)]
        import torch

        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:], strict=False)]


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

    from benchmarks.engine_step import MeasurementDone, train_until_done
    from core.engine.compiled import compile_seconds

    cfg, dist, batch, engine, optimizer, run_dir = setup(spec)
    clock, losses, meters = DeviceClock(dist.device), [], []
    backward = engine.backward

    def keep_loss(loss, *args, **kwargs):
        losses.append(loss.detach().float())  # stays on the device: read after the timed steps
        return backward(loss, *args, **kwargs)

    engine.backward = keep_loss
    record_meter(meters)
    warmup, steps = spec["warmup"], spec["steps"]
    cuda = dist.device.type == "cuda"

    def batches():
        for draw in range(warmup + steps):
            if draw == warmup and cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()  # the timed steps' peak, not the start-up's
            if draw >= warmup:
                clock.mark()
            yield batch
        clock.mark()
        raise MeasurementDone  # before the loop's last step, which would write a checkpoint

    train_until_done(cfg, engine, optimizer, batches(), dist=dist, run_dir=run_dir)
    meter = meters[0] if meters else None
    return {
        "step_ms": clock.intervals_ms(),
        "losses": torch.stack(losses[warmup:]).tolist(),
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
        "compile_seconds": compile_seconds(),
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
        sys.exit("usage: python -m benchmarks.gpu_step --worker SPEC_JSON (run by benchmarks.bench_gpu, gpu_lease)")
    worker(json.loads(sys.argv[2]))
