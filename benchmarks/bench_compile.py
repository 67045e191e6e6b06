"""Eager against compiled (`engine.compile`) on the quickstart recipes, side by side in one run.

Each run is the real recipe through ./launch.sh (one process), shortened to `--steps` optimizer steps, in a fresh
run_dir; compiled runs get a fresh, empty inductor cache (TORCHINDUCTOR_CACHE_DIR), so their first step holds a cold
compile, as the first `make quickstart` on a machine sees it; a second, short compiled run then reuses that cache
(warm). Runs alternate eager / compiled over `--rounds`. From each run's launch log and metrics.jsonl:

- first step: wall seconds of step 1 and the torch.compile seconds inside it (the launch log's `first step` line);
- steady steps/s: optimizer steps per second over the logging windows after `--warmup` steps (no evaluation in them);
- full recipe: first step + the recipe's remaining steps at the steady rate: the training part of `make quickstart`
  with the compile time counted (start-up and evaluation come on top, alike for both);
- run wall: the whole shortened run, start-up and fine-tuning's final evaluation (compiled: its compile too)
  included.

    .venv/bin/python benchmarks/bench_compile.py --shards shards/quickstart --init runs/quickstart/export \\
        --out benchmarks/results/compile.md
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.workers import REPO, machine_lines

RECIPES = {  # recipe, full steps, overrides for the shortened run
    "finetune": ("recipes/quickstart_finetune.yaml", 2000, ["eval.every_steps=0"]),
    "pretrain": ("recipes/quickstart.yaml", 700, ["eval.knn.enabled=false", "logging.image_every_steps=0"]),
}


def run_once(stage: str, compiled: bool, args, work: Path, tag: str, cache: Path | None, steps: int) -> dict:
    recipe, _, extra = RECIPES[stage]
    run_dir = work / f"{stage}_{tag}"
    shards = Path(args.shards).resolve()
    overrides = [
        f"run_dir={run_dir}",
        f"schedule.steps={steps}",
        f"engine.compile={str(compiled).lower()}",
        f"data.train={shards / 'train'}",
        "logging.every_steps=25",
        "checkpoint.every_steps=100000",
        "checkpoint.export_at_end=false",
        *extra,
    ]
    if stage == "finetune":
        overrides += [f"data.val={shards / 'test'}", f"model.init={Path(args.init).resolve()}"]
    env = {**os.environ, "PYTHON": sys.executable, "NPROC_PER_NODE": "1", "PYTHONPATH": str(REPO)}
    if cache is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    start = time.perf_counter()
    proc = subprocess.run(
        [str(REPO / "launch.sh"), recipe, *overrides], cwd=REPO, env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"{stage} {tag}: exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-3000:]}")
    first = re.search(r"first step: ([\d.]+) s(?:, ([\d.]+) s of it torch.compile)?", proc.stdout)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [m for m in metrics if "perf/images_per_sec" in m and m["step"] > args.warmup]
    per_step = [m["perf/images_per_sec"] for m in rates]
    return {
        "first_s": float(first.group(1)),
        "compile_s": float(first.group(2) or 0),
        "images_per_sec": sorted(per_step)[len(per_step) // 2],
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", required=True, help="the quickstart shards (train/ and test/)")
    parser.add_argument("--init", required=True, help="the quickstart pretraining export, for fine-tuning")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per timed run")
    parser.add_argument("--warmup", type=int, default=50, help="steps left out of the steady rate")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--stages", default="finetune,pretrain")
    parser.add_argument("--out", default=None, help="write the markdown table here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_compile_"))
    rows = []
    for stage in args.stages.split(","):
        _, full, _ = RECIPES[stage]
        batch = 64 if stage == "finetune" else 256
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            for compiled in order:
                cache = work / f"inductor_{stage}_{r}" if compiled else None
                tag = f"{'compiled' if compiled else 'eager'}_{r}"
                res = run_once(stage, compiled, args, work, tag, cache, args.steps)
                rows.append((stage, tag + (" (cold cache)" if compiled else ""), res, batch, full))
                print(stage, tag, res, flush=True)
                if compiled:
                    warm = run_once(stage, True, args, work, tag + "_warm", cache, args.warmup + 50)
                    rows.append((stage, tag + " (warm cache)", warm, batch, full))
                    print(stage, tag, "warm", warm, flush=True)
    table = format_table(rows, args)
    print(table)
    if args.out:
        Path(args.out).write_text("\n".join(machine_lines(os.cpu_count() or 1)) + "\n\n" + table + "\n")


def format_table(rows, args) -> str:
    lines = [
        f"`benchmarks/bench_compile.py --steps {args.steps} --warmup {args.warmup} --rounds {args.rounds}`",
        "",
        "| recipe | run | first step s | of it compile s | steady images/s | steady steps/s | "
        "first step + full recipe's steps at the steady rate | run wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for stage, tag, res, batch, full in rows:
        steps_per_sec = res["images_per_sec"] / batch
        total = res["first_s"] + (full - 1) / steps_per_sec
        lines.append(
            f"| {stage} | {tag} | {res['first_s']:.1f} | {res['compile_s']:.1f} | {res['images_per_sec']:.0f} | "
            f"{steps_per_sec:.2f} | {total / 60:.1f} min ({full} steps) | {res['wall_s']:.0f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
