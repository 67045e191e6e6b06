"""Command line for shards.

python -m data write --source fashion-mnist --split test --out /data/fm/test --shard-size 2000
python -m data write --source imagefolder --path /data/imagenet/train --out /data/in1k/train --shard-size 5000
    [--skip-bad]           (leave out the files that are not usable images, listed in OUT/skipped.txt)
python -m data write --source imagefolder --path /data/imagenet/train --out /data/in1k-384/train --max-side 384 \
    --workers 15           (images stored with their longer side at most 384 px, 15 processes: docs/shards.md)
Samples are written in a seeded random order (--shuffle-seed, default 0; recorded in index.json), so that every
shard holds every class even when the source lists its samples class by class; --no-shuffle keeps the source order.
python -m data write --source synthetic --num-samples 512 --image-size 32 --out /tmp/syn --shard-size 128
python -m data write --source segfolder --path /data/ADEChallengeData2016 --split val --out /data/ade/val
python -m data write --source fashion-mnist-scenes --split train --num-samples 4000 --out /data/scenes/train
Segmentation sets hold a mask beside each image (data/segmentation.py); ADE20K's 0 ("other") becomes the ignored id
and the other ids move down by one unless --no-reduce-zero-label.
python -m data quickstart --out shards/quickstart   (Fashion-MNIST found or downloaded; else synthetic, loudly)
python -m data inspect /data/fm/test          (a directory, a brace pattern or a glob)
python -m data index '/data/laion/{00000..00127}.tar' [--label-field label]   (shards other tools wrote)
An error is one line on stderr naming what to change, and exit code 2 (as argparse's own), no traceback.
"""

import argparse
import io
import itertools
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import numpy as np
import webdataset as wds
from PIL import Image

from core.compat.closed_pipe import quiet_on_closed_pipe
from data import seg_sources, sources
from data.decode import CORRUPT_IMAGE_ERRORS, LabelError, decode_rgb, image_field, read_label
from data.index import index_shards, local_shards, shard_samples
from data.progress import Progress
from data.quickstart import write_quickstart
from data.segmentation import IGNORE_INDEX, SEG_FIELD, SegInfo, decode_mask
from data.sources import BadImageError
from data.specs import INDEX_FILE, dataset_size, read_index
from data.write import DEFAULT_JPEG_QUALITY, SKIPPED_FILE, write_shards

SOURCES = ["fashion-mnist", "imagefolder", "synthetic", "segfolder", "fashion-mnist-scenes"]
SEGMENTATION_SOURCES = ("segfolder", "fashion-mnist-scenes")
DEFAULT_SHARD_SIZE = 1000
"""Samples per shard unless --shard-size says: ~1,000 ImageNet JPEGs are ~110 MB, 1,000 ADE20K pairs ~130 MB."""
EXIT_REFUSED = 2
"""A command refused for its input (a flag, a bad file): argparse's code for a usage error, and launch.sh's."""


def main(argv: list[str] | None = None) -> None:
    """Runs `write`, `index` or `inspect` with the given arguments (default: sys.argv)."""
    args = _parser().parse_args(argv)
    if args.command == "write":
        _write(args)
    elif args.command == "quickstart":
        source = write_quickstart(Path(args.out), args.path, main)
        print(f"quickstart shards in {args.out}: {source}")
    elif args.command == "index":
        _index(args)
    else:
        print("\n".join(inspect_shards(args.spec, args.num_show, label_field=args.label_field)))


