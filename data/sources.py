"""Labelled image sources that `data.write` turns into shards.

A source gives random access to its `Sample` tuples `(key, image, label, meta[, seg])`: sample i is keyed
`{split}_{i:08d}` (unique within the split, and the same whatever order it is written in), `image` is a
PIL image or the original JPEG/PNG bytes, `label` indexes the source's class list and `meta` is stored as
the sample's `.json`. Random access lets `python -m data write` write the samples in a seeded random order
(`shuffled_order`) without holding them in memory: sources such as a class-per-folder tree list their samples
class by class, and a stream can only mix what sits near each other in the shards.
"""

import gzip
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
from PIL import Image, ImageDraw, UnidentifiedImageError

from data.decode import CORRUPT_IMAGE_ERRORS, IMAGE_FIELDS
from data.fashion_mnist import ENV as FASHION_MNIST_ENV
from data.fashion_mnist import find as locate_fashion_mnist

FASHION_MNIST_CLASSES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]
IMAGE_EXTENSIONS = tuple(f".{field}" for field in IMAGE_FIELDS)
"""The image files a folder tree is read for: the formats a shard's image field may hold."""

# IDX magic numbers: two zero bytes, the element type (0x08 = unsigned byte), the number of dimensions.
_IDX_LABELS_MAGIC = 0x00000801
_IDX_IMAGES_MAGIC = 0x00000803
_SYNTHETIC_SHAPES = ("disc", "square", "triangle", "cross", "ring", "bars")


class Sample(NamedTuple):
    """One image, ready to be written to a shard: with a class label, or with a segmentation mask."""

    key: str
    image: Image.Image | bytes
    label: int | None
    """The class index; None for a segmentation sample, whose classes are in its mask."""
    meta: dict[str, Any]
    seg: Image.Image | None = None
    """A segmentation sample's mask: greyscale, one class id per pixel (data/segmentation.py)."""
    file: str | None = None
    """The file the image was read from, as the person gave its folder (`--path` joined with its place in it): how
    an error names the sample. Not stored (`meta` holds the path within the folder)."""


class BadImageError(ValueError):
    """A sample whose image cannot be stored: a file that is empty, unreadable, not an image, or damaged.

    `python -m data write --skip-bad` leaves such samples out and lists them; any other bad sample (a label outside
    the classes, a mask that does not fit) still stops the write.

    Args:
        where: The sample's file (`Sample.file`), else `sample KEY (PATH)`.
        reason: What is wrong with it, in the terms of the person who gave the file.
    """

    def __init__(self, where: str, reason: str):
        super().__init__(where, reason)  # both in `args`: the error pickles back from a write worker whole
        self.where, self.reason = where, reason

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


class Source(NamedTuple):
    """A labelled image set: the class names its labels index, and sample i on demand."""

    classes: list[str]
    num_samples: int
    load: Callable[[int], Sample]

    def samples(self, order: Iterable[int] | None = None) -> Iterator[Sample]:
        """The samples in `order` (indices into the source; default: source order), each loaded when reached."""
        return map(self.load, range(self.num_samples) if order is None else order)

    def select(self, order: Sequence[int]) -> "Selection":
        """The samples in `order` as a sequence: item k is sample `order[k]`, loaded when indexed."""
        return Selection(self.load, order)


class Selection(Sequence[Sample]):
    """Samples of a source in a given order, each loaded when indexed, in whichever process indexes it: the worker
    processes of `python -m data write --workers N` share it by index, and load what they encode."""

    def __init__(self, load: Callable[[int], Sample], order: Sequence[int]):
        self.load, self.order = load, order

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, k: int) -> Sample:
        return self.load(self.order[k])

    def __iter__(self) -> Iterator[Sample]:
        return map(self.load, self.order)


def shuffled_order(num_samples: int, seed: int) -> list[int]:
    """A seeded random permutation of range(num_samples): the order `python -m data write` writes a source in."""
    return np.random.default_rng(seed).permutation(num_samples).tolist()


