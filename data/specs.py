"""Shard specs: what `data.train` and `data.val` name, resolved to shard lists, with their sizes and classes.

A spec is a directory with an `index.json`, a brace pattern, a glob, a single path or URL, or a list of them. A
training spec may instead be a mixture: a list of entries with `shards` (a spec) and `weight`, as `data.train`
holds them (`core.recipe.config.TrainSource`); each becomes one `WeightedShards` source of the training stream.
"""

import glob
import json
import os
from typing import Any, NamedTuple

from core.compat import webdataset as wds_compat
from data.segmentation import check_num_classes

INDEX_FILE = "index.json"
"""The file beside a split's shards that lists them with their sample counts (data/write.py writes it)."""


class WeightedShards(NamedTuple):
    """One source of a training stream: its shards and its sampling weight (relative to the other sources)."""

    shards: list[str]
    weight: float


def read_index(directory: str) -> dict[str, Any]:
    """Loads `directory/index.json`.

    Raises:
        ValueError: If the directory has no index.
    """
    path = os.path.join(directory, INDEX_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"shard directory {directory} has no {INDEX_FILE}")
    with open(path) as f:
        return json.load(f)


def resolve_shards(spec: str | list[str] | list[Any]) -> list[str]:
    """Turns a shard spec into the list of shard paths or URLs.

    Args:
        spec: A directory with an `index.json`; a brace pattern such as `dir/train-{000000..000127}.tar`;
            a glob such as `dir/train-*.tar`; a single path; a list of paths/URLs; or a mixture (see
            `train_sources`), whose shards are those of all its sources.

    Returns:
        The shards, in index / brace / sorted-glob / list order (a mixture: source after source).

    Raises:
        ValueError: If a local shard does not exist or a pattern matches nothing.
    """
    if is_mixture(spec):
        return [shard for source in train_sources(spec) for shard in source.shards]
    if isinstance(spec, list | tuple):
        shards = [str(s) for s in spec]
    elif os.path.isdir(spec):
        if not os.path.isfile(os.path.join(spec, INDEX_FILE)):
            raise ValueError(
                f"shard directory {spec} has no {INDEX_FILE}: write one with `python -m data index {spec}`, or give "
                "a brace pattern or glob of its shards"
            )
        shards = [os.path.join(spec, s["name"]) for s in read_index(spec)["shards"]]
    elif any(c in spec for c in "*?["):
        shards = sorted(glob.glob(spec))
    else:
        shards = wds_compat.expand_urls(spec)
    missing = [s for s in shards if not _is_url(s) and not os.path.isfile(s)]
    if not shards or (missing and len(missing) == len(shards) and shards != [spec]):
        raise ValueError(f"shard spec {spec} matches no files")
    if missing:
        raise ValueError(f"shard {missing[0]} (from shard spec {spec}) does not exist")
    return shards


def dataset_size(spec: str | list[str] | list[Any]) -> int | None:
    """Total number of samples in the shards of `spec`, from the `index.json` beside them.

    Returns:
        The sum of the shards' `num_samples`; None when some shard is not listed in an index, or for a mixture
        (which has no size of its own: `data.samples_per_epoch` says what an epoch is).
    """
    if is_mixture(spec):
        return None
    shards = resolve_shards(spec)
    if isinstance(spec, str) and os.path.isdir(spec):  # its index lists these shards, which may lie in other folders
        return read_index(spec)["num_samples"]
    counts: dict[str, int] = {}
    for directory in {os.path.dirname(s) for s in shards}:
        if os.path.isfile(os.path.join(directory, INDEX_FILE)):
            for entry in read_index(directory)["shards"]:
                counts[os.path.join(directory, entry["name"])] = entry["num_samples"]
    if not all(s in counts for s in shards):
        return None
    return sum(counts[s] for s in shards)


def shard_sizes(shards: list[str]) -> list[int] | None:
    """Samples in each shard, from the `index.json` files beside them; None when some shard is not listed."""
    counts: dict[str, int] = {}
    for directory in {os.path.dirname(s) for s in shards}:
        if os.path.isfile(os.path.join(directory, INDEX_FILE)):
            for entry in read_index(directory)["shards"]:
                counts[os.path.join(directory, entry["name"])] = entry["num_samples"]
    return [counts[s] for s in shards] if all(s in counts for s in shards) else None


