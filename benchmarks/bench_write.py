"""Shards written resized (issue 40): what `python -m data write --max-side` costs to write and saves to read.

    .venv/bin/python -m benchmarks.bench_write                  # 2048 images, --max-side 384, 3 rounds (~4 minutes)
    .venv/bin/python -m benchmarks.bench_write --quick          # 256 images, 1 round: checks that it runs

On bench_data's generated ImageNet-like JPEGs (`build_dataset`: quality 90, mostly 500 x 375, ~94 KB; its cached
tree is reused):

- write: `python -m data write --source imagefolder` as a user runs it, one process per measurement, without and
  with `--max-side`, at `--workers` 1 and 2, in interleaved rounds (reversed on odd ones). Wall time, and the CPU
  time of the command and its workers (getrusage of the waited-for children), each less the start-up of
  `python -m data write --help` measured in the same round, give images/s and images per CPU-second. The shards of
  1 and 2 workers are compared byte for byte.
- read: the pretraining data path (bench_data's `ours-new`: our loader with `CropFlip`, 1 DataLoader worker, fresh
  per measurement, warm-up batches discarded) over the full-size shards and the resized ones, as images per worker
  CPU-second; and for several max sides the CPU ms per image of CropFlip's decode + crop on one thread in this
  process, beside what the side does to RandomResizedCrop's boxes at 224 px.

The tables go into benchmarks/results/data.md between the markers below, replacing an earlier run's section (the
rest of the file is bench_data's).
"""

import argparse
import datetime
import hashlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import features
from torchvision import transforms as T

from benchmarks import bench_data
from benchmarks.workers import replace_section, run_worker
from data.__main__ import main as data_main
from data.transforms import IMAGENET_MEAN, IMAGENET_STD, pretrain_transform
from data.write import DEFAULT_JPEG_QUALITY, encode_image

REPO = Path(__file__).resolve().parents[1]
BEGIN, END = bench_data.WRITE_SECTION, "<!-- bench_write: end -->"
RECOMMENDED_MAX_SIDE = 384
PROFILE_SIDES = (None, 448, 384, 320, 256)
GPU_RATES = [("MAE ViT-L/16, H100 at 40% MFU", 3200), ("MAE ViT-B/16, H100 at 40% MFU", 6700)]
IMAGENET_TRAIN = 1_281_167
CORES = 16


# ---------------------------------------------------------------- write


def run_write(folder: Path, out: Path, max_side: int | None, workers: int) -> dict:
    """{"wall", "cpu", "others"}: seconds of one `python -m data write` in a fresh process, from the call of its
    `main` (its imports done) to its return; CPU of the process and its workers; the share of the machine's CPU time
    other processes used meanwhile."""
    argv = ["write", "--source", "imagefolder", "--path", str(folder), "--out", str(out), "--shard-size", "256"]
    argv += ["--workers", str(workers)] + ([] if max_side is None else ["--max-side", str(max_side)])
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # glibc malloc, as a user runs it
    spec = {"argv": argv, "out": str(out) + ".timing.json"}
    return run_worker("benchmarks.bench_write", spec, env, what=f"python -m data {' '.join(argv)}")


def time_write(spec: dict) -> None:
    """The worker: runs `data.__main__.main(spec["argv"])` and writes its wall and CPU seconds to spec["out"]."""
    start_wall, start_cpu, start_busy = time.perf_counter(), time.process_time(), bench_data.busy_cpu_seconds()
    data_main(spec["argv"])
    wall, children = time.perf_counter() - start_wall, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = time.process_time() - start_cpu + children.ru_utime + children.ru_stime  # the workers, joined by now
    others = max(0.0, bench_data.busy_cpu_seconds() - start_busy - cpu) / (wall * os.cpu_count())
    Path(spec["out"]).write_text(json.dumps({"wall": wall, "cpu": cpu, "others": others}))


