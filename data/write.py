"""Writes labelled images as WebDataset tar shards plus an `index.json` that lists them.

Layout of an output directory:
    {split}-000000.tar, {split}-000001.tar, ...   each holding, per sample `key`:
        key.png or key.jpg   the image (PNG is lossless; JPEG inputs are stored unchanged)
        key.cls              the class index as ASCII digits (a classification set)
        key.seg.png          the class id of every pixel, greyscale PNG (a segmentation set, data/segmentation.py)
        key.json             metadata, e.g. {"label": 3, "source_index": 42}
    index.json                {"shards": [{"name", "num_samples"}], "num_samples", "classes", "image_size",
                               "source", "split", "shuffle_seed"[, "segmentation"]}; written last and atomically,
                               so its presence means every shard it names is complete. `shuffle_seed` is the seed
                               of the order the samples were written in (`data.sources.shuffled_order`),
                               null for the source's own order. A segmentation set's "segmentation" holds
                               {"num_classes", "ignore_index", "reduce_zero_label"}.
"""

import io
import json
import os
from collections.abc import Iterable
from typing import Any

import numpy as np
import webdataset as wds
from PIL import Image

from data.segmentation import IGNORE_INDEX, SEG_FIELD, SegInfo, check_num_classes
from data.sources import Sample
from data.specs import INDEX_FILE

_JPEG_MAGIC = b"\xff\xd8\xff"
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def encode_image(key: str, image: Image.Image | bytes) -> tuple[str, bytes, tuple[int, int]]:
    """Encodes one image for a shard.

    Args:
        key: The sample key, named in errors.
        image: A PIL image (encoded as PNG) or JPEG/PNG bytes (stored unchanged).

    Returns:
        The file extension (`png` or `jpg`), the encoded bytes and the image's (height, width).

    Raises:
        ValueError: If `image` is bytes in another format.
    """
    if isinstance(image, Image.Image):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return "png", buffer.getvalue(), (image.height, image.width)
    if image.startswith(_JPEG_MAGIC):
        ext = "jpg"
    elif image.startswith(_PNG_MAGIC):
        ext = "png"
    else:
        raise ValueError(f"sample {key}: image bytes are neither JPEG nor PNG; pass a PIL image instead")
    with Image.open(io.BytesIO(image)) as img:  # reads the header only
        width, height = img.size
    return ext, image, (height, width)