def _parser() -> argparse.ArgumentParser:
    """The `write`, `index` and `inspect` sub-commands and their options."""
    parser = argparse.ArgumentParser(prog="python -m data", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    write = commands.add_parser("write", help="write a labelled image source as WebDataset shards")
    write.add_argument("--source", required=True, choices=SOURCES)
    write.add_argument("--out", required=True, help="output directory (new or without shards/index)")
    write.add_argument("--shard-size", type=int, default=DEFAULT_SHARD_SIZE, help="samples per shard (default 1000)")
    write.add_argument("--split", default="train", help="split name: shard prefix and key prefix")
    write.add_argument("--path", help="fashion-mnist IDX directory, imagefolder root or segfolder (ADE20K) root")
    write.add_argument("--limit", type=int, help="write only the first N samples of the order (a random subset)")
    write.add_argument("--shuffle-seed", type=int, default=0, help="seed of the order the samples are written in")
    write.add_argument("--no-shuffle", action="store_true", help="write the samples in the source's own order")
    write.add_argument("--num-samples", type=int, default=1000, help="synthetic and scenes: number of images")
    write.add_argument("--image-size", type=int, default=32, help="synthetic: height and width")
    write.add_argument(
        "--num-classes", type=int, help="synthetic: number of classes (default 10); segfolder: class ids (default: "
        "objectInfo150.txt's, else the largest id in the masks + 1)"
    )  # fmt: skip
    write.add_argument("--seed", type=int, default=0, help="synthetic and scenes: generator seed")
    write.add_argument(
        "--max-side", type=int, metavar="N", help="store an image whose longer side exceeds N downscaled to N (EXIF "
        "orientation applied, aspect kept, antialiased) as JPEG; others as they are; 384 for 224 px (docs/shards.md)"
    )  # fmt: skip
    write.add_argument(
        "--jpeg-quality", type=int, metavar="Q", help=f"JPEG quality of the downscaled images, 1-100 (default "
        f"{DEFAULT_JPEG_QUALITY}: FFCV's ImageNet setting; 95 takes 1.4x the bytes, 75 gives 1.5x the pixel error)"
    )  # fmt: skip
    write.add_argument(
        "--workers", type=int, default=1, metavar="N", help="processes that read and encode the samples (default 1); "
        "the shards are the same bytes whatever the number"
    )  # fmt: skip
    write.add_argument(
        "--skip-bad", action="store_true", help="leave out the files that are not usable images (empty, damaged, not "
        "JPEG or PNG as named) instead of stopping; they are listed in OUT/skipped.txt and counted in index.json"
    )  # fmt: skip
    write.add_argument(
        "--reduce-zero-label", action=argparse.BooleanOptionalAction, default=True,
        help="segfolder: id 0 is 'other', ignored; ids 1.. become 0.. (ADE20K's convention; default on)",
    )  # fmt: skip
    quickstart = commands.add_parser(
        "quickstart", help="the quickstart's Fashion-MNIST shards (found or downloaded; else synthetic, loudly)"
    )
    quickstart.add_argument("--out", required=True, help="folder of the train/ and test/ splits")
    quickstart.add_argument("--path", help="a folder of Fashion-MNIST's four IDX files (default: look, then download)")
    index = commands.add_parser("index", help="write the index.json of shards another tool wrote")
    index.add_argument("spec", nargs="+", help="shard folder (every *.tar), brace pattern, glob, or several paths")
    index.add_argument("--label-field", help="read labels from this integer field of each .json (default: .cls)")
    index.add_argument("--out", help="folder for index.json (default: the shards' folder; needed for several)")
    index.add_argument("--force", action="store_true", help="rewrite an index.json that is already there")
    inspect = commands.add_parser("inspect", help="summarise shards and decode a few samples")
    inspect.add_argument("spec", help="shard directory, brace pattern or glob")
    inspect.add_argument("--num-show", type=int, default=4, help="samples to decode and print")
    inspect.add_argument("--label-field", help="show labels from this integer field of each .json (default: .cls)")
    return parser


def _write(args: argparse.Namespace) -> None:
    """Builds the chosen source and writes it, with progress on stderr; prints a one-line summary."""
    _check_write_args(args)
    start = time.perf_counter()
    source, segmentation = _source(args)
    shuffle_seed = None if args.no_shuffle else args.shuffle_seed
    order = range(source.num_samples) if args.no_shuffle else sources.shuffled_order(source.num_samples, shuffle_seed)
    samples = source.select(order[: args.limit])
    progress = Progress(len(samples), "images", label="data write")
    index = write_shards(
        samples,
        args.out,
        shard_size=args.shard_size,
        split=args.split,
        classes=source.classes,
        source=args.source,
        shuffle_seed=shuffle_seed,
        segmentation=segmentation,
        max_side=args.max_side,
        jpeg_quality=DEFAULT_JPEG_QUALITY if args.jpeg_quality is None else args.jpeg_quality,
        num_workers=args.workers,
        skip_bad=args.skip_bad,
        progress=progress,
    )
    progress.finish()
    seconds = time.perf_counter() - start
    print(
        f"wrote {index['num_samples']} samples in {len(index['shards'])} shards to {args.out} in {seconds:.1f} s "
        f"({index['num_samples'] / seconds:.0f} images/s)"
    )
    if index.get("num_skipped"):
        print(f"skipped {index['num_skipped']} unusable images, listed in {os.path.join(args.out, SKIPPED_FILE)}")


def _check_write_args(args: argparse.Namespace) -> None:
    """Refuses values out of range, naming the flag, and downscaling a segmentation set."""
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    if args.max_side is None:
        if args.jpeg_quality is not None:
            raise ValueError("--jpeg-quality applies to downscaled images only: add --max-side")
        return
    if args.max_side < 1:
        raise ValueError(f"--max-side must be >= 1, got {args.max_side}")
    if args.jpeg_quality is not None and not 1 <= args.jpeg_quality <= 100:
        raise ValueError(f"--jpeg-quality must lie in 1..100, got {args.jpeg_quality}")
    if args.source in SEGMENTATION_SOURCES:
        raise ValueError(
            f"--max-side is refused for --source {args.source}: its masks would have to be resized alongside the "
            "images, and evaluation compares predictions at the annotation's resolution"
        )


def _source(args: argparse.Namespace) -> tuple[sources.Source, SegInfo | None]:
    """The source `--source` names, and for a segmentation source what its index records."""
    roots = {"imagefolder": "the class-per-subfolder root", "segfolder": "the root of images/ and annotations/"}
    if args.source in roots and not args.path:
        raise ValueError(f"--source {args.source} needs --path ({roots[args.source]})")
    if args.source == "fashion-mnist":
        return sources.fashion_mnist(args.path, args.split), None
    if args.source == "imagefolder":
        return sources.image_folder(args.path, args.split), None
    if args.source == "synthetic":
        num_classes = args.num_classes or 10
        return sources.synthetic(args.num_samples, args.image_size, num_classes, args.seed, args.split), None
    if args.source == "segfolder":
        source, info = seg_sources.segfolder(args.path, args.split, reduce_zero_label=args.reduce_zero_label)
        return source, info._replace(num_classes=args.num_classes or info.num_classes)
    return seg_sources.fashion_mnist_scenes(args.path, args.split, args.num_samples, args.seed)


def _index(args: argparse.Namespace) -> None:
    """Indexes the shards of `args.spec`; prints what it found and where the index went."""
    shards = local_shards(args.spec[0] if len(args.spec) == 1 else args.spec, use_index=False)
    progress = Progress(len(shards), "shards", label="data index")
    path, index = index_shards(shards, label_field=args.label_field, out=args.out, force=args.force, progress=progress)
    progress.finish()
    labels = f"{len(index['classes'])} classes from {index['labels_from']}" if index["labels_from"] else "no labels"
    print(
        f"indexed {index['num_samples']} samples in {len(index['shards'])} shards ({labels}; "
        f"without an image: {index['num_without_image']}) -> {path}"
    )
    if index["labels_from"] is None and index["num_without_cls"]:
        print(f"{index['num_without_cls']} of {index['num_samples']} samples have no .cls: no labels recorded")


def inspect_shards(spec: str, num_show: int = 4, *, label_field: str | None = None) -> list[str]:
    """Describes local shards: counts (scanned from the tar headers), samples per class (for a folder, its
    index.json's `label_counts`, else the labels read in that scan), index fields and the first samples.

    Args:
        spec: Shard directory (with an index.json, or every `*.tar` in it), brace pattern, glob or single path.
        num_show: Number of samples of the first shard to decode and describe.
        label_field: Show labels from this integer field of each `.json` instead of `.cls`.

    Returns:
        Lines of text.
    """
    shards = local_shards(spec)
    directory = spec if os.path.isdir(spec) else os.path.dirname(shards[0])
    index = read_index(directory) if os.path.isfile(os.path.join(directory, INDEX_FILE)) else {}
    classes = index.get("classes") or []
    # index.json's label_counts (`data index`) describe its folder's every shard; a pattern may name fewer
    indexed = index.get("label_counts") if os.path.isdir(spec) else None
    scan = _scan(shards, indexed is None and "segmentation" not in index, label_field)
    labels = scan.labels if indexed is None else Counter(dict(enumerate(indexed)))
    skipped = index.get("num_skipped")
    lines = [
        f"shards: {len(shards)} ({shards[0]} ... {shards[-1]})",
        f"samples: {scan.num_samples} (index.json: {dataset_size(spec) if index else None})"
        + (f"; without an image: {scan.num_without_image} (the loaders skip them)" if scan.num_without_image else "")
        + (f"; left out when written: {skipped} ({os.path.join(directory, SKIPPED_FILE)})" if skipped else ""),
        _describe_classes(classes, labels, scan.num_without_label),
        f"image_size: {index.get('image_size')}  source: {index.get('source')}  split: {index.get('split')}  "
        f"shuffle_seed: {index.get('shuffle_seed')}"
        + (f"  max_side: {index['max_side']} (JPEG quality {index['jpeg_quality']})" if "max_side" in index else ""),
    ]
    for sample in itertools.islice(wds.tarfile_samples([{"url": shards[0]}]), num_show):
        lines.append(f"  {sample['__key__']}: {_describe_sample(sample, classes, label_field)}")
    return lines


class _Scan(NamedTuple):
    num_samples: int
    num_without_image: int
    labels: Counter
    num_without_label: int


def _scan(shards: list[str], read_labels: bool, label_field: str | None) -> _Scan:
    """Counts the samples (keys with an image field) and the keys without one; with `read_labels`, the samples per
    label (`.cls`, or `label_field` of each `.json`) and those without a readable label."""
    read = frozenset({"cls" if label_field is None else "json"}) if read_labels else frozenset()
    num_samples = num_without_image = num_without_label = 0
    labels = Counter()
    for sample in (sample for shard in shards for sample in shard_samples(shard, read)):
        if image_field(sample) is None:
            num_without_image += 1
            continue
        num_samples += 1
        if read_labels:
            try:
                labels[read_label(sample, label_field)] += 1
            except LabelError:
                num_without_label += 1
    return _Scan(num_samples, num_without_image, labels, num_without_label)


def _describe_classes(classes: list[str], labels: Counter, num_without_label: int) -> str:
    """`classes (2): cat, dog`; where labels were counted, `classes (2), samples per class: cat: 3, dog: 0`, every
    class listed (a label beyond them by its number), and `; no label: N` when some samples have none."""
    if not labels:
        return f"classes ({len(classes)}): {', '.join(classes)}"
    names = dict(enumerate(classes))
    counts = ", ".join(f"{names.get(k, k)}: {labels[k]}" for k in sorted(set(labels) | set(names)))
    unlabelled = f"; no label: {num_without_label}" if num_without_label else ""
    return f"classes ({len(classes) or len(labels)}), samples per class: {counts}{unlabelled}"


def _describe_sample(sample: dict, classes: list[str], label_field: str | None) -> str:
    """`jpg 64x48 CMYK  label 3 (cat)  other fields: json, txt` (the image's stored mode, its size as decoded), or
    what keeps the loaders from using it."""
    field = image_field(sample)
    others = ", ".join(sorted(name for name in sample if not name.startswith("__") and name != field))
    if field is None:
        return f"no image (skipped by the loaders)  fields: {others}"
    try:
        with Image.open(io.BytesIO(sample[field])) as img:
            mode = img.mode
        rgb = decode_rgb(sample[field])  # its size is after EXIF orientation, as the loaders see it
        image = f"{field} {rgb.width}x{rgb.height} {mode}"
    except CORRUPT_IMAGE_ERRORS as exn:
        image = f"{field} corrupt ({exn}), skipped by the loaders"
    if SEG_FIELD in sample:
        return f"{image}  {_describe_mask(sample[SEG_FIELD], classes)}  other fields: {others or 'none'}"
    try:
        label = read_label(sample, label_field)
        text = f"label {label} ({classes[label] if 0 <= label < len(classes) else '?'})"
    except LabelError:
        text = "no label"
    return f"{image}  {text}  other fields: {others or 'none'}"


def _describe_mask(data: bytes, classes: list[str]) -> str:
    """`mask 96x80: 0 (background) 61%, 3 (Dress) 20%, ignored 0%` (the ids by pixel share, largest first)."""
    try:
        ids = decode_mask(data)
    except CORRUPT_IMAGE_ERRORS as exn:
        return f"mask corrupt ({exn}), skipped by the loaders"
    values, counts = np.unique(ids, return_counts=True)
    shares = sorted(zip(counts.tolist(), values.tolist(), strict=True), reverse=True)
    parts = [
        f"ignored {100 * n / ids.size:.0f}%" if k == IGNORE_INDEX
        else f"{k} ({classes[k] if k < len(classes) else '?'}) {100 * n / ids.size:.0f}%"
        for n, k in shares
    ]  # fmt: skip
    return f"mask {ids.shape[1]}x{ids.shape[0]}: {', '.join(parts)}"


def _command() -> int | str | None:
    """`python -m data ...` as a process: a ValueError is one line on stderr, `python -m data COMMAND: error: ...`
    as argparse words its own, and exit code `EXIT_REFUSED`; no traceback."""
    try:
        main()
    except ValueError as exn:
        command = " ".join(["python -m data", *sys.argv[1:2]])
        hint = "; fix or remove it, or pass --skip-bad" if isinstance(exn, BadImageError) else ""
        print(f"{command}: error: {exn}{hint}", file=sys.stderr, flush=True)
        return EXIT_REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(quiet_on_closed_pipe(_command))  # `| head -1`: no traceback, exit code 141 (core/compat/closed_pipe.py)
