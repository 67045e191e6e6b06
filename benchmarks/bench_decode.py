"""`data.decode: device` against `worker` at 224 px: what the data workers save, what the device pays.

    .venv/bin/python -m benchmarks.bench_decode                  # CPU here (~2 minutes on 2 cores)
    .venv/bin/python -m benchmarks.bench_decode --quick          # checks that it runs
    python3 -m benchmarks.bench_decode --device cuda --device-batch 256 --out OUT.md  # on a GPU: nvJPEG

Three measurements on bench_data.py's generated JPEGs (its `imagenet_like_jpeg`, at several sizes):

- the worker's share per image, CPU time on one thread in this process: MAE's crop as the workers run it today
  (`CropFlip.decode` + the transform: decode, box, resize, flip) against what is left with `data.decode: device` (the
  header read and the box);
- our loader (`data.pipeline.make_train_loader`, WebDataset shards, one DataLoader worker) in both modes: images/s
  and images per worker CPU-second, the bytes a sample takes in /dev/shm;
- the device side: `data.device_decode.decode_crops` on batches of JPEG crops (decode, crop, resize, flip), and the
  decode alone, in images/s of wall time on `--device`, and the host CPU time per batch of the process that runs it.

Its table goes into `--out` (benchmarks/results/data.md) between its own markers, replacing an earlier one.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from torchvision.io import ImageReadMode, decode_jpeg

from benchmarks import bench_data
from benchmarks.bench_data import SIZE, build_dataset, children_cpu_seconds, imagenet_like_jpeg, per_image_ms
from benchmarks.workers import replace_section
from data.device_decode import decode_crops, stack_images
from data.pipeline import make_train_loader
from data.transforms import IMAGENET_MEAN, IMAGENET_STD, pretrain_transform

REPO = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- bench_decode: begin -->", "<!-- bench_decode: end -->"
SIZES = [(500, 375), (1024, 768), (2000, 1500)]  # ImageNet's commonest; a web photo; a phone photo (decoded reduced)
MODES = ("worker", "device")


def jpegs_of_size(size: tuple[int, int], count: int, seed: int) -> list[bytes]:
    """`count` photo-like JPEGs of one (width, height), bench_data's generator."""
    rng, shapes = np.random.default_rng(seed), bench_data.SHAPES
    bench_data.SHAPES = [size]
    try:
        return [imagenet_like_jpeg(rng) for _ in range(count)]
    finally:
        bench_data.SHAPES = shapes


def crops_for_device(jpegs: list[bytes]) -> list:
    """The worker's output for each JPEG with `data.decode: device` (a `JpegCrop`), seeded per image."""
    device_crop = pretrain_transform(SIZE, IMAGENET_MEAN, IMAGENET_STD, decode="device")
    out = []
    for i, data in enumerate(jpegs):
        torch.manual_seed(i)
        out.append(device_crop(device_crop.decode(data)))
    return out


# ---------------------------------------------------------------- the worker's share, one thread


def worker_shares(jpegs: list[bytes]) -> dict[str, float]:
    """CPU ms per image on one thread: today's worker (decode + render) and the device mode's (header + box)."""
    torch.set_num_threads(1)  # as in a DataLoader worker
    worker = pretrain_transform(SIZE, IMAGENET_MEAN, IMAGENET_STD)
    device = pretrain_transform(SIZE, IMAGENET_MEAN, IMAGENET_STD, decode="device")
    count = len(jpegs)
    return {
        "worker": per_image_ms(lambda i: worker(worker.decode(jpegs[i])), count),
        "device": per_image_ms(lambda i: device(device.decode(jpegs[i])), count),
        "header": per_image_ms(lambda i: device.decode(jpegs[i]), count),
    }


