"""Segmentation sources that `python -m data write` turns into shards: an ADE20K-layout folder, and scenes of
Fashion-MNIST garments (real pixels, a small offline set for the quickstart, the tests and the benchmark).

Each sample is a `data.sources.Sample` with no class label and its mask in `seg`: a greyscale image of class ids,
`IGNORE_INDEX` where no class is known.
"""

import os

import numpy as np
from PIL import Image

from data.segmentation import IGNORE_INDEX, MASK_MODES, SegInfo
from data.sources import FASHION_MNIST_CLASSES, Sample, Source, fashion_mnist

ADE20K_NUM_CLASSES = 150
SCENE_CLASSES = ["background", *FASHION_MNIST_CLASSES]
"""The scenes' classes: 0 is the canvas, 1 + k is Fashion-MNIST's class k."""
_ADE20K_SPLITS = {"train": "training", "val": "validation"}
_ADE20K_CLASS_FILE = "objectInfo150.txt"  # tab-separated, a header row, the name in the last column
_GARMENT_THRESHOLD = 40  # a garment's own pixels: its scaled Fashion-MNIST intensity above this (of 255)


def segfolder(root: str, split: str, *, reduce_zero_label: bool = True) -> tuple[Source, SegInfo]:
    """The ADE20K release layout: `root/images/{training,validation}/*.jpg` with
    `root/annotations/{training,validation}/*.png` of the same stem.

    Args:
        root: The release's root folder (ADEChallengeData2016).
        split: "train" (the `training` folders) or "val" (`validation`).
        reduce_zero_label: ADE20K's convention: id 0 means "other" and becomes ignored, ids 1..150 become 0..149.

    Returns:
        The source (classes named from `root/objectInfo150.txt` when it is there and lists as many as the ids) and
        what the index records.

    Raises:
        ValueError: Naming the files: a missing folder, an image without a mask or a mask without an image, a mask
            whose size differs from its image's or that is not a greyscale or palette PNG. Every pair is checked from
            the file headers before anything is written.
    """
    if split not in _ADE20K_SPLITS:
        raise ValueError(f"segfolder split must be one of {sorted(_ADE20K_SPLITS)}, got {split!r}")
    folders = [os.path.join(root, kind, _ADE20K_SPLITS[split]) for kind in ("images", "annotations")]
    for folder in folders:
        if not os.path.isdir(folder):
            raise ValueError(f"segfolder: {folder} is not a directory (the ADE20K layout: images/ and annotations/)")
    images = _by_stem(folders[0], (".jpg", ".jpeg", ".png"))
    masks = _by_stem(folders[1], (".png",))
    _check_pairs(images, masks, folders)
    stems = sorted(images)
    for stem in stems:
        _check_mask_header(images[stem], masks[stem])

    def load(i: int) -> Sample:
        stem = stems[i]
        with open(images[stem], "rb") as f:
            image = f.read()
        with Image.open(masks[stem]) as mask:
            ids = np.array(mask)
        if reduce_zero_label:  # 0 ("other") and 255 (ignored) -> 255; k -> k - 1
            ids = np.where((ids == 0) | (ids == IGNORE_INDEX), IGNORE_INDEX, ids.astype(np.int16) - 1).astype(np.uint8)
        meta = {"source_index": i, "image": os.path.relpath(images[stem], root)}
        meta["mask"] = os.path.relpath(masks[stem], root)
        return Sample(f"{split}_{i:08d}", image, None, meta, Image.fromarray(ids))

    classes = _ade20k_classes(root)
    num_classes = len(classes) if classes else None
    info = SegInfo(num_classes, reduce_zero_label)
    return Source(classes or [], len(stems), load), info


def fashion_mnist_scenes(path: str | None, split: str, num_samples: int, seed: int) -> tuple[Source, SegInfo]:
    """Scenes of 2 to 4 Fashion-MNIST garments on a noisy canvas of 64 to 96 pixels a side, with their masks.

    Each garment is scaled to 24-48 px, dimmed by up to 55% and pasted at a random place (later ones cover earlier
    ones), grey as Fashion-MNIST is, on a dark grey noisy canvas; the mask gives each of its own pixels (its intensity
    above a threshold) the class 1 + its Fashion-MNIST label, and the canvas 0. Sample i depends only on
    (seed, split, i).

    Args:
        path: Fashion-MNIST's IDX folder; None for the default.
        split: "train" (garments of Fashion-MNIST's training images) or "val" (of its test images).
        num_samples: How many scenes.
        seed: Seed of the scenes.
    """
    if split not in ("train", "val"):
        raise ValueError(f"fashion-mnist-scenes split must be 'train' or 'val', got {split!r}")
    if num_samples < 1:
        raise ValueError(f"fashion-mnist-scenes needs num_samples >= 1, got {num_samples}")
    garments = fashion_mnist(path, "train" if split == "train" else "test")
    split_tag = 0 if split == "train" else 1

    def load(i: int) -> Sample:
        rng = np.random.default_rng([seed, split_tag, i])
        image, mask, placed = _draw_scene(rng, garments)
        meta = {"source_index": i, "garments": placed}
        return Sample(f"{split}_{i:08d}", image, None, meta, mask)

    return Source(list(SCENE_CLASSES), num_samples, load), SegInfo(len(SCENE_CLASSES), False)