def write_shards(
    samples: Iterable[Sample | tuple[str, Image.Image | bytes, int, dict[str, Any]]],
    out_dir: str,
    *,
    shard_size: int,
    split: str,
    classes: list[str],
    source: str,
    shuffle_seed: int | None = None,
    segmentation: SegInfo | None = None,
) -> dict[str, Any]:
    """Writes samples into `out_dir/{split}-{000000}.tar` shards of `shard_size` samples, then `index.json`.

    Args:
        samples: `(key, image, label, meta)` tuples, or `Sample`s; keys must be unique and free of dots and slashes.
        out_dir: Output directory, created if needed. It must not already hold an index or `{split}-*.tar`.
        shard_size: Samples per shard (the last shard may hold fewer).
        split: Split name, used as the shard file prefix.
        classes: Class names; labels index this list. A segmentation set may give none (its ids are then named
            `class_<id>`).
        source: Where the samples came from, recorded in the index.
        shuffle_seed: The seed of the order `samples` come in, recorded in the index (None: the source's order).
        segmentation: Write a segmentation set: every sample has a mask (`Sample.seg`) and no label.

    Returns:
        The index written to `out_dir/index.json`. Its `image_size` is [H, W], or None when sizes differ.

    Raises:
        ValueError: Naming the sample: a label outside the classes, a key with a dot or slash; for a segmentation set
            a sample without a mask, a mask whose size differs from its image's or with an id outside the classes.
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    if segmentation is not None:
        check_num_classes(segmentation.num_classes or len(classes) or None, f"segmentation set {out_dir}")
    os.makedirs(out_dir, exist_ok=True)
    clashes = [n for n in os.listdir(out_dir) if n == INDEX_FILE or (n.startswith(f"{split}-") and n.endswith(".tar"))]
    if clashes:
        raise ValueError(f"output directory {out_dir} already holds {sorted(clashes)[0]}; choose an empty directory")
    shards: list[dict[str, Any]] = []
    sizes: set[tuple[int, int]] = set()
    largest_id = -1  # a segmentation set's largest class id (ignored pixels aside)
    writer = None
    for key, image, label, meta, seg in (Sample(*sample) for sample in samples):
        if segmentation is None and not (label is not None and 0 <= label < len(classes)):
            raise ValueError(f"sample {key}: label {label} outside [0, {len(classes)})")
        if "." in key or "/" in key:
            raise ValueError(f"sample key {key!r} must not contain '.' or '/' (WebDataset splits names there)")
        if writer is None or shards[-1]["num_samples"] == shard_size:
            if writer is not None:
                _close_shard(writer, out_dir, shards[-1]["name"])
            shards.append({"name": f"{split}-{len(shards):06d}.tar", "num_samples": 0})
            # An integer mtime avoids a PAX header per member (a float one adds 1 KiB each) and makes shards
            # byte-for-byte reproducible.
            writer = wds.TarWriter(os.path.join(out_dir, shards[-1]["name"] + ".tmp"), mtime=0)
        ext, data, size = encode_image(key, image)
        sizes.add(size)
        fields = {"__key__": key, ext: data, "json": meta}
        if segmentation is None:
            fields["cls"] = label
        else:
            fields[SEG_FIELD], top = encode_mask(key, seg, size, segmentation.num_classes)
            largest_id = max(largest_id, top)
        writer.write(fields)
        shards[-1]["num_samples"] += 1
    if writer is None:
        raise ValueError(f"no samples to write to {out_dir}")
    _close_shard(writer, out_dir, shards[-1]["name"])
    index = {
        "shards": shards,
        "num_samples": sum(s["num_samples"] for s in shards),
        "classes": list(classes),
        "image_size": list(sizes.pop()) if len(sizes) == 1 else None,
        "source": source,
        "split": split,
        "shuffle_seed": shuffle_seed,
    }
    if segmentation is not None:
        num_classes = segmentation.num_classes or largest_id + 1
        index["classes"] = list(classes) or [f"class_{k}" for k in range(num_classes)]
        index["segmentation"] = {
            "num_classes": num_classes,
            "ignore_index": IGNORE_INDEX,
            "reduce_zero_label": segmentation.reduce_zero_label,
        }
    tmp_path = os.path.join(out_dir, INDEX_FILE + ".tmp")
    with open(tmp_path, "w") as f:
        json.dump(index, f, indent=1)
    os.replace(tmp_path, os.path.join(out_dir, INDEX_FILE))
    return index


def encode_mask(key: str, seg: Image.Image | None, size: tuple[int, int], num_classes: int | None) -> tuple[bytes, int]:
    """A segmentation sample's mask as greyscale PNG bytes, and its largest class id (-1 when every pixel is ignored).

    Raises:
        ValueError: Naming the sample, for a missing mask, one whose (height, width) is not the image's `size`, one
            that is not greyscale, or an id at or above `num_classes` (when given) other than the ignore id.
    """
    if seg is None:
        raise ValueError(f"sample {key}: a segmentation set needs a mask for every sample")
    if seg.mode != "L":
        raise ValueError(f"sample {key}: mask is {seg.mode}, expected greyscale (L) class ids")
    if (seg.height, seg.width) != size:
        raise ValueError(f"sample {key}: mask is {seg.width}x{seg.height}, its image {size[1]}x{size[0]}")
    ids = np.unique(np.asarray(seg))
    ids = ids[ids != IGNORE_INDEX]
    top = int(ids.max()) if ids.size else -1
    if num_classes is not None and top >= num_classes:
        raise ValueError(f"sample {key}: mask holds class id {top}, outside [0, {num_classes})")
    buffer = io.BytesIO()
    seg.save(buffer, format="PNG")
    return buffer.getvalue(), top


def _close_shard(writer: wds.TarWriter, out_dir: str, name: str) -> None:
    """Finishes a shard written under a `.tmp` name and moves it to its final name."""
    writer.close()
    path = os.path.join(out_dir, name)
    os.replace(path + ".tmp", path)