# ---------------------------------------------------------------- the device side


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_rates(jpegs: list[bytes], device: torch.device, batch: int, repeats: int) -> dict[str, float]:
    """Images/s of wall time for decode alone and for `decode_crops` on batches of `batch` crops, and the host CPU
    ms per batch of the latter; the best of `repeats` passes over the images, after one warm-up pass."""
    crops = crops_for_device(jpegs)
    crops = crops * math.ceil(batch / len(crops))  # a batch larger than the images repeats them
    batches = [stack_images(crops[i : i + batch]) for i in range(0, len(crops) - batch + 1, batch)]
    if device.type == "cuda":
        batches = [type(b)(*(t.pin_memory() for t in b)) for b in batches]  # as DataLoader pins them
    keys = [str(i) for i in range(batch)]

    def files(b):
        ends = b.ends.tolist()
        return [b.jpeg[s:e] for s, e in zip([0, *ends[:-1]], ends, strict=True)]

    def decode_only(b):
        return decode_jpeg(files(b), mode=ImageReadMode.RGB, device=device)

    def whole(b):
        return decode_crops(b, device, keys)

    out = {}
    for name, step in (("decode", decode_only), ("decode_crops", whole)):
        walls, cpus = [], []
        for attempt in range(repeats + 1):
            sync(device)
            wall, cpu = time.perf_counter(), time.process_time()
            for b in batches:
                step(b)
            sync(device)
            if attempt:  # the first pass warms up (nvJPEG's handle and buffers, the allocator)
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
        out[f"{name}_per_s"] = len(batches) * batch / min(walls)
        out[f"{name}_cpu_ms_per_batch"] = 1e3 * min(cpus) / len(batches)
    return out


# ---------------------------------------------------------------- the loader, one worker


def loader_rate(root: Path, decode: str, args: argparse.Namespace) -> dict[str, float]:
    """Images/s and images per worker CPU-second of one fresh one-worker loader in `decode` mode, and the bytes per
    sample its batches carry."""
    shards = sorted(str(p) for p in (root / "shards").glob("train-*.tar"))
    loader = make_train_loader(
        shards, transform=pretrain_transform(SIZE, IMAGENET_MEAN, IMAGENET_STD, decode=decode),
        batch_size=args.batch, seed=0, rank=0, world_size=1, num_workers=1, shuffle_buffer=bench_data.SHUFFLE_BUFFER,
        labels=False,
    )  # fmt: skip
    batches = iter(loader)
    for _ in range(args.warmup):
        next(batches)
    cpu_start, start, nbytes = children_cpu_seconds(), time.perf_counter(), 0
    for _ in range(args.batches):
        image = next(batches)["image"]
        nbytes += sum(t.nbytes for t in image) if isinstance(image, tuple) else image.nbytes
    wall, cpu = time.perf_counter() - start, children_cpu_seconds() - cpu_start
    del batches
    images = args.batches * args.batch
    return {"per_s": images / wall, "per_cpu_s": images / cpu, "kb_per_sample": nbytes / images / 1024}


# ---------------------------------------------------------------- report


def environment(args: argparse.Namespace, device: torch.device, info: dict, loads: tuple) -> list[str]:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")
    gpu = f"; GPU {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    versions = ", ".join(f"{p} {version(p)}" for p in ("torch", "torchvision", "pillow"))
    return [
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; device {device.type}",
        f"- CPU: {cpu}, {os.cpu_count()} cores visible, torch threads {args.threads}{gpu}",
        f"- {versions}, python {platform.python_version()}",
        f"- loader: {info['num_images']} of bench_data's JPEGs (mostly 500x375, {info['mean_kb']:.0f} KB on "
        f"average), batch {args.batch}, {args.warmup} warm-up + {args.batches} timed batches, one worker, per mode",
        f"- per size: {args.per_size} generated JPEGs; device batches of {args.device_batch}, best of "
        f"{args.repeats} passes after a warm-up pass",
        f"- 1-min load average before / after (other jobs share the machine): {loads[0]:.2f} / {loads[1]:.2f}",
        f"- command: `python -m benchmarks.bench_decode {' '.join(sys.argv[1:])}`",
    ]


