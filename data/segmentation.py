"""Semantic segmentation samples: a class-id mask beside each image.

A segmentation shard holds, per sample `key`, the image (`key.jpg` / `key.png`) and its mask `key.seg.png`: one
class id per pixel (a greyscale or palette PNG, the palette index being the id), `IGNORE_INDEX` (255) where no class
is known. The shard's `index.json` says how many classes there are and which id is ignored (data/write.py). The
transforms that move image and mask together are in data/seg_transforms.py.

Shapes: H/W the stored image's height and width.
"""

import io
from typing import NamedTuple

import numpy as np
from PIL import Image

SEG_FIELD = "seg.png"
"""The sample field of a mask (`key.seg.png` in the tar)."""
IGNORE_INDEX = 255
"""The mask id of pixels that no loss or metric counts (unlabelled, padding)."""
MAX_CLASSES = IGNORE_INDEX
"""Class ids 0..254: masks are 8-bit PNGs and 255 is the ignored id."""
MASK_MODES = ("L", "P")
"""PNG modes a mask may be stored in: 8-bit greyscale, or a palette whose indices are the class ids."""


class SegInfo(NamedTuple):
    """What a segmentation set's index records besides its shards (data/write.py)."""

    num_classes: int | None
    """Class ids 0..num_classes-1; None: one more than the largest id the masks hold (found while writing)."""
    reduce_zero_label: bool
    """Whether the stored ids were shifted down by one, the source's 0 ("other") becoming `IGNORE_INDEX`."""


OTHER_ID = 0
"""In a reduce-zero-label set's own masks (ADE20K's), the id of "other": ignored in training, never predicted."""


def dataset_ids(num_classes: int, reduce_zero_label: bool) -> list[int]:
    """The id each training class (0..num_classes-1) has in the dataset's own masks: k + 1 for a reduce-zero-label set
    (ADE20K's annotations, where 0 is "other"), k otherwise. What the evaluation tools and a downstream user read."""
    shift = 1 if reduce_zero_label else 0
    return [k + shift for k in range(num_classes)]


def check_num_classes(num_classes: int | None, where: str) -> None:
    """Refuses a class count that 8-bit masks cannot hold.

    Raises:
        ValueError: Naming `where` (the option, index or recipe key), for more than `MAX_CLASSES` classes.
    """
    if num_classes is not None and num_classes > MAX_CLASSES:
        raise ValueError(
            f"{where}: {num_classes} classes, but masks are 8-bit PNGs with {IGNORE_INDEX} as the ignored id, so at "
            f"most {MAX_CLASSES} classes (ids 0-{MAX_CLASSES - 1})"
        )


def decode_mask(data: bytes) -> np.ndarray:
    """A stored mask as its class ids, (H, W) uint8.

    Raises:
        ValueError: If the PNG holds colours (RGB) or more than 8 bits per pixel, which are not class ids.
        One of `data.decode.CORRUPT_IMAGE_ERRORS` for bytes that do not decode.
    """
    with Image.open(io.BytesIO(data)) as img:
        if img.mode not in MASK_MODES:
            raise ValueError(f"a mask must be a greyscale or palette PNG of class ids, this one is {img.mode}")
        return np.array(img)  # a palette image's array holds its indices