def read_idx(path: str, magic: int) -> np.ndarray:
    """Reads a gzip-compressed IDX file of unsigned bytes (the MNIST format).

    Args:
        path: The `.gz` file.
        magic: The expected magic number (`0x801` for labels, `0x803` for images).

    Returns:
        A uint8 array shaped by the dimensions in the header, e.g. (N, 28, 28) for images.

    Raises:
        ValueError: If the file is missing, has another magic number or is truncated.
    """
    if not os.path.isfile(path):
        raise ValueError(f"IDX file {path} not found; install it with `apt-get install -y dataset-fashion-mnist`")
    with gzip.open(path, "rb") as f:
        raw = f.read()
    found = int.from_bytes(raw[:4], "big")
    if found != magic:
        raise ValueError(f"{path}: IDX magic number {found:#010x}, expected {magic:#010x}")
    num_dims = magic & 0xFF
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=num_dims, offset=4))
    offset = 4 + 4 * num_dims
    if len(raw) - offset != int(np.prod(shape)):
        raise ValueError(f"{path}: {len(raw) - offset} data bytes, header shape {shape} needs {int(np.prod(shape))}")
    return np.frombuffer(raw, dtype=np.uint8, offset=offset).reshape(shape)


def fashion_mnist(path: str | None, split: str, *, download: bool = True) -> Source:
    """Fashion-MNIST from its four IDX files, found where `data.fashion_mnist.find` looks (`path`, the environment,
    Debian's package, the download cache) or, with `download`, downloaded into the cache.

    Args:
        path: Directory holding `{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz`; None to look for one.
        split: `train` (60,000 images) or `test` (10,000 images, the `t10k-*` files).
        download: Download the files when no folder holds them.

    Returns:
        The ten classes and 28x28 grayscale PIL images keyed `{split}_{index:08d}`.

    Raises:
        ValueError: For another split, or when no source holds the files (naming each one and why).
    """
    if split not in ("train", "test"):
        raise ValueError(f"fashion-mnist split must be 'train' or 'test', got {split!r}")
    found = locate_fashion_mnist(path, download=download)
    if found.path is None:
        raise ValueError(
            f"Fashion-MNIST not found: {'; '.join(found.tried)}. Install it (`apt-get install -y "
            f"dataset-fashion-mnist`), give its folder (--path or ${FASHION_MNIST_ENV}), or allow the download"
        )
    root = found.path
    stem = "train" if split == "train" else "t10k"
    images = read_idx(os.path.join(root, f"{stem}-images-idx3-ubyte.gz"), _IDX_IMAGES_MAGIC)  # (N, 28, 28)
    labels = read_idx(os.path.join(root, f"{stem}-labels-idx1-ubyte.gz"), _IDX_LABELS_MAGIC)  # (N,)
    if len(images) != len(labels):
        raise ValueError(f"fashion-mnist {split} in {root}: {len(images)} images but {len(labels)} labels")

    def load(i: int) -> Sample:
        label = int(labels[i])
        return Sample(f"{split}_{i:08d}", Image.fromarray(images[i]), label, {"label": label, "source_index": i})

    return Source(list(FASHION_MNIST_CLASSES), len(images), load)


