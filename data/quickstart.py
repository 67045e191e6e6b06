"""The quickstart's shards (`make quickstart-data`, `python -m data quickstart --out shards/quickstart`): Fashion-MNIST
wherever it can be found or downloaded (data/fashion_mnist.py), else synthetic images, said loudly with what was
tried, so that a run on them is never mistaken for a result.

    OUT/train  60,000 Fashion-MNIST training images in 12 shards    (or 20,000 synthetic images in 8)
    OUT/test   10,000 test images in 4 shards                       (or 4,000 in 4)

A split already written from the source chosen now is kept; one written from the other source (synthetic shards
from a machine that has since found the real set, say) is written again.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from data.fashion_mnist import find
from data.specs import INDEX_FILE, read_index

SYNTHETIC_WARNING = "SYNTHETIC images: these numbers say nothing about the method"
"""What a run on synthetic images prints where a person looks (the plan, the end of a stage, TensorBoard, the
export's manifest)."""

SPLITS = {  # source -> split -> the `data write` options beyond --source and --out
    "fashion-mnist": {"train": ["--shard-size", "5000"], "test": ["--shard-size", "2500"]},
    "synthetic": {
        "train": ["--num-samples", "20000", "--image-size", "28", "--num-classes", "10", "--shard-size", "2500"],
        "test": [
            "--num-samples",
            "4000",
            "--image-size",
            "28",
            "--num-classes",
            "10",
            "--seed",
            "1",
            "--shard-size",
            "1000",
        ],
    },  # fmt: skip
}


def write_quickstart(out: Path, path: str | None, write: Callable[[list[str]], None]) -> str:
    """Write the quickstart's train and test shards into `out`; returns the source written ("fashion-mnist" or
    "synthetic").

    Args:
        out: The folder of the two splits.
        path: A Fashion-MNIST folder the user named (--path), or None to look for one (and download it).
        write: `python -m data write` with the given arguments.
    """
    found = find(path, download=True)
    source = "fashion-mnist" if found.path is not None else "synthetic"
    if found.path is None:
        warn(found.tried)
    for split, options in SPLITS[source].items():
        folder = out / split
        written = _written_from(folder)
        if written == source:
            continue
        if written in SPLITS:
            shutil.rmtree(folder)  # the other source's split, written by this command (its index.json says so)
        extra = ["--path", found.path] if found.path is not None else []
        write(["write", "--source", source, "--split", split, "--out", str(folder), *options, *extra])
    return source


def warn(tried: list[str]) -> None:
    """The lines that say why the quickstart falls back to synthetic images."""
    lines = ["WARNING: Fashion-MNIST was not found and could not be downloaded:"]
    lines += [f"WARNING:   {why}" for why in tried]
    lines += [
        "WARNING: the quickstart runs on SYNTHETIC images instead: its numbers say nothing about the method.",
        "WARNING: for the real data: `apt-get install -y dataset-fashion-mnist`, a network for the download, or "
        "MIMPIPE_FASHION_MNIST=DIR naming a folder of its four IDX files.",
    ]
    print("\n".join(lines), file=sys.stderr, flush=True)


def _written_from(folder: Path) -> str | None:
    """The source a quickstart split in `folder` was written from, None when it has no index."""
    if not (folder / INDEX_FILE).is_file():
        return None
    return read_index(str(folder)).get("source")
