"""A fixed number of labelled samples per class, copied from existing shards into new ones (label-efficiency runs:
1% of Fashion-MNIST is 60 images per class, 10% is 600).

The choice is deterministic: the source shards are read in their index order and the first `per_class` samples of
each class are kept. `python -m data write` stores every source in a seeded random order, so these are a random
subset of each class, and the same one on every machine. The kept samples are then written in a seeded random order
(`data.sources.shuffled_order`), so that every output shard holds every class. Image bytes are copied unchanged;
keys stay the source's, and the source key and shard are added to each sample's `.json`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

from data.decode import IMAGE_FIELDS, image_field, read_label
from data.index import local_shards, shard_samples
from data.sources import Sample, shuffled_order
from data.specs import dataset_classes
from data.write import write_shards

_READ = frozenset({*IMAGE_FIELDS, "cls", "json"})  # the fields copied; shard_samples lower-cases names


def first_per_class(
    spec: str | list[str], per_class: int, *, num_classes: int, label_field: str | None = None
) -> list[dict[str, Any]]:
    """The first `per_class` samples of each class 0..num_classes-1, in shard order.

    Args:
        spec: Local shards (a folder with index.json, a brace pattern, a glob or a list), read in that order.
        per_class: Samples to keep per class.
        num_classes: Classes that must each reach `per_class`; a label outside [0, num_classes) is an error.
        label_field: As `data.label_field`: None reads `.cls`, a name that integer field of the `.json`.

    Returns:
        The raw samples kept (fields of bytes, `__key__`, `__url__`), in the order they were read.

    Raises:
        ValueError: If `per_class` < 1, a label is out of range, or a class has fewer than `per_class` samples.
    """
    if per_class < 1:
        raise ValueError(f"per_class must be >= 1, got {per_class}")
    counts = [0] * num_classes
    kept: list[dict[str, Any]] = []
    for sample in _samples(local_shards(spec)):
        label = read_label(sample, label_field)
        if not 0 <= label < num_classes:
            raise ValueError(
                f"sample {sample['__key__']} in shard {sample['__url__']}: label {label} outside [0, {num_classes})"
            )
        if counts[label] < per_class:
            counts[label] += 1
            kept.append(sample)
            if len(kept) == per_class * num_classes:
                return kept
    short = {c: n for c, n in enumerate(counts) if n < per_class}
    raise ValueError(f"shards {spec} hold fewer than {per_class} samples of classes {short} (class: count)")


def write_per_class_subset(
    spec: str,
    out_dir: str,
    per_class: int,
    *,
    num_shards: int = 8,
    seed: int = 0,
    label_field: str | None = None,
) -> dict[str, Any]:
    """Writes `first_per_class` of a shard folder as `num_shards` new shards plus `index.json` in `out_dir`.

    Args:
        spec: A shard folder whose index.json lists its classes.
        out_dir: A new or empty folder.
        per_class: Samples per class.
        num_shards: Output shards (the loader mixes `data.num_open_shards` of them at once).
        seed: Seed of the order the kept samples are written in.
        label_field: As in `first_per_class`.

    Returns:
        The index written (see data/write.py); its `source` names `per_class` and `spec`.
    """
    classes = dataset_classes(spec)
    if not classes:
        raise ValueError(f"shard folder {spec} has no index.json listing its classes")
    kept = first_per_class(spec, per_class, num_classes=len(classes), label_field=label_field)
    order = shuffled_order(len(kept), seed)
    return write_shards(
        (_to_sample(kept[i], label_field) for i in order), out_dir, shard_size=math.ceil(len(kept) / num_shards),
        split="train", classes=classes, source=f"{per_class} per class of {spec}", shuffle_seed=seed,
    )  # fmt: skip


def _samples(shards: list[str]) -> Iterator[dict[str, Any]]:
    """Every sample with an image in `shards`, in order, with its image and label fields read."""
    for shard in shards:
        for sample in shard_samples(shard, _READ):
            if image_field(sample) is not None:
                yield sample


def _to_sample(raw: dict[str, Any], label_field: str | None) -> Sample:
    """A raw sample as `write_shards` takes it: the image bytes unchanged, the source key and shard in its meta."""
    meta = json.loads(raw["json"]) if raw.get("json") else {}
    meta = (meta if isinstance(meta, dict) else {}) | {"source_key": raw["__key__"], "source_shard": raw["__url__"]}
    return Sample(raw["__key__"], raw[image_field(raw)], read_label(raw, label_field), meta)