def image_folder(path: str, split: str) -> Source:
    """A class-per-subfolder tree (`path/<class>/<image>`), classes and files in sorted order (hidden folders skipped).

    JPEG and PNG files are passed on as their original bytes; BMP and WebP are decoded (and stored as PNG). A file
    that cannot be read or decoded raises `BadImageError` when its sample is loaded.

    Args:
        path: The root folder; each subfolder is one class.
        split: Name used in the sample keys.

    Returns:
        The sorted class names and the samples, keyed `{split}_{index:08d}`.
    """
    if not os.path.isdir(path):
        raise ValueError(f"imagefolder path {path} is not a directory")
    classes = sorted(e.name for e in os.scandir(path) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise ValueError(f"imagefolder path {path} has no class subfolders")
    files = [
        (os.path.join(path, name, file), label)
        for label, name in enumerate(classes)
        for file in sorted(os.listdir(os.path.join(path, name)))
        if file.lower().endswith(IMAGE_EXTENSIONS)
    ]

    def load(i: int) -> Sample:
        file, label = files[i]
        meta = {"label": label, "source_index": i, "path": os.path.relpath(file, path)}
        return Sample(f"{split}_{i:08d}", _read_image_file(file), label, meta, file=file)

    return Source(classes, len(files), load)


def _read_image_file(file: str) -> Image.Image | bytes:
    """A JPEG's or PNG's bytes as they are (`data.write.encode_image` checks them); any other image decoded.

    Raises:
        BadImageError: Naming the file, for one that cannot be read, or a BMP or WebP that does not decode.
    """
    try:
        if file.lower().endswith((".jpg", ".jpeg", ".png")):
            with open(file, "rb") as f:
                return f.read()
        with Image.open(file) as img:
            img.load()
            return img
    except CORRUPT_IMAGE_ERRORS as exn:  # OSError includes a file that cannot be opened
        if isinstance(exn, OSError) and exn.filename is not None:  # open(): permission denied, gone, a folder
            raise BadImageError(file, f"cannot be read ({exn.strerror})") from exn
        if os.path.getsize(file) == 0:
            raise BadImageError(file, "not a readable image (empty file)") from exn
        why = "no image format Pillow knows" if isinstance(exn, UnidentifiedImageError) else f"does not decode: {exn}"
        raise BadImageError(file, f"not a readable image ({why})") from exn


def synthetic(num_samples: int, image_size: int, num_classes: int, seed: int, split: str) -> Source:
    """Procedural RGB images a tiny model can learn: each class is its own shape in its own colour.

    Position, size, colour jitter, background and pixel noise vary per sample. Sample `i` depends only on
    `(seed, i)`, so a prefix of a larger synthetic set equals the smaller set.

    Args:
        num_samples: How many images; labels cycle through the classes (`label = i % num_classes`).
        image_size: Height and width in pixels.
        num_classes: Number of classes.
        seed: Seed of the generator.
        split: Name used in the sample keys.

    Returns:
        Class names like `disc_0` and the samples, keyed `{split}_{index:08d}`.
    """
    if num_samples < 1 or image_size < 4 or num_classes < 2:
        raise ValueError(
            f"synthetic needs num_samples >= 1, image_size >= 4, num_classes >= 2; "
            f"got {num_samples}, {image_size}, {num_classes}"
        )
    classes = [f"{_SYNTHETIC_SHAPES[k % len(_SYNTHETIC_SHAPES)]}_{k}" for k in range(num_classes)]

    def load(i: int) -> Sample:
        label = i % num_classes
        image = _draw_synthetic(np.random.default_rng([seed, i]), label, num_classes, image_size)
        return Sample(f"{split}_{i:08d}", image, label, {"label": label, "source_index": i})

    return Source(classes, num_samples, load)


def _draw_synthetic(rng: np.random.Generator, label: int, num_classes: int, size: int) -> Image.Image:
    """Draws class `label`'s shape at a random place and scale over a noisy dark background."""
    background = rng.integers(0, 60, size=3)
    image = Image.new("RGB", (size, size), tuple(int(c) for c in background))
    hue = 360 * label // num_classes + int(rng.integers(-8, 9))
    colour = Image.new("HSV", (1, 1), (hue % 360 * 255 // 360, 220, 255)).convert("RGB").getpixel((0, 0))
    extent = rng.uniform(0.45, 0.85) * size
    x0, y0 = rng.uniform(0, size - extent, size=2)
    box = (x0, y0, x0 + extent, y0 + extent)
    draw = ImageDraw.Draw(image)
    shape = _SYNTHETIC_SHAPES[label % len(_SYNTHETIC_SHAPES)]
    width = max(1, round(extent / 5))
    if shape == "disc":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    elif shape == "triangle":
        draw.polygon([(x0, y0 + extent), (x0 + extent, y0 + extent), (x0 + extent / 2, y0)], fill=colour)
    elif shape == "cross":
        draw.line((x0, y0, x0 + extent, y0 + extent), fill=colour, width=width)
        draw.line((x0, y0 + extent, x0 + extent, y0), fill=colour, width=width)
    elif shape == "ring":
        draw.ellipse(box, outline=colour, width=width)
    else:
        for k in range(3):
            top = y0 + k * extent * 0.4
            draw.rectangle((x0, top, x0 + extent, top + extent * 0.2), fill=colour)
    pixels = np.asarray(image, dtype=np.int16) + rng.integers(-12, 13, size=(size, size, 3))  # (H, W, 3)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