def report(args, device, info, loads, sizes: dict, loaders: dict) -> str:
    lines = [BEGIN, "", f"## Decode on the device (`data.decode: device`), {device.type}", ""]
    lines += [*environment(args, device, info, loads), "", "### Per image, by size", ""]
    lines += [
        f"| JPEG size | KB | worker decode: CPU ms/image | device decode, worker's share: CPU ms/image (header) | "
        f"worker saving | {device.type} decode only: images/s | {device.type} decode + crop + resize + flip: "
        "images/s | host CPU ms per batch |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (width, height), s in sizes.items():
        lines.append(
            f"| {width}x{height} | {s['kb']:.0f} | {s['worker']:.3f} | {s['device']:.3f} ({s['header']:.3f}) | "
            f"{s['worker'] / s['device']:.0f}x | {s['decode_per_s']:.0f} | {s['decode_crops_per_s']:.0f} | "
            f"{s['decode_crops_cpu_ms_per_batch']:.1f} |"
        )
    lines += [
        "",
        "Worker columns: CPU time on one thread in this process (as a DataLoader worker has), best of 3 passes; "
        "the device mode's share is the header read plus torchvision's box and flip draws. Device columns: "
        f"`decode_crops` on batches of {args.device_batch} (its decode alone: `torchvision.io.decode_jpeg` on the "
        "batch's files), wall time with the device synchronised; host CPU ms: the calling process's CPU time per "
        "batch, which on a GPU is the training process's cost (kernel launches, nvJPEG's host phase, any wait).",
        "",
        "### The loader, one worker",
        "",
        "| data.decode | images/s | images per worker CPU-s | KB per sample in /dev/shm |",
        "|---|---:|---:|---:|",
    ]
    for mode, s in loaders.items():
        lines.append(f"| {mode} | {s['per_s']:.0f} | {s['per_cpu_s']:.0f} | {s['kb_per_sample']:.0f} |")
    lines += [
        "",
        "The worker's images/s and CPU: decode (or header), box, batch; not the device step, which the training "
        'process runs. KB per sample: the batch\'s "image" as it crosses from the worker (uint8 crops, or the JPEG '
        "files with their boxes).",
        "",
        END,
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="where the device side runs: cpu, cuda")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the device side (CPU)")
    parser.add_argument("--per-size", type=int, default=64, help="JPEGs generated per size")
    parser.add_argument("--device-batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--images", type=int, default=1024, help="bench_data's JPEGs for the loader")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "mimpipe-bench-decode")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "data.md")
    parser.add_argument("--quick", action="store_true", help="few images, one pass")
    args = parser.parse_args(argv)
    if args.quick:
        args.per_size, args.device_batch, args.repeats, args.images, args.batches, args.warmup = 8, 4, 1, 256, 2, 1
        args.data_dir = args.data_dir.with_name(args.data_dir.name + "-quick")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device, load_before = torch.device(args.device), os.getloadavg()[0]
    sizes = {}
    for size in SIZES:
        jpegs = jpegs_of_size(size, args.per_size, seed=size[0])
        shares = worker_shares(jpegs)
        torch.set_num_threads(args.threads)
        rates = device_rates(jpegs, device, args.device_batch, args.repeats)
        sizes[size] = {"kb": statistics.mean(map(len, jpegs)) / 1024, **shares, **rates}
        print(size, {k: round(v, 3) for k, v in sizes[size].items()}, flush=True)
    info = build_dataset(args.data_dir, args.images, num_classes=8)
    loaders = {mode: loader_rate(args.data_dir, mode, args) for mode in MODES}
    print(loaders, flush=True)
    text = report(args, device, info, (load_before, os.getloadavg()[0]), sizes, loaders)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    replace_section(args.out, text, BEGIN, END)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