def startup_seconds() -> float:
    """Wall seconds of `python -m data write --help`: the interpreter and the command's imports."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "data", "write", "--help"], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def shard_digest(out: Path) -> str:
    """One hash of every file the write left (index.json and shards), in name order."""
    digest = hashlib.sha256()
    for path in sorted(out.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def write_rounds(root: Path, args: argparse.Namespace) -> dict:
    """Per (max_side, workers): wall and CPU seconds per round; whether 1 and 2 workers wrote the same bytes; the
    median start-up."""
    cases = [(side, workers) for side in (None, args.max_side) for workers in args.workers]
    runs: dict = {case: [] for case in cases}
    digests: dict = {}
    startups: list[float] = []
    scratch = Path(tempfile.mkdtemp(prefix="bench-write-", dir=args.data_dir))
    try:
        for round_index in range(args.rounds):
            startups.append(startup_seconds())
            for side, workers in cases if round_index % 2 == 0 else cases[::-1]:
                out = scratch / f"max{side}-w{workers}"
                shutil.rmtree(out, ignore_errors=True)
                timing = run_write(root / "folder", out, side, workers)
                runs[(side, workers)].append(timing)
                digests.setdefault(side, set()).add(shard_digest(out))
                print(
                    f"round {round_index} max_side {side} workers {workers}: {args.images / timing['wall']:.0f} "
                    f"images/s, {args.images / timing['cpu']:.0f} per CPU-s, others' load {timing['others']:.0%}",
                    flush=True,
                )
    finally:
        shutil.rmtree(scratch)
    identical = {side: len(found) == 1 for side, found in digests.items()}
    return {"runs": runs, "identical": identical, "startup": statistics.median(startups)}


def write_table(results: dict, num_images: int) -> list[str]:
    lines = [
        "| --max-side | --workers | images/s | images per CPU-s | each round (images/s) | same bytes at 1 and 2 | "
        "others' load (max) |",
        "|---|---:|---:|---:|---|---|---:|",
    ]
    for (side, workers), runs in results["runs"].items():
        rates = [num_images / run["wall"] for run in runs]
        per_cpu = statistics.median(num_images / run["cpu"] for run in runs)
        same = "yes" if results["identical"][side] else "**no**"
        lines.append(
            f"| {side or 'none'} | {workers} | {statistics.median(rates):.0f} | {per_cpu:.0f} | "
            f"{' / '.join(f'{r:.0f}' for r in rates)} | {same} | {max(run['others'] for run in runs):.0%} |"
        )
    return lines


def imagenet_estimate(results: dict, num_images: int, max_side: int) -> list[str]:
    """Hours to convert ImageNet-1k's training set on CORES cores, from the images per CPU-second measured."""
    lines = []
    for workers in sorted({w for _, w in results["runs"]}):
        per_cpu = statistics.median(num_images / run["cpu"] for run in results["runs"][(max_side, workers)])
        minutes = IMAGENET_TRAIN / (per_cpu * CORES) / 60
        lines.append(
            f"- from the {workers}-worker run ({per_cpu:.0f} images per CPU-second): {IMAGENET_TRAIN:,} images "
            f"on {CORES} busy cores (`--workers {CORES - 1}` and the writing process) take ~{minutes:.0f} minutes"
        )
    return lines


# ---------------------------------------------------------------- read


def resized_shards(root: Path, max_side: int) -> Path:
    """`root/max{N}/shards`, written once with `data write --max-side N` (the folder bench_data.measure reads)."""
    target, num_images = root / f"max{max_side}", len(list((root / "folder").rglob("*.jpg")))
    index = target / "shards" / "index.json"
    if not index.is_file() or json.loads(index.read_text())["num_samples"] != num_images:
        shutil.rmtree(target, ignore_errors=True)
        run_write(root / "folder", target / "shards", max_side, 2)
    return target


