"""Writes labelled images as WebDataset tar shards plus an `index.json` that lists them.

Layout of an output directory:
    {split}-000000.tar, {split}-000001.tar, ...   each holding, per sample `key`:
        key.png or key.jpg   the image (PNG is lossless; JPEG inputs are stored unchanged; with `max_side`, an
                             image whose longer side exceeds it is stored downscaled, as JPEG)
        key.cls              the class index as ASCII digits (a classification set)
        key.seg.png          the class id of every pixel, greyscale PNG (a segmentation set, data/segmentation.py)
        key.json             metadata, e.g. {"label": 3, "source_index": 42}
    index.json                {"shards": [{"name", "num_samples"}], "num_samples", "classes", "image_size",
                               "source", "split", "shuffle_seed"[, "segmentation"][, "max_side", "jpeg_quality"]
                               [, "num_skipped"]};
                               written last and atomically, so its presence means every shard it names is complete.
                               `shuffle_seed` is the seed of the order the samples were written in
                               (`data.sources.shuffled_order`), null for the source's own order. A segmentation
                               set's "segmentation" holds {"num_classes", "ignore_index", "reduce_zero_label"}.

Every shard is written under `NAME.tmp` and renamed once the last sample is written, just before `index.json`: a write
stopped by an error (or Ctrl-C) removes every shard it wrote, so it leaves nothing that looks complete and the same
command can run again into the same folder. Samples are checked and encoded by `encode_sample`, in this process or in
`num_workers` forked ones (data/write_workers.py); the tar files are written here, in order, so the shards are the
same bytes either way. With `skip_bad`, a sample whose image is unusable (`data.sources.BadImageError`) is left out
and listed in `skipped.txt` (one line per file: where it is, a tab, why), which `index.json` counts (`num_skipped`).
"""

import contextlib
import functools
import io
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import webdataset as wds
from PIL import ExifTags, Image, ImageOps

from data.decode import CORRUPT_IMAGE_ERRORS, to_rgb
from data.progress import Progress
from data.segmentation import IGNORE_INDEX, SEG_FIELD, SegInfo, check_num_classes
from data.sources import BadImageError, Sample
from data.specs import INDEX_FILE
from data.write_workers import encode_in_workers

DEFAULT_JPEG_QUALITY = 90
"""Quality of the JPEGs a downscaled image is stored as: FFCV's ImageNet setting. On bench_data's photo-like JPEGs at
384 px: 49 KB, 4.9 levels RMS from the downscaled pixels (MAE's targets); 95 takes 1.4x the bytes for 3.6, Pillow's
default of 75 0.6x for 7.2."""

SKIPPED_FILE = "skipped.txt"
"""The samples `skip_bad` left out, beside index.json: one line per file, where it is, a tab, why."""

_JPEG_MAGIC = b"\xff\xd8\xff"
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_JPEG_END = b"\xff\xd9"  # the end-of-image marker
_PNG_END = b"IEND\xaeB`\x82"  # the IEND chunk's type and CRC
_FORMATS = {"jpg": "JPEG", "png": "PNG"}  # by the extension a shard stores them under
_TRANSPOSED = (5, 6, 7, 8)  # EXIF orientations that swap width and height (a 90 or 270 degree turn)


class Encoding(NamedTuple):
    """What `encode_sample` checks and how it stores images: the same in the writing process and in its workers."""

    num_classes: int
    """A classification sample's label must lie in [0, num_classes)."""
    segmentation: SegInfo | None = None
    """A segmentation set: every sample has a mask (and no label)."""
    max_side: int | None = None
    """Downscale an image whose longer side exceeds this (None: store every image as it is)."""
    jpeg_quality: int = DEFAULT_JPEG_QUALITY
    """JPEG quality of a downscaled image."""


class EncodedSample(NamedTuple):
    """A sample as its shard stores it: what a worker process hands back to the writing one."""

    fields: dict[str, Any]
    """`__key__`, the image (`jpg` or `png`), `json`, and `cls` or `seg.png`; webdataset's TarWriter encodes them."""
    size: tuple[int, int]
    """The stored image's (height, width)."""
    largest_id: int
    """A segmentation sample's largest class id; -1 when every pixel is ignored, and for a classification sample."""


class Skipped(NamedTuple):
    """A sample `skip_bad` left out: where its image is and why it is unusable (`BadImageError`)."""

    where: str
    reason: str