def _draw_scene(rng: np.random.Generator, garments: Source) -> tuple[Image.Image, Image.Image, list[list[int]]]:
    """One scene: RGB canvas, mask of class ids, and per garment [Fashion-MNIST index, label, x, y, side]."""
    height, width = (int(side) for side in rng.integers(64, 97, size=2))
    background = rng.integers(0, 70)
    noise = rng.integers(-12, 13, size=(height, width, 1))
    canvas = np.clip(background + noise, 0, 255).repeat(3, axis=2)  # (H, W, 3), grey as Fashion-MNIST is
    mask = np.zeros((height, width), dtype=np.uint8)
    placed = []
    for _ in range(int(rng.integers(2, 5))):
        index = int(rng.integers(garments.num_samples))
        sample = garments.load(index)
        side = int(rng.integers(24, 49))
        intensity = np.asarray(sample.image.resize((side, side), Image.Resampling.BILINEAR), dtype=np.float64)
        own = intensity > _GARMENT_THRESHOLD  # (side, side) the garment's own pixels
        gain = rng.uniform(0.45, 1.0)
        y, x = int(rng.integers(0, height - side + 1)), int(rng.integers(0, width - side + 1))
        region = canvas[y : y + side, x : x + side]
        region[own] = (intensity[own, None] * gain).round()
        mask[y : y + side, x : x + side][own] = 1 + sample.label
        placed.append([index, sample.label, x, y, side])
    return Image.fromarray(canvas.astype(np.uint8)), Image.fromarray(mask), placed


def _by_stem(folder: str, extensions: tuple[str, ...]) -> dict[str, str]:
    """{file stem: path} of the files in `folder` with one of `extensions` (any case), hidden files skipped."""
    return {
        os.path.splitext(name)[0]: os.path.join(folder, name)
        for name in os.listdir(folder)
        if name.lower().endswith(extensions) and not name.startswith(".")
    }


def _check_pairs(images: dict[str, str], masks: dict[str, str], folders: list[str]) -> None:
    """Refuses images without a mask and masks without an image, naming up to three of each."""
    for have, lack, where in ((images, masks, folders[1]), (masks, images, folders[0])):
        missing = sorted(set(have) - set(lack))
        if missing:
            names = ", ".join(os.path.basename(have[stem]) for stem in missing[:3])
            raise ValueError(f"segfolder: {len(missing)} files have no counterpart of their name in {where}: {names}")
    if not images:
        raise ValueError(f"segfolder: no images in {folders[0]}")


def _check_mask_header(image_path: str, mask_path: str) -> None:
    """Refuses a mask whose size differs from its image's, or that is not a greyscale or palette PNG."""
    with Image.open(image_path) as image, Image.open(mask_path) as mask:
        if mask.mode not in MASK_MODES:
            raise ValueError(f"segfolder: mask {mask_path} is {mask.mode}, not a greyscale or palette PNG of class ids")
        if mask.size != image.size:
            raise ValueError(
                f"segfolder: mask {mask_path} is {mask.size[0]}x{mask.size[1]} but its image {image_path} is "
                f"{image.size[0]}x{image.size[1]}"
            )


def _ade20k_classes(root: str) -> list[str] | None:
    """ADE20K's 150 class names from `root/objectInfo150.txt` (their first synonym), or None without the file."""
    path = os.path.join(root, _ADE20K_CLASS_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        rows = [line.rstrip("\n").split("\t") for line in f if line.strip()][1:]
    names = [row[-1].split(";")[0].split(",")[0].strip() for row in rows]
    if len(names) != ADE20K_NUM_CLASSES:
        raise ValueError(f"{path} lists {len(names)} classes, ADE20K has {ADE20K_NUM_CLASSES}")
    return names