def read_rounds(root: Path, resized: Path, args: argparse.Namespace) -> dict[str, list[dict]]:
    """bench_data's `ours-new` loader with 1 worker over the full-size and the resized shards, interleaved."""
    roots = {"full size": root, f"--max-side {args.max_side}": resized}
    runs: dict[str, list[dict]] = {name: [] for name in roots}
    for round_index in range(args.rounds):
        for name in roots if round_index % 2 == 0 else list(roots)[::-1]:
            result = bench_data.measure("ours-new", roots[name], 1, args, seed=round_index)
            runs[name].append(result)
            print(f"round {round_index} read {name}: {result['per_worker_cpu_s']:.0f} images per worker CPU-s")
    return runs


def read_table(runs: dict[str, list[dict]]) -> list[str]:
    header = " | ".join(f"workers for {rate:,} images/s" for _, rate in GPU_RATES)
    lines = [
        f"| shards | images/s (1 worker) | images per worker CPU-s | each round | {header} | others' load (max) |",
        "|---|---:|---:|---|" + "---:|" * len(GPU_RATES) + "---:|",
    ]
    for name, results in runs.items():
        per_cpu = statistics.median(r["per_worker_cpu_s"] for r in results)
        needs = " | ".join(f"{rate / per_cpu:.1f}" for _, rate in GPU_RATES)
        rounds = " / ".join(f"{r['per_worker_cpu_s']:.0f}" for r in results)
        lines.append(
            f"| {name} | {statistics.median(r['per_s'] for r in results):.0f} | {per_cpu:.0f} | {rounds} | {needs} | "
            f"{max(r['others'] for r in results):.0%} |"
        )
    return lines


def crop_stats(width: int, height: int, draws: int = 4000) -> tuple[float, float]:
    """RandomResizedCrop(scale 0.2-1, ratio 3/4-4/3) on a width x height image: the share of boxes smaller than
    224 px (their geometric mean side; upsampled to 224) and the median box side."""
    torch.manual_seed(0)
    sides = []
    for _ in range(draws):
        _, _, box_height, box_width = T.RandomResizedCrop.get_params(
            torch.empty(0, height, width), [0.2, 1.0], [3 / 4, 4 / 3]
        )
        sides.append((box_height * box_width) ** 0.5)
    return float(np.mean(np.array(sides) < bench_data.SIZE)), float(np.median(sides))


def profile_sides(root: Path, count: int) -> list[tuple]:
    """Per max side: stored width x height of a 500 x 375 photo, KB per image, CropFlip decode + crop CPU ms per
    image (best of 3 passes on one thread), and crop_stats."""
    torch.set_num_threads(1)  # as in a DataLoader worker
    raw = [f.read_bytes() for f in sorted((root / "folder").rglob("*.jpg"))[:count]]
    transform = pretrain_transform(bench_data.SIZE, IMAGENET_MEAN, IMAGENET_STD)
    rows = []
    for side in PROFILE_SIDES:
        images = raw if side is None else [encode_image("bench", b, side, DEFAULT_JPEG_QUALITY)[1] for b in raw]
        ms = bench_data.per_image_ms(lambda i, images=images: transform(transform.decode(images[i])), count)
        width, height = (500, 375) if side is None else (side, round(375 * side / 500))
        rows.append((side, width, height, statistics.mean(map(len, images)) / 1024, ms, *crop_stats(width, height)))
    return rows