def encode_image(
    name: str, image: Image.Image | bytes, max_side: int | None = None, jpeg_quality: int = DEFAULT_JPEG_QUALITY
) -> tuple[str, bytes, tuple[int, int]]:
    """Encodes one image for a shard.

    Args:
        name: How errors name the sample: its file, else its key.
        image: A PIL image (encoded as PNG) or JPEG/PNG bytes (stored unchanged once `check_image_bytes` passes them).
        max_side: An image whose longer side exceeds this is stored downscaled (`downscale`), as a JPEG of
            `jpeg_quality`; one at or under it as without `max_side`.
        jpeg_quality: Quality (1-100) of a downscaled image's JPEG.

    Returns:
        The file extension (`png` or `jpg`), the encoded bytes and the image's (height, width).

    Raises:
        BadImageError: Naming the sample, for bytes that are empty, neither JPEG nor PNG, or that do not decode.
    """
    if isinstance(image, Image.Image):
        ext, width, height = "png", image.width, image.height
    else:
        ext, (width, height) = check_image_bytes(name, image)
    if max_side is not None and max(width, height) > max_side:
        try:
            small = downscale(image, max_side)
        except CORRUPT_IMAGE_ERRORS as exn:
            raise BadImageError(name, f"not a readable image (damaged {_FORMATS[ext]}: {exn})") from exn
        buffer = io.BytesIO()
        small.save(buffer, format="JPEG", quality=jpeg_quality)
        return "jpg", buffer.getvalue(), (small.height, small.width)
    if isinstance(image, Image.Image):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return "png", buffer.getvalue(), (height, width)
    return ext, image, (height, width)


def check_image_bytes(name: str, data: bytes) -> tuple[str, tuple[int, int]]:
    """The extension (`jpg` or `png`) and (width, height) of image bytes to be stored as they are, once known to
    decode as the loaders decode them.

    Bytes whose header reads and that end as their format ends (a JPEG's end-of-image marker, a PNG's IEND chunk)
    are taken as whole without decoding their pixels, which would cost more than the rest of writing them (measured:
    docs/shards.md). The others, a file cut short or one with data after its end, are decoded in full and kept if
    they decode.

    Raises:
        BadImageError: Naming the sample (`name`), for bytes that are empty, neither JPEG nor PNG, or do not decode.
    """
    if not data:
        raise BadImageError(name, "not a readable image (empty file)")
    if data.startswith(_JPEG_MAGIC) or data.startswith(_PNG_MAGIC):
        ext, end = ("jpg", _JPEG_END) if data.startswith(_JPEG_MAGIC) else ("png", _PNG_END)
    else:
        raise BadImageError(name, "not a readable image (neither JPEG nor PNG data)")
    try:
        with Image.open(io.BytesIO(data)) as img:  # reads the header only
            if not data.endswith(end):
                img.load()  # Pillow raises where the loaders would: "image file is truncated"
            return ext, img.size
    except CORRUPT_IMAGE_ERRORS as exn:
        raise BadImageError(name, f"not a readable image (damaged {_FORMATS[ext]}: {exn})") from exn


def downscale(image: Image.Image | bytes, max_side: int) -> Image.Image:
    """An image decoded as the loaders decode it (`data.decode.decode_rgb`: EXIF orientation applied, transparency
    over white; greyscale stays greyscale), its longer side shrunk to `max_side` and its shorter side in proportion
    (rounded, at least 1), with Pillow's bicubic filter, which widens with the reduction: antialiased.

    A JPEG at least twice the target size is first decoded at 1/2, 1/4 or 1/8 by libjpeg (Pillow's draft mode, as
    `Image.thumbnail` does with its default reducing_gap of 2): the filter still sees twice the output's pixels.

    Raises:
        One of `data.decode.CORRUPT_IMAGE_ERRORS` for bytes that do not decode.
    """
    img = Image.open(io.BytesIO(image)) if isinstance(image, bytes) else image
    orientation = img.getexif().get(ExifTags.Base.Orientation, 1)
    width, height = img.size if orientation not in _TRANSPOSED else img.size[::-1]  # as displayed
    scale = max_side / max(width, height)
    target = (max_side, max(1, round(height * scale))) if width >= height else (max(1, round(width * scale)), max_side)
    img.draft(img.mode, (2 * round(img.width * scale), 2 * round(img.height * scale)))  # no-op unless a JPEG
    if orientation != 1:
        img = ImageOps.exif_transpose(img)
    img = img if img.mode == "L" else to_rgb(img)
    return img.resize(target, Image.Resampling.BICUBIC)


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


