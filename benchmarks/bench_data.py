"""The data path at 224 px: images/s per DataLoader worker for MAE's pretraining transform (RandomResizedCrop 224 at
scale 0.2-1, bicubic; horizontal flip; to tensor; normalise) on generated ImageNet-like JPEGs, three ways:

- `imagefolder`: torchvision `ImageFolder` + `DataLoader` with torchvision's transforms (its PIL path);
- `ours-old`: our loader (`data.pipeline.make_train_loader` over WebDataset shards of the same JPEGs) with the same
  torchvision transforms, each image decoded by `data.decode.decode_rgb`;
- `ours-new`: our loader with `data.transforms.pretrain_transform` (`CropFlip`: torchvision's box and flip, torch's
  uint8 resize, uint8 out (normalised later, on the device), JPEGs decoded at a DCT reduction when every box allows
  it).

    .venv/bin/python -m benchmarks.bench_data            # 2048 images, 1 and 2 workers, 5 rounds (~10 minutes)
    .venv/bin/python -m benchmarks.bench_data --quick    # 256 images at 1 worker, 1 round: checks that it runs

First, where the time goes: each stage of both transforms timed alone in this process on one thread, and each
loader's whole cost per image with num_workers=0. Then throughput: every (loader, workers) pair is measured once per
round, in reverse order on odd rounds, so that load from other processes falls on all of them alike; each
measurement starts fresh workers, discards `--warmup` batches and times `--batches`. Images per worker CPU-second
(from /proc/<pid>/stat of the workers) is less sensitive to other processes than wall-clock images/s.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter, features
from torch.utils.data import DataLoader
from torchvision import datasets
from torchvision import transforms as T

from data.decode import decode_rgb
from data.pipeline import make_train_loader
from data.transforms import IMAGENET_MEAN, IMAGENET_STD, pretrain_transform
from data.write import write_shards

REPO = Path(__file__).resolve().parents[1]

SIZE, SCALE, SHUFFLE_BUFFER = (
    224,
    (0.2, 1.0),
    1000,
)  # the MAE recipe's crop; core/recipe/config.py's data.shuffle_buffer
# ImageNet's commonest shapes (width, height), weighted: most photos are 500 x 375, some portrait or 3:2.
SHAPES = [(500, 375)] * 6 + [(375, 500)] * 2 + [(500, 333)] * 2
LOADERS = ("imagefolder", "ours-old", "ours-new")
WRITE_SECTION = "<!-- bench_write: begin -->"
"""Where benchmarks/bench_write.py's section of the results file begins."""
APPENDED_SECTIONS = "<!-- bench_"
"""Where the first section other benchmarks append to the results file begins (bench_write's, bench_decode's): a
rerun of this script rewrites what comes before and keeps them."""
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def torchvision_transform() -> T.Compose:
    """The pretraining transform as torchvision's PIL path does it."""
    return T.Compose(
        [
            T.RandomResizedCrop(SIZE, scale=SCALE, interpolation=T.InterpolationMode.BICUBIC),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


# ---------------------------------------------------------------- data: one set of JPEGs, two layouts


def imagenet_like_jpeg(rng: np.random.Generator) -> bytes:
    """A photo-like JPEG at quality 90: smooth colour regions, shapes with edges, texture and sensor-like noise,
    ~100 KB at 500 x 375 like an ImageNet training image (whose entropy sets the cost of a JPEG decode)."""
    width, height = SHAPES[rng.integers(len(SHAPES))]
    coarse = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8))
    image = coarse.resize((width, height), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(image)
    for _ in range(rng.integers(5, 15)):
        x, y = int(rng.integers(0, width)), int(rng.integers(0, height))
        box = (x, y, x + int(rng.integers(10, 200)), y + int(rng.integers(10, 200)))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour)
    pixels = np.asarray(image.filter(ImageFilter.GaussianBlur(1.5)), dtype=np.float32)  # (H, W, 3)
    texture = Image.fromarray((rng.normal(128, 30, (height // 2, width // 2))).clip(0, 255).astype(np.uint8))
    grain = np.asarray(texture.resize((width, height), Image.Resampling.BILINEAR), dtype=np.float32) - 128
    pixels += grain[..., None] + rng.normal(0, 14, pixels.shape)
    buffer = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def build_dataset(root: Path, num_images: int, num_classes: int) -> dict:
    """Writes the JPEGs as an ImageFolder tree (`root/folder/cNN/*.jpg`) and as shards (`root/shards`), once."""
    info_path = root / "dataset.json"
    if info_path.is_file() and json.loads(info_path.read_text())["num_images"] == num_images:
        for path in root.rglob("*.*"):  # into the page cache, so that neither loader waits for the disk
            path.read_bytes()
        return json.loads(info_path.read_text())
    rng, samples, sizes = np.random.default_rng(0), [], []
    for i in range(num_images):
        data, label = imagenet_like_jpeg(rng), i % num_classes
        folder = root / "folder" / f"c{label:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:06d}.jpg").write_bytes(data)
        samples.append((f"img{i:06d}", data, label, {}))
        sizes.append(len(data))
    classes = [f"c{k:02d}" for k in range(num_classes)]
    write_shards(samples, str(root / "shards"), shard_size=256, split="train", classes=classes, source="bench")
    info = {"num_images": num_images, "num_classes": num_classes, "mean_kb": statistics.mean(sizes) / 1024}
    info_path.write_text(json.dumps(info))
    return info


def make_loader(name: str, root: Path, num_workers: int, batch: int, seed: int) -> DataLoader:
    if name == "imagefolder":
        dataset = datasets.ImageFolder(str(root / "folder"), transform=torchvision_transform())
        generator = torch.Generator().manual_seed(seed)
        return DataLoader(
            dataset,
            batch_size=batch,
            shuffle=True,
            drop_last=True,
            num_workers=num_workers,
            pin_memory=torch.cuda.is_available(),
            generator=generator,
        )
    transform = torchvision_transform() if name == "ours-old" else pretrain_transform(SIZE, IMAGENET_MEAN, IMAGENET_STD)
    shards = sorted(str(p) for p in (root / "shards").glob("train-*.tar"))
    return make_train_loader(
        shards,
        transform=transform,
        batch_size=batch,
        seed=seed,
        rank=0,
        world_size=1,
        num_workers=num_workers,
        shuffle_buffer=SHUFFLE_BUFFER,
    )


# ---------------------------------------------------------------- where the time goes (one thread, in process)


def per_image_ms(step: Callable[[int], object], count: int, repeats: int = 3) -> float:
    """CPU milliseconds per call of step(i) for i < count, the best of `repeats` passes (CPU time rather than wall
    time: other processes on the machine delay a step but hardly change its CPU time)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for i in range(count):
            step(i)
        best = min(best, (time.process_time() - start) / count)
    return best * 1e3


def stage_profile(root: Path, count: int, batch: int) -> list[tuple[str, str, float]]:
    """(path, stage, ms per image) for each stage alone, then each loader's whole cost with num_workers=0."""
    torch.set_num_threads(1)  # as in a DataLoader worker
    files = sorted((root / "folder").rglob("*.jpg"))[:count]
    raw = [f.read_bytes() for f in files]
    old, new = torchvision_transform(), pretrain_transform(SIZE, IMAGENET_MEAN, IMAGENET_STD)
    crop, flip, to_tensor, normalise = old.transforms
    decoded = [decode_rgb(b) for b in raw]
    cropped = [crop(im) for im in decoded]
    tensors = [to_tensor(im) for im in cropped]
    reduced = [new.decode(b) for b in raw]
    outputs = [new(r) for r in reduced]
    rows = [
        ("ImageFolder", "read the file", per_image_ms(lambda i: files[i].read_bytes(), count)),
        ("both", "decode JPEG (Pillow, full size)", per_image_ms(lambda i: decode_rgb(raw[i]), count)),
        ("torchvision", "RandomResizedCrop (Pillow bicubic)", per_image_ms(lambda i: crop(decoded[i]), count)),
        ("torchvision", "flip", per_image_ms(lambda i: flip(cropped[i]), count)),
        ("torchvision", "ToTensor", per_image_ms(lambda i: to_tensor(cropped[i]), count)),
        ("torchvision", "Normalize", per_image_ms(lambda i: normalise(tensors[i].clone()), count)),
        ("new", "decode (`CropFlip.decode`)", per_image_ms(lambda i: new.decode(raw[i]), count)),
        ("new", "box, to uint8 tensor, resize, flip", per_image_ms(lambda i: new(reduced[i]), count)),
        ("both", f"collate (stack {batch} images)", per_image_ms(lambda i: torch.stack(outputs[:batch]), 1) / batch),
    ]
    for name in LOADERS:
        batches = iter(make_loader(name, root, 0, batch, seed=0))
        next(batches)  # ours: fills the shuffle buffer
        ms_per_batch = per_image_ms(lambda _, it=batches: next(it), max(2, count // batch))
        rows.append((name, "whole loader, num_workers=0", ms_per_batch / batch))
    return rows


# ---------------------------------------------------------------- throughput with worker processes


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (all cores, every process), from /proc/stat."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


def children_cpu_seconds() -> float:
    """CPU seconds used so far by the live descendants of this process: the DataLoader workers, children of the
    fork server that starts them (data/worker_process.py), and the server."""
    total, pids = 0.0, _children(os.getpid())
    while pids:
        pid = pids.pop()
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
        pids += _children(pid)
    return total


def _children(pid: int) -> list[str]:
    try:
        return [child for task in Path(f"/proc/{pid}/task").glob("*/children") for child in task.read_text().split()]
    except FileNotFoundError:  # the process ended meanwhile
        return []


def measure(name: str, root: Path, num_workers: int, args: argparse.Namespace, seed: int) -> dict:
    """Images/s of one fresh loader over `args.batches` batches after `args.warmup`."""
    batches = iter(make_loader(name, root, num_workers, args.batch, seed))
    for _ in range(args.warmup):
        next(batches)
    own_start, cpu_start, machine_start = time.process_time(), children_cpu_seconds(), busy_cpu_seconds()
    start = time.perf_counter()
    for _ in range(args.batches):
        next(batches)
    wall = time.perf_counter() - start
    workers_cpu = children_cpu_seconds() - cpu_start
    ours = workers_cpu + time.process_time() - own_start
    others = max(0.0, busy_cpu_seconds() - machine_start - ours) / (wall * os.cpu_count())
    del batches  # stops the workers
    images = args.batches * args.batch
    return {"per_s": images / wall, "per_worker_cpu_s": images / workers_cpu, "others": others}


def run_rounds(root: Path, args: argparse.Namespace) -> dict[tuple[str, int], list[dict]]:
    cases = [(name, workers) for workers in args.workers for name in LOADERS]
    runs: dict[tuple[str, int], list[dict]] = {case: [] for case in cases}
    for round_index in range(args.rounds):
        for name, workers in cases if round_index % 2 == 0 else cases[::-1]:
            result = measure(name, root, workers, args, seed=round_index)
            runs[(name, workers)].append(result)
            print(
                f"round {round_index} {name:12s} {workers} workers: {result['per_s'] / workers:7.1f} img/s per "
                f"worker, others' load {result['others']:.0%}",
                flush=True,
            )
    return runs


# ---------------------------------------------------------------- report

IMAGENET_TRAIN = 1_281_167
VIT_L_V100 = IMAGENET_TRAIN * 800 / (42 * 3600) / 64  # images/s per GPU
# Forward GFLOPs per image of MAE at mask ratio 0.75 (encoder on 49 visible patches + cls, the 8-block 512-wide decoder
# on all 197 tokens): ViT-L ~41.2, ViT-B ~19.3. Equal GPU efficiency assumed, which flatters ViT-B a little.
VIT_B_OVER_L = 41.2 / 19.3
A100_OVER_V100 = 312 / 125  # dense fp16 tensor-core peak TFLOPS; an upper estimate of the training speed-up
GPU_RATES = [
    ("MAE ViT-L/16 on V100", VIT_L_V100, "facebookresearch/mae PRETRAIN.md: ~42 h for 800 epochs on 64 V100"),
    ("MAE ViT-B/16 on V100", VIT_L_V100 * VIT_B_OVER_L, "ViT-L's rate x 2.13, the ratio of forward FLOPs per image"),
    ("MAE ViT-B/16 on A6000", 128 / 0.4084, "Alpha-VL/ConvMAE issue #5: 0.408 s per step of 128 images per GPU"),
    ("MAE ViT-L/16 on A100", VIT_L_V100 * A100_OVER_V100, "V100 rate x 2.5 (fp16 tensor peak 312 / 125 TFLOPS)"),
    ("MAE ViT-B/16 on A100", VIT_L_V100 * VIT_B_OVER_L * A100_OVER_V100, "V100 rate x 2.5"),
]


def summarize(runs: dict[tuple[str, int], list[dict]]) -> dict[tuple[str, int], dict]:
    """Medians per case, and each case's per-round ratio to ImageFolder at the same worker count."""
    stats = {}
    for (name, workers), results in runs.items():
        reference = runs[("imagefolder", workers)]
        ratios = [r["per_s"] / ref["per_s"] for r, ref in zip(results, reference, strict=True)]
        cpu_ratios = [
            r["per_worker_cpu_s"] / ref["per_worker_cpu_s"] for r, ref in zip(results, reference, strict=True)
        ]
        stats[(name, workers)] = {
            "per_s": statistics.median(r["per_s"] for r in results),
            "per_worker": [r["per_s"] / workers for r in results],
            "per_worker_cpu_s": statistics.median(r["per_worker_cpu_s"] for r in results),
            "ratio": statistics.median(ratios),
            "cpu_ratio": statistics.median(cpu_ratios),
            "others": max(r["others"] for r in results),
        }
    return stats


def throughput_table(stats: dict[tuple[str, int], dict]) -> list[str]:
    lines = [
        "| loader | workers | images/s | per worker | per worker, each round | images per worker CPU-s | "
        "vs ImageFolder (wall / CPU) | others' load (max) |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for (name, workers), s in stats.items():
        rounds = " / ".join(f"{v:.0f}" for v in s["per_worker"])
        lines.append(
            f"| {name} | {workers} | {s['per_s']:.0f} | {statistics.median(s['per_worker']):.0f} | {rounds} | "
            f"{s['per_worker_cpu_s']:.0f} | {s['ratio']:.2f} / {s['cpu_ratio']:.2f} | {s['others']:.0%} |"
        )
    return lines


def workers_table(stats: dict[tuple[str, int], dict]) -> list[str]:
    """Workers each GPU needs: its images/s over one worker's (1-worker runs; wall-clock and per CPU-second)."""
    lines = [
        "| GPU throughput | images/s per GPU | source | workers, ImageFolder | workers, ours (new) |",
        "|---|---:|---|---:|---:|",
    ]
    folder, ours = stats[("imagefolder", 1)], stats[("ours-new", 1)]
    for label, rate, source in GPU_RATES:
        need = [
            f"{rate / statistics.median(s['per_worker']):.1f} ({rate / s['per_worker_cpu_s']:.1f})"
            for s in (folder, ours)
        ]
        lines.append(f"| {label} | {rate:.0f} | {source} | {need[0]} | {need[1]} |")
    return lines


def environment(args: argparse.Namespace, info: dict, loads: tuple) -> list[str]:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")
    versions = ", ".join(f"{p} {version(p)}" for p in ("torch", "torchvision", "pillow", "numpy", "webdataset"))
    return [
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"- CPU: {cpu}, {os.cpu_count()} cores visible; torch CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}; libjpeg-turbo {features.version('libjpeg_turbo')}",
        f"- {versions}, python {platform.python_version()}",
        f"- data: {info['num_images']} generated JPEGs (quality 90, mostly 500x375, some 375x500 and 500x333, "
        f"{info['mean_kb']:.0f} KB on average), {info['num_classes']} classes; the same files as an ImageFolder tree "
        f"and as shards of 256",
        f"- batch {args.batch}; per measurement {args.warmup} warm-up + {args.batches} timed batches with fresh "
        f"workers; {args.rounds} interleaved rounds; our loader with shuffle buffer {SHUFFLE_BUFFER}",
        f"- malloc: {args.malloc} (launch.sh preloads tcmalloc for training; DataLoader workers inherit it)",
        f"- 1-min load average before / after: {loads[0]:.2f} / {loads[1]:.2f}",
        f"- command: `python -m benchmarks.bench_data {' '.join(sys.argv[1:])}`",
    ]


THROUGHPUT_NOTES = [
    "images/s: whole loader, median over rounds; per worker: that over the worker count, median, and each round's "
    "value. images per worker CPU-s: images over the CPU time the workers used, median (less sensitive to other "
    "processes than wall time, which they delay). vs ImageFolder: median over rounds of each round's ratio to the "
    "ImageFolder loader with as many workers (wall-clock images/s, then images per worker CPU-second). others' "
    "load: share of the machine's CPU time that other processes used while timing, the worst round; with 2 cores, "
    "2 workers and the main process already fill the machine.",
]
WORKERS_NOTES = [
    "Workers one GPU needs to be fed at its published MAE pretraining rate: that rate over one worker's images/s "
    "(1-worker runs above; in brackets over images per worker CPU-second, what a worker with a core to itself "
    "would do). ImageNet-1k has 1,281,167 training images. A worker needs a core of its own: on a GPU host, add "
    "one core per GPU for the training process.",
]


def report(args, info, loads, stages, stats) -> str:
    lines = ["# Data path at 224 px", "", *environment(args, info, loads), "", "## Where the time goes", ""]
    lines += [
        "CPU time on one thread in this process, best of 3 passes over the first images; each loader with "
        "num_workers=0, best of 3 passes of as many images.",
        "",
        "| path | stage | CPU ms per image |",
        "|---|---|---:|",
    ]
    lines += [f"| {path} | {stage} | {ms:.3f} |" for path, stage, ms in stages]
    lines += ["", "## Images/s per worker", "", *throughput_table(stats), "", *THROUGHPUT_NOTES, ""]
    lines += ["## Workers per GPU", "", *workers_table(stats), "", *WORKERS_NOTES, ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=2048, help="JPEGs to generate")
    parser.add_argument("--classes", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", type=lambda s: [int(w) for w in s.split(",")], default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=4, help="batches discarded per measurement")
    parser.add_argument("--batches", type=int, default=24, help="batches timed per measurement")
    parser.add_argument("--profile-images", type=int, default=256, help="images in the stage profile")
    parser.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "mimpipe-bench-data")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "data.md")
    parser.add_argument("--malloc", choices=["tcmalloc", "glibc"], default="tcmalloc", help="as launch.sh preloads it")
    parser.add_argument("--quick", action="store_true", help="256 images, 1 worker, 1 round, 2 + 2 batches")
    args = parser.parse_args(argv)
    if args.quick:
        args.images, args.workers, args.rounds, args.warmup, args.batches, args.profile_images = 256, [1], 1, 2, 2, 64
        args.data_dir = args.data_dir.with_name(args.data_dir.name + "-quick")
    if (args.warmup + args.batches) * args.batch > args.images:
        parser.error("--images must cover --warmup + --batches batches: ImageFolder's loader ends with its epoch")
    return args


def preload_tcmalloc(module: str = "benchmarks.bench_data") -> None:
    """Runs `python -m module` again with this process's arguments and tcmalloc preloaded, as launch.sh runs training
    (the workers inherit it)."""
    library = Path(f"/usr/lib/{platform.machine()}-linux-gnu/libtcmalloc_minimal.so.4")
    preloaded = os.environ.get("LD_PRELOAD", "")
    if "tcmalloc" in preloaded:
        return
    if not library.is_file():
        sys.exit(f"{library} is not installed (Debian: libtcmalloc-minimal4); use --malloc glibc")
    env = {**os.environ, "LD_PRELOAD": f"{library}:{preloaded}" if preloaded else str(library)}
    os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], env)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.malloc == "tcmalloc":
        preload_tcmalloc()
    info = build_dataset(args.data_dir, args.images, args.classes)
    load_before = os.getloadavg()[0]
    stages = stage_profile(args.data_dir, args.profile_images, args.batch)
    for path, stage, ms in stages:
        print(f"{path:12s} {stage:48s} {ms:7.3f} ms/image", flush=True)
    stats = summarize(run_rounds(args.data_dir, args))
    text = report(args, info, (load_before, os.getloadavg()[0]), stages, stats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    kept = args.out.read_text() if args.out.is_file() else ""
    kept = kept[kept.index(APPENDED_SECTIONS) :] if APPENDED_SECTIONS in kept else ""
    args.out.write_text(text + "\n" + ("\n" + kept if kept else ""))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
