"""Indexes shards other tools wrote (img2dataset, LAION, DataComp, CC12M, ImageNet in webdataset form): the
`index.json` that `data/write.py` writes for its own shards, so epochs convert to steps and `inspect` shows counts.

    python -m data index 'shards/laion/{00000..00127}.tar'              -> shards/laion/index.json
    python -m data index /data/in1k-wds/ --label-field label            every *.tar there, labels from each .json

A sample is a key with an image field (`jpg`, `jpeg`, `png`, `webp`, `bmp`, any case); keys without one are counted
apart, as the loaders skip them. Only tar headers and the label fields are read, never the images.
"""

import glob
import json
import os
import re
import tarfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from data.decode import image_field, read_label
from data.progress import Progress
from data.specs import INDEX_FILE, resolve_shards

# As webdataset reads a tar: metadata members `__name__` are skipped, a member `dir/key.ext.more` is field
# `ext.more` of sample `dir/key` (`base_plus_ext`), field names lower-cased, consecutive members of one key grouped.
_META_MEMBER = re.compile(r"__[^/]*__($|/)")
_KEY_AND_FIELD = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")


@dataclass
class ShardCount:
    """What one shard holds: samples (keys with an image field), keys without one, and the labels read."""

    num_samples: int = 0
    num_without_image: int = 0
    num_without_cls: int = 0
    labels: Counter = field(default_factory=Counter)


def local_shards(spec: str | list[str], *, use_index: bool = True) -> list[str]:
    """Local shard paths of a brace pattern, a glob, a list, or a folder: the shards its index.json lists, or every
    `*.tar` in it when it has none or `use_index` is False."""
    is_folder = isinstance(spec, str) and os.path.isdir(spec)
    if is_folder and not (use_index and os.path.isfile(os.path.join(spec, INDEX_FILE))):
        shards = sorted(glob.glob(os.path.join(spec, "*.tar")))
        if not shards:
            raise ValueError(f"shard folder {spec} holds no *.tar files")
        return shards
    shards = resolve_shards(spec)
    remote = [s for s in shards if s.startswith("pipe:") or "://" in s]
    if remote:
        raise ValueError(f"shard {remote[0]} is not a local file; index and inspect read local shards only")
    return shards


def shard_samples(path: str, read: frozenset[str] = frozenset()) -> Iterator[dict[str, Any]]:
    """The samples of a local shard as webdataset groups them, reading the bytes of the fields in `read` only.

    Args:
        path: A local tar shard.
        read: Lower-case field names whose contents are read (e.g. {"cls"}); every other field holds b"".

    Yields:
        Dicts of field -> bytes, plus `__key__` and `__url__` (= path).

    Raises:
        ValueError: If the shard is not a readable tar file, naming it.
    """
    sample: dict[str, Any] | None = None
    try:
        with tarfile.open(path) as tar:
            for member in tar:
                found = _KEY_AND_FIELD.match(member.name)
                if not member.isreg() or _META_MEMBER.match(member.name) or not found:
                    continue
                key, name = found[1], found[2].lower()
                if sample is None or sample["__key__"] != key:
                    if sample is not None:
                        yield sample
                    sample = {"__key__": key, "__url__": path}
                sample[name] = tar.extractfile(member).read() if name in read else b""
    except (tarfile.TarError, OSError, EOFError) as exn:
        raise ValueError(f"cannot read shard {path}: {exn}") from exn
    if sample is not None:
        yield sample


def count_shard(path: str, label_field: str | None) -> ShardCount:
    """Counts a shard's samples and reads their labels: `label_field` of each `.json` when set, else each `.cls`.

    Raises:
        LabelError: With `label_field` set, for a sample whose field is missing or not an integer; without it, for
            a `.cls` that is not an integer.
        ValueError: For a negative label, naming the sample and the shard.
    """
    count = ShardCount()
    for sample in shard_samples(path, frozenset({"cls" if label_field is None else "json"})):
        if image_field(sample) is None:
            count.num_without_image += 1
            continue
        count.num_samples += 1
        if label_field is None and "cls" not in sample:
            count.num_without_cls += 1
            continue
        label = read_label(sample, label_field)
        if label < 0:
            raise ValueError(f"sample {sample['__key__']} in shard {path}: label {label} is negative")
        count.labels[label] += 1
    return count


def index_shards(
    spec: str | list[str],
    *,
    label_field: str | None = None,
    out: str | None = None,
    force: bool = False,
    progress: Progress | None = None,
) -> tuple[str, dict[str, Any]]:
    """Scans local shards and writes their `index.json` (atomically), in `data/write.py`'s format.

    Labels are recorded (`classes` "0".."K-1", `label_counts` per class) when `label_field` is set or every sample
    has a `.cls`.

    Args:
        spec: Shards (see `local_shards`).
        label_field: Read labels from this integer field of each sample's `.json` (as `data.label_field`).
        out: Folder for `index.json` (default: the shards' folder); shard names are relative to it.
        force: Replace an `index.json` already there.
        progress: Advanced by one per shard scanned.

    Returns:
        The path of the index written and its contents; `num_without_image` counts the keys with no image field.

    Raises:
        ValueError: If the shards span several folders and `out` is not given, or an index is there without
            `force`; `LabelError` as in `count_shard`.
    """
    shards = local_shards(spec, use_index=False)  # a folder's shards as they are now
    folders = sorted({os.path.dirname(os.path.abspath(s)) for s in shards})
    if out is None and len(folders) > 1:
        raise ValueError(
            f"shards span {len(folders)} folders ({', '.join(folders[:3])}{' ...' if len(folders) > 3 else ''}); "
            "pass --out FOLDER for the index.json (then data.train: FOLDER)"
        )
    folder = out if out is not None else folders[0]
    path = os.path.join(folder, INDEX_FILE)
    if os.path.exists(path) and not force:
        raise ValueError(f"{path} already exists; pass --force to rewrite it")
    counts = []
    for shard in shards:
        counts.append(count_shard(shard, label_field))
        if progress is not None:
            progress.advance()
    labels = sum((c.labels for c in counts), Counter())
    num_samples = sum(c.num_samples for c in counts)
    labelled = num_samples > 0 and (label_field is not None or not any(c.num_without_cls for c in counts))
    num_classes = max(labels) + 1 if labelled and labels else 0
    index = {
        "shards": [
            {"name": os.path.relpath(os.path.abspath(s), os.path.abspath(folder)), "num_samples": c.num_samples}
            for s, c in zip(shards, counts, strict=True)
        ],
        "num_samples": num_samples,
        "classes": [str(k) for k in range(num_classes)],
        "image_size": None,
        "source": "index",
        "split": None,
        "labels_from": (".cls" if label_field is None else f".json field {label_field}") if labelled else None,
        "label_counts": [labels[k] for k in range(num_classes)] if labelled else None,
        "num_without_image": sum(c.num_without_image for c in counts),
        "num_without_cls": sum(c.num_without_cls for c in counts) if label_field is None else None,
    }
    os.makedirs(folder, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(index, f, indent=1)
    os.replace(path + ".tmp", path)
    return path, index