def profile_table(rows: list[tuple]) -> list[str]:
    lines = [
        "| --max-side | a 500x375 photo stored as | KB per image | CropFlip decode + crop, CPU ms per image | "
        "crops upsampled to 224 | median crop side |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for side, width, height, kb, ms, upsampled, median in rows:
        lines.append(
            f"| {side or 'none (full size)'} | {width}x{height} | {kb:.0f} | {ms:.2f} | {upsampled:.0%} | "
            f"{median:.0f} |"
        )
    return lines


# ---------------------------------------------------------------- report


def section(
    args: argparse.Namespace, info: dict, loads: tuple, minutes: float, written: dict, read: dict, profile: list
) -> str:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")
    lines = [
        BEGIN,
        "## Shards written resized",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"- command: `{' '.join(['python -m benchmarks.bench_write', *sys.argv[1:]])}` ({minutes:.0f} minutes); CPU: "
        f"{cpu}, {os.cpu_count()} cores visible; pillow {features.version('pil')}, libjpeg-turbo "
        f"{features.version('libjpeg_turbo')}, python {platform.python_version()}",
        f"- data: bench_data's {info['num_images']} generated JPEGs (quality 90, mostly 500x375, {info['mean_kb']:.0f} "
        f"KB on average), `--max-side {args.max_side}` at JPEG quality {DEFAULT_JPEG_QUALITY}; {args.rounds} "
        f"interleaved rounds; 1-min load average before / after: {loads[0]:.2f} / {loads[1]:.2f}",
        "",
        "### Writing: `python -m data write --source imagefolder`",
        "",
        *write_table(written, info["num_images"]),
        "",
        "Median over rounds, each write a fresh process timed from its `main` (imports done) to its end; starting "
        f"the command (`python -m data write --help`) takes another {written['startup']:.1f} s. Images per "
        "CPU-second counts the writing process and its workers together.",
        "",
        *imagenet_estimate(written, info["num_images"], args.max_side),
        "",
        "### Reading: the pretraining data path (our loader, `CropFlip` at 224 px, 1 DataLoader worker)",
        "",
        *read_table(read),
        "",
        "Workers for a GPU rate: that rate over the images per worker CPU-second (a worker with a core to itself); "
        "add a core per GPU for the training process.",
        "",
        "### Cost and crops by max side (one thread, in process)",
        "",
        *profile_table(profile),
        "",
        f"CropFlip's decode + crop (no loader around it), best of 3 passes over {args.profile_images} images. Crops: "
        "torchvision's RandomResizedCrop boxes at scale 0.2-1, ratio 3/4-4/3 on an image of that size; an upsampled "
        "box has fewer than 224 px (geometric mean of its sides).",
        END,
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=2048, help="JPEGs (bench_data's; its cached tree is reused)")
    parser.add_argument("--classes", type=int, default=8)
    parser.add_argument("--max-side", type=int, default=RECOMMENDED_MAX_SIDE)
    parser.add_argument("--workers", type=lambda s: [int(w) for w in s.split(",")], default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=4, help="batches discarded per read measurement")
    parser.add_argument("--batches", type=int, default=24, help="batches timed per read measurement")
    parser.add_argument("--profile-images", type=int, default=192)
    parser.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "mimpipe-bench-data")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "data.md")
    parser.add_argument("--quick", action="store_true", help="256 images, 1 round, 2 + 6 batches")
    args = parser.parse_args(argv)
    if args.quick:
        args.images, args.rounds, args.warmup, args.batches, args.profile_images = 256, 1, 2, 6, 32
        args.data_dir = args.data_dir.with_name(args.data_dir.name + "-quick")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        time_write(json.loads(argv[1]))
        return 0
    args = parse_args(argv)
    start = time.perf_counter()
    bench_data.preload_tcmalloc("benchmarks.bench_write")  # the loader as launch.sh runs it; the writes drop it
    info = bench_data.build_dataset(args.data_dir, args.images, args.classes)
    resized = resized_shards(args.data_dir, args.max_side)
    load_before = os.getloadavg()[0]
    written = write_rounds(args.data_dir, args)
    read = read_rounds(args.data_dir, resized, args)
    profile = profile_sides(args.data_dir, args.profile_images)
    minutes = (time.perf_counter() - start) / 60
    text = section(args, info, (load_before, os.getloadavg()[0]), minutes, written, read, profile)
    replace_section(args.out, text, BEGIN, END)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
