"""Peak memory per rank of MAE (and data2vec 2.0) pretraining at each ZeRO stage: 2 processes (torchrun, gloo) on
CPU, a few bf16 steps
of the real engine (`parallelize` + `train`) each, written as a table to benchmarks/results/memory.md.

    .venv/bin/python -m benchmarks.bench_memory           # MAE ViT-L/16, 224 px, 2 images per rank (make bench-memory)
    .venv/bin/python -m benchmarks.bench_memory --quick   # ViT-Ti at 64 px: checks that the script runs

Each configuration is a fresh `torchrun` job. Every rank reports its peak resident set size (ru_maxrss: the most
host memory the process ever held, model, optimizer, activations, libraries and all) once the engine is built and
again after the steps. Under ZeRO-3 the objective is built inside deepspeed.zero.Init (core/engine/zero_init.py),
so no rank ever materialises the whole model.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from core.recipe.geometry import VIT_SIZES

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "memory.md"
TCMALLOC = Path(f"/usr/lib/{platform.machine()}-linux-gnu/libtcmalloc_minimal.so.4")
NEVER = 10**9  # logging / checkpoint period that never comes round
ACTIVATION_CHECKPOINTING = "engine.activation_checkpointing=true"
SHARE_ZERO12 = "engine.share_zero12_masters=true"
SHARE_ZERO3 = "engine.share_zero3_masters=true"
# data2vec 2.0 with recipes/data2vec2_vitl.yaml's objective: an EMA teacher as large as the encoder beside it.
DATA2VEC2 = [
    "objective.kind=data2vec2",
    "objective.mask_ratio=0.75",
    "objective.mask_adjust=0.1",
    "objective.num_masks=16",
    "objective.top_k_blocks=18",
    "objective.decoder.embed_dim=1024",
    "objective.decoder.kernel_size=5",
    "objective.decoder.num_layers=3",
]
# (label, overrides, images per rank or None for --per-rank): the ZeRO stages, each memory patch beside the stage
# without it (docs/deepspeed_patches.md), then activation checkpointing at a batch where activations weigh.
CASES = [
    ("ZeRO-0", ["engine.zero_stage=0"], None),
    ("ZeRO-1", ["engine.zero_stage=1"], None),
    ("ZeRO-2", ["engine.zero_stage=2"], None),
    ("ZeRO-2 + `share_zero12_masters`", ["engine.zero_stage=2", SHARE_ZERO12], None),
    ("ZeRO-3", ["engine.zero_stage=3"], None),
    ("ZeRO-3 + `share_zero3_masters`", ["engine.zero_stage=3", SHARE_ZERO3], None),
    ("ZeRO-3, 8 images per rank", ["engine.zero_stage=3"], 8),
    ("ZeRO-3 + activation checkpointing, 8 images per rank", ["engine.zero_stage=3", ACTIVATION_CHECKPOINTING], 8),
    ("data2vec 2.0, ZeRO-1", ["engine.zero_stage=1", *DATA2VEC2], None),
    ("data2vec 2.0, ZeRO-3", ["engine.zero_stage=3", *DATA2VEC2], None),
]


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


# ---------------------------------------------------------------- worker: one rank of one configuration


def worker(spec: dict) -> None:
    import torch

    from benchmarks.engine_step import MeasurementDone, train_until_done
    from core.engine.distributed import init_distributed
    from core.engine.setup import parallelize
    from core.recipe.config import load_config
    from data.masking import MaskStack
    from data.pipeline import zero_counts
    from pretrain.objectives import mask_generator, objective_builder

    world = int(os.environ["WORLD_SIZE"])
    total = spec["steps"] + 1
    overrides = [
        f"run_dir={spec['run_dir']}",
        f"model.size={spec['model']}",
        f"model.img_size={spec['size']}",
        "model.patch_size=16",
        f"data.global_batch_size={spec['per_rank'] * world}",
        "engine.precision=bf16",
        "engine.device=cpu",
        f"schedule.steps={total}",
        "schedule.warmup_steps=1",
        f"logging.every_steps={NEVER}",
        "logging.image_every_steps=0",
        "logging.tensorboard=false",
        f"checkpoint.every_steps={NEVER}",
        *spec["overrides"],
    ]
    cfg = load_config(None, overrides)
    dist = init_distributed("cpu")
    run_dir = Path(spec["run_dir"])
    torch.manual_seed(0)
    engine, optimizer = parallelize(objective_builder(cfg), cfg=cfg, dist=dist, run_dir=run_dir)
    built = peak_gib()
    images = torch.randn(spec["per_rank"], 3, spec["size"], spec["size"], generator=torch.Generator().manual_seed(0))
    batch = {"image": images, **zero_counts()}  # image: (B, C, H, W)
    if cfg.objective.kind == "data2vec2":  # its masks come from the data workers: (B, M, gh, gw)
        masks = MaskStack(mask_generator(cfg), cfg.objective.num_masks)
        batch["mask"] = torch.stack([masks() for _ in range(spec["per_rank"])])
    marks = []

    def batches():
        for _ in range(spec["steps"]):
            marks.append(time.perf_counter())
            yield batch
        marks.append(time.perf_counter())
        raise MeasurementDone

    train_until_done(cfg, engine, optimizer, batches(), dist=dist, run_dir=run_dir)
    steps = [b - a for a, b in zip(marks, marks[1:], strict=False)][1:]  # the first step pays for warm-up
    result = {"built_gib": built, "peak_gib": peak_gib(), "s_per_step": sorted(steps)[len(steps) // 2]}
    result["teacher_gib"] = teacher_bytes(engine.module) / 2**30
    Path(spec["run_dir"], f"rank_{dist.rank}.json").write_text(json.dumps(result))


def teacher_bytes(objective) -> int:
    """Bytes of the EMA teacher's weights this rank holds (its ZeRO-3 partition, else all of it); 0 without one."""
    from core.compat.deepspeed import is_zero3_param

    teacher = getattr(objective, "teacher", None)
    if teacher is None:
        return 0
    own = [p.ds_tensor if is_zero3_param(p) else p for p in teacher.parameters()]
    return sum(t.numel() * t.element_size() for t in own)


