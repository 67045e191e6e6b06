"""Where a MAE step's time goes on the GPU: the real loop (`parallelize` + `train`) of one recipe under torch.profiler,
a few steady steps recorded after the warm-up (and compile) steps, summarised by benchmarks/trace_summary.py.

    .venv/bin/python -m benchmarks.gpu_trace --recipe mae_vitb --batch 256 --out OUT        # on a GPU (a lease)
    .venv/bin/python -m benchmarks.gpu_trace --recipe mae_vitl --batch 128 --compiled --out OUT
    .venv/bin/python -m benchmarks.gpu_trace --recipe quickstart --batch 8 --device cpu --out OUT   # checks it runs

Writes OUT/trace.json.gz (the Chrome trace: chrome://tracing or ui.perfetto.dev), OUT/summary.json and OUT/summary.md
(also printed). The batch is read once through the recipe's own pipeline from `batch` generated ImageNet-like JPEGs
(benchmarks/bench_data.py's) and fed to every step, as bench_gpu's worker (gpu_step.py) does; the recipe gets that
worker's overrides (`gpu_step.build_config`) on `--device`, and more recipe overrides after `--set`.

The worker (`python -m benchmarks.gpu_trace --worker SPEC_JSON`, started by the driver above) takes gpu_step's spec
keys (recipe, batch, precision, compiled, shards, run_dir, warmup, steps, device, overrides) and `trace`
(the .json.gz path to write) and `out` (the summary JSON). It runs `warmup` steps unrecorded (the last of them with
the profiler on and its events dropped, torch.profiler's warm-up), then records `steps` steps, with
`record_function` regions around `engine.backward` and `engine.step` that trace_summary reads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from benchmarks.trace_summary import BACKWARD_REGION, STEP_REGION


def annotated(name: str, fn):
    """`fn` inside a torch.profiler region called `name`."""
    from torch.profiler import record_function

    def wrapper(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)

    return wrapper


def profiled(batch: dict, prof, num_steps: int, device):
    """`batch` `num_steps` times, each draw a profiler step; then the last step's GPU work is waited for (so that it
    is in the trace), the profiler's last step ends (which writes the trace) and MeasurementDone stops the loop before
    its last step, which would write a checkpoint."""
    import torch

    from benchmarks.engine_step import MeasurementDone

    for draw in range(num_steps):
        if draw:
            prof.step()
        yield batch
    if device.type == "cuda":
        torch.cuda.synchronize()
    prof.step()
    raise MeasurementDone


def record(spec: dict) -> None:
    """The real loop on one batch under the profiler; writes the Chrome trace to spec["trace"]."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from benchmarks.engine_step import train_until_done
    from benchmarks.gpu_step import setup

    if spec["warmup"] < 1 or spec["steps"] < 1:
        raise ValueError(f"warmup and steps must be at least 1, not {spec['warmup']} and {spec['steps']}")
    cfg, dist, batch, engine, optimizer, run_dir = setup(spec)
    engine.backward = annotated(BACKWARD_REGION, engine.backward)
    engine.step = annotated(STEP_REGION, engine.step)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dist.device.type == "cuda" else [])
    steps = schedule(wait=spec["warmup"] - 1, warmup=1, active=spec["steps"], repeat=1)
    with profile(
        activities=activities,
        schedule=steps,
        record_shapes=False,
        on_trace_ready=lambda prof: prof.export_chrome_trace(spec["trace"]),
    ) as prof:
        batches = profiled(batch, prof, spec["warmup"] + spec["steps"], dist.device)
        train_until_done(cfg, engine, optimizer, batches, dist=dist, run_dir=run_dir)


def worker(spec: dict) -> None:
    from benchmarks.trace_summary import load_trace, summarize

    record(spec)
    Path(spec["out"]).write_text(json.dumps(summarize(load_trace(Path(spec["trace"]))), indent=1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="mae_vitb", help="a recipe in recipes/, by name (default: mae_vitb)")
    parser.add_argument("--batch", type=int, default=256, help="global batch of one process (default: 256)")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--compiled", action="store_true", help="engine.compile=true (compiles in the first step)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--warmup", type=int, default=3, help="steps before the recorded ones (default: 3)")
    parser.add_argument("--steps", type=int, default=3, help="steps recorded (default: 3)")
    parser.add_argument("--threads", type=int, default=min(len(os.sched_getaffinity(0)), 8))
    parser.add_argument("--out", type=Path, required=True, help="folder for trace.json.gz, summary.json, summary.md")
    parser.add_argument("--set", nargs="*", default=[], help="more recipe overrides, e.g. engine.zero_stage=0")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.bench_data import build_dataset
    from benchmarks.trace_summary import render
    from benchmarks.workers import run_worker, worker_env

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_trace_") as scratch:
        build_dataset(Path(scratch) / "data", args.batch, num_classes=2)
        (Path(scratch) / "run").mkdir()
        spec = {
            "recipe": args.recipe, "batch": args.batch, "precision": args.precision, "compiled": args.compiled,
            "shards": str(Path(scratch) / "data" / "shards"), "run_dir": str(Path(scratch) / "run"),
            "warmup": args.warmup, "steps": args.steps, "device": args.device, "overrides": args.set,
            "trace": str(args.out / "trace.json.gz"), "out": str(args.out / "summary.json"),
        }  # fmt: skip
        env = {**worker_env(args.threads), "DS_ACCELERATOR": args.device}
        summary = run_worker("benchmarks.gpu_trace", spec, env, f"trace of {args.recipe} batch {args.batch}")
    text = f"# Where the step goes: {args.recipe}, batch {args.batch}, {args.precision}, {args.device}\n\n"
    text += render(summary)
    (args.out / "summary.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(json.loads(sys.argv[2]))
    else:
        sys.exit(main())
