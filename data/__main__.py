"""Command line for shards.

python -m data write --source fashion-mnist --split test --out /data/fm/test --shard-size 2000
python -m data write --source imagefolder --path /data/imagenet/train --out /data/in1k/train --shard-size 5000
Samples are written in a seeded random order (--shuffle-seed, default 0; recorded in index.json), so that every
shard holds every class even when the source lists its samples class by class; --no-shuffle keeps the source order.
python -m data write --source synthetic --num-samples 512 --image-size 32 --out /tmp/syn --shard-size 128
python -m data inspect /data/fm/test          (a directory, a brace pattern or a glob)
"""

import argparse
import io
import itertools
import os
import sys
import tarfile
import time

import webdataset as wds
from PIL import Image

from data import sources
from data.pipeline import IMAGE_EXTENSIONS
from data.specs import dataset_size, resolve_shards
from data.write import INDEX_FILE, read_index, write_shards


def main(argv: list[str] | None = None) -> None:
    """Runs `write` or `inspect` with the given arguments (default: sys.argv)."""
    args = _parser().parse_args(argv)
    if args.command == "write":
        _write(args)
    else:
        print("\n".join(inspect_shards(args.spec, args.num_show)))


def _parser() -> argparse.ArgumentParser:
    """The `write` and `inspect` sub-commands and their options."""
    parser = argparse.ArgumentParser(prog="python -m data", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    write = commands.add_parser("write", help="write a labelled image source as WebDataset shards")
    write.add_argument("--source", required=True, choices=["fashion-mnist", "imagefolder", "synthetic"])
    write.add_argument("--out", required=True, help="output directory (new or without shards/index)")
    write.add_argument("--shard-size", type=int, required=True, help="samples per shard")
    write.add_argument("--split", default="train", help="split name: shard prefix and key prefix")
    write.add_argument("--path", help="fashion-mnist IDX directory or imagefolder root")
    write.add_argument("--limit", type=int, help="write only the first N samples of the order (a random subset)")
    write.add_argument("--shuffle-seed", type=int, default=0, help="seed of the order the samples are written in")
    write.add_argument("--no-shuffle", action="store_true", help="write the samples in the source's own order")
    write.add_argument("--num-samples", type=int, default=1000, help="synthetic: number of images")
    write.add_argument("--image-size", type=int, default=32, help="synthetic: height and width")
    write.add_argument("--num-classes", type=int, default=10, help="synthetic: number of classes")
    write.add_argument("--seed", type=int, default=0, help="synthetic: generator seed")
    inspect = commands.add_parser("inspect", help="summarise shards and decode a few samples")
    inspect.add_argument("spec", help="shard directory, brace pattern or glob")
    inspect.add_argument("--num-show", type=int, default=4, help="samples to decode and print")
    return parser


def _write(args: argparse.Namespace) -> None:
    """Builds the chosen source and writes it; prints a one-line summary."""
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    start = time.perf_counter()
    if args.source == "fashion-mnist":
        source = sources.fashion_mnist(args.path, args.split)
    elif args.source == "imagefolder":
        if not args.path:
            raise ValueError("--source imagefolder needs --path (the class-per-subfolder root)")
        source = sources.image_folder(args.path, args.split)
    else:
        source = sources.synthetic(args.num_samples, args.image_size, args.num_classes, args.seed, args.split)
    shuffle_seed = None if args.no_shuffle else args.shuffle_seed
    order = range(source.num_samples) if args.no_shuffle else sources.shuffled_order(source.num_samples, shuffle_seed)
    index = write_shards(
        source.samples(order[: args.limit]),
        args.out,
        shard_size=args.shard_size,
        split=args.split,
        classes=source.classes,
        source=args.source,
        shuffle_seed=shuffle_seed,
    )
    seconds = time.perf_counter() - start
    print(f"wrote {index['num_samples']} samples in {len(index['shards'])} shards to {args.out} in {seconds:.1f} s")


def inspect_shards(spec: str, num_show: int = 4) -> list[str]:
    """Describes local shards: counts (scanned from the tar headers), index fields and the first samples.

    Args:
        spec: Shard directory, brace pattern, glob or single path (see `resolve_shards`).
        num_show: Number of samples of the first shard to decode and describe.

    Returns:
        Lines of text.
    """
    shards = resolve_shards(spec)
    num_samples = 0
    for shard in shards:
        with tarfile.open(shard) as tar:
            num_samples += len({wds.tariterators.base_plus_ext(name)[0] for name in tar.getnames()})
    directory = os.path.dirname(shards[0])
    index = read_index(directory) if os.path.isfile(os.path.join(directory, INDEX_FILE)) else {}
    classes = index.get("classes", [])
    lines = [
        f"shards: {len(shards)} ({shards[0]} ... {shards[-1]})",
        f"samples: {num_samples} (index.json: {dataset_size(spec)})",
        f"classes ({len(classes)}): {', '.join(classes)}",
        f"image_size: {index.get('image_size')}  source: {index.get('source')}  split: {index.get('split')}  "
        f"shuffle_seed: {index.get('shuffle_seed')}",
    ]
    for sample in itertools.islice(wds.tarfile_samples([{"url": shards[0]}]), num_show):
        ext = next(e for e in IMAGE_EXTENSIONS if e in sample)
        with Image.open(io.BytesIO(sample[ext])) as img:
            image = f"{ext} {img.width}x{img.height} {img.mode}"
        label = int(sample["cls"])
        name = classes[label] if label < len(classes) else "?"
        lines.append(f"  {sample['__key__']}: {image}  label {label} ({name})")
    return lines


if __name__ == "__main__":
    try:
        main()
    except ValueError as exn:
        sys.exit(f"error: {exn}")