# ---------------------------------------------------------------- driver


def run_case(overrides: list[str], per_rank: int, args: argparse.Namespace, scratch: Path) -> list[dict]:
    run_dir = Path(tempfile.mkdtemp(dir=scratch))
    spec = {
        "run_dir": str(run_dir),
        "model": args.model,
        "size": args.size,
        "per_rank": per_rank,
        "steps": args.steps,
        "overrides": overrides,
    }
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    env["HF_HUB_OFFLINE"] = "1"
    if TCMALLOC.is_file():  # as launch.sh runs the stages; glibc's malloc keeps more freed memory resident
        env["LD_PRELOAD"] = str(TCMALLOC)
    with socket.socket() as sock:  # a fresh port per job: the previous job's may still be in TIME_WAIT
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc)]
    command += ["--master-port", str(port), "-m", "benchmarks.bench_memory", "--worker", json.dumps(spec)]
    proc = subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{overrides} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
    return [json.loads((run_dir / f"rank_{rank}.json").read_text()) for rank in range(args.nproc)]


def render(results: dict[str, list[dict]]) -> list[str]:
    # ZeRO-0's ranks differ by up to 1.2 GiB from run to run (DeepSpeed's gradient all-reduce buffers): the ratio
    # takes its lower rank, against the higher rank of the row, so that it never flatters.
    base = min(r["peak_gib"] for r in results["ZeRO-0"]) if "ZeRO-0" in results else float("nan")
    lines = [
        "| configuration | peak RSS per rank, GiB (rank 0 / 1) | higher rank vs ZeRO-0's lower | peak once built, GiB "
        "| s/step | EMA teacher per rank, GiB |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for label, ranks in results.items():
        peak = max(r["peak_gib"] for r in ranks)
        per_rank = " / ".join(f"{r['peak_gib']:.2f}" for r in ranks)
        built = max(r["built_gib"] for r in ranks)
        step = max(r["s_per_step"] for r in ranks)
        teacher = max(r.get("teacher_gib", 0.0) for r in ranks)
        teacher_cell = f"{teacher:.3f}" if teacher else "-"
        lines.append(f"| {label} | {per_rank} | {peak / base:.0%} | {built:.2f} | {step:.1f} | {teacher_cell} |")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="large", help="ViT size preset (default: large)")
    p.add_argument("--size", type=int, default=224, help="image side in pixels, patch 16 (default: 224)")
    p.add_argument("--per-rank", type=int, default=2, help="images per rank per step (default: 2)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per configuration (default: 3)")
    p.add_argument("--nproc", type=int, default=2, help="processes (default: 2)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per process (default: 1)")
    p.add_argument("--skip", default="", help="configuration labels to leave out, ';'-separated: 'ZeRO-1;ZeRO-2'")
    p.add_argument("--quick", action="store_true", help="ViT-Ti at 64 px, 2 steps")
    p.add_argument("--out", type=Path, default=RESULTS, help="markdown result file (default: %(default)s)")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.size, args.steps = "tiny", 64, 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as scratch:
        for label, overrides, per_rank in CASES:
            if label in args.skip.split(";"):
                continue
            if args.model != "large" and DATA2VEC2[0] in overrides:  # the top 3/4 of the blocks, as ViT-L's 18 of 24
                overrides = [*overrides, f"objective.top_k_blocks={VIT_SIZES[args.model]['depth'] * 3 // 4}"]
            results[label] = run_case(overrides, per_rank or args.per_rank, args, Path(scratch))
            print(f"[bench] {label}: peak {max(r['peak_gib'] for r in results[label]):.2f} GiB per rank", flush=True)
    import torch

    from benchmarks.bench_engine import publish

    lines = [
        "# Peak memory per rank at each ZeRO stage",
        "",
        f"- date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
        f"- {os.cpu_count()} cores visible, {args.nproc} processes (torchrun, gloo), OMP_NUM_THREADS={args.threads}",
        f"- torch {torch.__version__}, deepspeed {version('deepspeed')}, timm {version('timm')}, "
        f"python {platform.python_version()}",
        f"- model: MAE ViT-{args.model.capitalize()}/16 at {args.size} px (decoder 512 wide, 8 blocks), "
        f"{args.per_rank} images per rank unless the row says otherwise, bf16 autocast over fp32 weights, AdamW; "
        f"{args.steps} steps each; the data2vec 2.0 rows: recipes/data2vec2_vitl.yaml's objective (16 masked copies "
        "of each image, a convolutional decoder, an EMA teacher as large as the encoder: its weights per rank in the "
        "last column)",
        "- peak RSS: the process's ru_maxrss (all host memory it ever held, ~0.5 GiB of it libraries); malloc: "
        f"{'tcmalloc (as launch.sh)' if TCMALLOC.is_file() else 'glibc'}",
        f"- command: `{' '.join(['python', '-m', 'benchmarks.bench_memory', *sys.argv[1:]])}`",
        "",
        *render(results),
        "",
    ]
    publish("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(json.loads(sys.argv[2]))
        sys.exit(0)
    sys.exit(main())