def encode_sample(sample: Sample | tuple, encoding: Encoding) -> EncodedSample:
    """Checks one sample and encodes it as its shard stores it.

    Raises:
        BadImageError: Naming the sample's file (else its key, and its meta's `path` when it has one) for an image
            `encode_image` refuses.
        ValueError: Naming the sample: a label outside the classes, a key with a dot or slash; for a segmentation set
            a sample without a mask, a mask whose size differs from its image's or with an id outside the classes.
    """
    key, image, label, meta, seg, file = Sample(*sample)
    if encoding.segmentation is None and not (label is not None and 0 <= label < encoding.num_classes):
        raise ValueError(f"sample {key}: label {label} outside [0, {encoding.num_classes})")
    if "." in key or "/" in key:
        raise ValueError(f"sample key {key!r} must not contain '.' or '/' (WebDataset splits names there)")
    name = file or (f"sample {key} ({meta['path']})" if "path" in meta else f"sample {key}")
    ext, data, size = encode_image(name, image, encoding.max_side, encoding.jpeg_quality)
    fields = {"__key__": key, ext: data, "json": meta}
    if encoding.segmentation is None:
        return EncodedSample({**fields, "cls": label}, size, -1)
    fields[SEG_FIELD], top = encode_mask(key, seg, size, encoding.segmentation.num_classes)
    return EncodedSample(fields, size, top)


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
    max_side: int | None = None,
    jpeg_quality: int = DEFAULT_JPEG_QUALITY,
    num_workers: int = 1,
    skip_bad: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Writes samples into `out_dir/{split}-{000000}.tar` shards of `shard_size` samples, then `index.json`.

    Args:
        samples: `(key, image, label, meta)` tuples, or `Sample`s; keys must be unique and free of dots and slashes.
            A sequence that loads each sample when indexed (`Source.select`) is loaded by the workers.
        out_dir: Output directory, created if needed. It must not already hold an index or `{split}-*.tar`.
        shard_size: Samples per shard (the last shard may hold fewer).
        split: Split name, used as the shard file prefix.
        classes: Class names; labels index this list. A segmentation set may give none (its ids are then named
            `class_<id>`).
        source: Where the samples came from, recorded in the index.
        shuffle_seed: The seed of the order `samples` come in, recorded in the index (None: the source's order).
        segmentation: Write a segmentation set: every sample has a mask (`Sample.seg`) and no label.
        max_side: Store an image whose longer side exceeds this downscaled to it, as JPEG (`encode_image`); recorded
            in the index with `jpeg_quality`. Not for a segmentation set.
        jpeg_quality: JPEG quality (1-100) of the downscaled images.
        num_workers: Processes that load (from a sequence) and encode the samples; with more than one, `samples`
            must be a sequence. The shards are the same bytes whatever the number.
        skip_bad: Leave out the samples whose image is unusable (`BadImageError`), list them in `SKIPPED_FILE`
            (written only when there are some) and count them in the index's `num_skipped`.
        progress: Advanced by one per sample written or skipped.

    Returns:
        The index written to `out_dir/index.json`. Its `image_size` is [H, W] as stored, or None when sizes differ.

    Raises:
        BadImageError: Naming the sample's file, for an unusable image (without `skip_bad`).
        ValueError: Naming the sample, as `encode_sample`; for arguments out of range, an output directory that
            already holds shards, or nothing left to write. A write stopped by an error removes every shard it wrote.
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    _check_resize(max_side, jpeg_quality, segmentation)
    if segmentation is not None:
        check_num_classes(segmentation.num_classes or len(classes) or None, f"segmentation set {out_dir}")
    _check_out_dir(out_dir, split)
    if num_workers > 1 and not isinstance(samples, Sequence):
        raise ValueError(f"num_workers={num_workers} needs the samples as a sequence (e.g. Source.select(order))")
    encoding = Encoding(len(classes), segmentation, max_side, jpeg_quality)
    encoded = _encode_all(samples, encoding, num_workers, skip_bad)
    shards, sizes, largest_id, skipped = _write_tars(encoded, out_dir, split, shard_size, progress)
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
    if max_side is not None:
        index.update(max_side=max_side, jpeg_quality=jpeg_quality)
    if skip_bad:
        index["num_skipped"] = len(skipped)
    if skipped:  # sorted by file: the order they were written in is a shuffle
        lines = [f"{s.where}\t{s.reason}\n" for s in sorted(skipped)]
        _write_atomically(os.path.join(out_dir, SKIPPED_FILE), "".join(lines))
    _write_atomically(os.path.join(out_dir, INDEX_FILE), json.dumps(index, indent=1))  # last: the write's commit
    return index


def _encode_all(
    samples: Iterable[Sample | tuple], encoding: Encoding, num_workers: int, skip_bad: bool
) -> Iterator[EncodedSample | Skipped]:
    """The samples encoded in order, by `num_workers` processes (from a sequence, which each loads from) or here."""
    encode = functools.partial(encode_sample, encoding=encoding)
    if isinstance(samples, Sequence):  # loading goes into `encode`, so that `skip_bad` covers a file that won't read
        encode, samples = functools.partial(_load_and_encode, samples, encode), range(len(samples))
    if skip_bad:
        encode = functools.partial(_skip_bad_image, encode)
    return encode_in_workers(samples, encode, num_workers) if num_workers > 1 else map(encode, samples)


def _load_and_encode(samples: Sequence[Sample | tuple], encode: Callable[[Any], EncodedSample], k: int) -> Any:
    return encode(samples[k])


def _skip_bad_image(encode: Callable[[Any], EncodedSample], item: Any) -> EncodedSample | Skipped:
    try:
        return encode(item)
    except BadImageError as err:
        return Skipped(err.where, err.reason)


def _write_atomically(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _check_resize(max_side: int | None, jpeg_quality: int, segmentation: SegInfo | None) -> None:
    """Refuses a `max_side` below 1, a quality outside 1-100, and downscaling a segmentation set."""
    if max_side is None:
        return
    if max_side < 1:
        raise ValueError(f"max_side must be >= 1, got {max_side}")
    if not 1 <= jpeg_quality <= 100:
        raise ValueError(f"jpeg_quality must lie in 1..100, got {jpeg_quality}")
    if segmentation is not None:
        raise ValueError(
            "max_side does not apply to a segmentation set: its masks would have to be resized alongside, and "
            "evaluation compares predictions at the annotation's resolution"
        )


def _check_out_dir(out_dir: str, split: str) -> None:
    """Creates `out_dir`; refuses one that already holds an index or shards of `split`."""
    os.makedirs(out_dir, exist_ok=True)
    clashes = [n for n in os.listdir(out_dir) if n == INDEX_FILE or (n.startswith(f"{split}-") and n.endswith(".tar"))]
    if clashes:
        raise ValueError(f"output directory {out_dir} already holds {sorted(clashes)[0]}; choose an empty directory")


def _write_tars(
    encoded: Iterator[EncodedSample | Skipped], out_dir: str, split: str, shard_size: int, progress: Progress | None
) -> tuple[list[dict[str, Any]], set[tuple[int, int]], int, list[Skipped]]:
    """Writes the encoded samples into shards in order, each under `NAME.tmp`; renames them all once every sample is
    written. Stopped by an error, it removes every shard it wrote.

    Returns:
        The shards' index entries, the image sizes seen, the largest class id of a segmentation set's masks, the
        samples skipped.
    """
    shards: list[dict[str, Any]] = []
    sizes: set[tuple[int, int]] = set()
    largest_id, skipped = -1, []
    writer = None
    try:
        for sample in encoded:
            if progress is not None:
                progress.advance()
            if isinstance(sample, Skipped):
                skipped.append(sample)
                continue
            if writer is not None and shards[-1]["num_samples"] == shard_size:
                writer.close()
                writer = None
            if writer is None:
                shards.append({"name": f"{split}-{len(shards):06d}.tar", "num_samples": 0})
                # An integer mtime avoids a PAX header per member (a float one adds 1 KiB each) and makes shards
                # byte-for-byte reproducible.
                writer = wds.TarWriter(os.path.join(out_dir, shards[-1]["name"] + ".tmp"), mtime=0)
            writer.write(sample.fields)
            shards[-1]["num_samples"] += 1
            sizes.add(sample.size)
            largest_id = max(largest_id, sample.largest_id)
        if writer is None:
            bad = f": all {len(skipped)} images were unusable, e.g. {skipped[0].where} ({skipped[0].reason})"
            raise ValueError(f"no samples to write to {out_dir}{bad if skipped else ''}")
        writer.close()
        writer = None
    except BaseException:  # an error or Ctrl-C: nothing this write made stays
        if writer is not None:
            writer.close()
        for shard in shards:
            with contextlib.suppress(FileNotFoundError):  # the last one, when its file could not be made
                os.remove(os.path.join(out_dir, shard["name"] + ".tmp"))
        raise
    for shard in shards:
        path = os.path.join(out_dir, shard["name"])
        os.replace(path + ".tmp", path)
    return shards, sizes, largest_id, skipped