def sample_quotas(shards: list[str], max_samples: int) -> list[int]:
    """How many samples to take from the start of each shard so that `max_samples` are taken in all.

    Each shard's share is proportional to its size in index.json (largest remainders round up, ties in shard order),
    so every shard contributes; without an index every shard gets an equal share, and shards smaller than their share
    give fewer samples. The quotas depend on the shards alone, not on how ranks or workers split them.

    Raises:
        ValueError: If `max_samples` < 1.
    """
    if max_samples < 1:
        raise ValueError(f"max_samples must be >= 1, got {max_samples}")
    sizes = shard_sizes(shards)
    if sizes is None:
        return [max_samples // len(shards) + int(i < max_samples % len(shards)) for i in range(len(shards))]
    total = sum(sizes)
    if max_samples >= total:
        return sizes
    exact = [max_samples * size / total for size in sizes]
    quotas = [int(share) for share in exact]
    by_remainder = sorted(range(len(shards)), key=lambda i: (quotas[i] - exact[i], i))  # largest remainder first
    for i in by_remainder[: max_samples - sum(quotas)]:
        quotas[i] += 1
    return quotas


def dataset_classes(spec: str | list[str] | list[Any]) -> list[str]:
    """Class names from the `index.json` of `spec`'s folder, else beside its first shard ([] when there is none).

    Raises:
        ValueError: If two sources of a mixture list different classes.
    """
    if is_mixture(spec):
        listed = [(source.shards, names) for source in spec if (names := dataset_classes(source.shards))]
        for shards, names in listed[1:]:
            if names != listed[0][1]:
                raise ValueError(
                    f"mixture sources {listed[0][0]} and {shards} list different classes in their index.json "
                    f"({len(listed[0][1])} and {len(names)}, {listed[0][1][:3]} and {names[:3]} first); their "
                    "labels would mean different things"
                )
        return listed[0][1] if listed else []
    return list(split_index(spec)[1].get("classes") or [])


def split_index(spec: str | list[str]) -> tuple[str, dict[str, Any]]:
    """The path of the index.json of a split (in the spec's folder, else beside its first shard) and its contents,
    {} when there is none."""
    is_folder = isinstance(spec, str) and os.path.isdir(spec)
    directory = spec if is_folder else os.path.dirname(resolve_shards(spec)[0])
    path = os.path.join(directory, INDEX_FILE)
    return path, read_index(directory) if os.path.isfile(path) else {}


def is_synthetic(spec: str | list[str] | list[Any]) -> bool:
    """Whether the shards of `spec` (any source of a mixture) hold synthetic images (`python -m data write --source
    synthetic`, the quickstart's fallback), as their index.json says; False where no index says so."""
    entries = spec if isinstance(spec, list | tuple) else []  # a mixture: TrainSource objects, or their dumped mappings
    sources = [
        e["shards"] if isinstance(e, dict) else e.shards for e in entries if isinstance(e, dict) or is_mixture([e])
    ]
    specs = sources or [spec]
    try:
        return any(split_index(one)[1].get("source") == "synthetic" for one in specs)
    except (ValueError, OSError):  # remote or unresolvable shards: their own checks say why
        return False


def segmentation_info(spec: str | list[str] | list[Any]) -> dict[str, Any]:
    """A segmentation set's "num_classes", "ignore_index", "classes" (names) and "reduce_zero_label" (whether its
    ids were shifted down from the dataset's own; an index without the field: False), from the `index.json` of
    `spec`'s folder or beside its first shard (data/write.py writes them; a mixture: its first source's).

    Raises:
        ValueError: Naming the spec, when it has no index.json or its index describes no segmentation set.
    """
    path, index = split_index(spec)
    info = index.get("segmentation")
    if not info:
        raise ValueError(
            f"{describe_shards(resolve_shards(spec))}: no segmentation entry in {path}; segmentation trains on "
            "shards with a mask per image (python -m data write --source segfolder or fashion-mnist-scenes)"
        )
    check_num_classes(info["num_classes"], str(path))
    classes = list(index.get("classes") or []) or [f"class_{k}" for k in range(info["num_classes"])]
    return {
        "num_classes": info["num_classes"],
        "ignore_index": info["ignore_index"],
        "classes": classes,
        "reduce_zero_label": bool(info.get("reduce_zero_label", False)),
    }


def train_sources(spec: str | list[str] | list[Any]) -> list[WeightedShards]:
    """The sources of a training stream, with their shards resolved (see `resolve_shards`).

    Args:
        spec: A shard spec, which is one source of weight 1, or a mixture: a list of entries with `shards` (a
            shard spec) and `weight` attributes, as `data.train` holds them (`core.recipe.config.TrainSource`).
    """
    if is_mixture(spec):
        return [WeightedShards(resolve_shards(entry.shards), float(entry.weight)) for entry in spec]
    return [WeightedShards(resolve_shards(spec), 1.0)]


def is_mixture(spec: Any) -> bool:
    """Whether a training spec is a mixture: a list of entries with `shards` and `weight`."""
    return isinstance(spec, list | tuple) and any(hasattr(entry, "shards") for entry in spec)


def describe_shards(shards: list[str]) -> str:
    """A short description of a shard list for error messages."""
    return ", ".join(shards) if len(shards) <= 2 else f"[{shards[0]} ... {shards[-1]}] ({len(shards)} shards)"


def _is_url(shard: str) -> bool:
    """Whether a shard is a URL (`pipe:`, `http://`, `s3://`, ...) rather than a local path."""
    return shard.startswith("pipe:") or "://" in shard
