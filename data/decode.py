"""Reading one raw WebDataset sample as other tools write them: find its image field, decode any image to RGB,
read its label from `.cls` or from a field of its JSON.

img2dataset, LAION, DataComp and CC12M shards hold `key.jpg` + `key.txt` + `key.json` and no `.cls`; ImageNet in
webdataset form often uses `key.JPEG` + `key.cls`. webdataset 1.0 lower-cases field names as it reads a tar, older
releases and other readers do not, so fields are matched here case-insensitively.
"""

import io
import json
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from PIL import ExifTags, Image, ImageOps

IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp", "bmp")
"""Sample fields that hold an encoded image, in the order they are looked for (any case: `JPEG` is `jpeg`); as
file extensions, the images `python -m data write` reads from a folder tree (`data.sources.IMAGE_EXTENSIONS`)."""

CORRUPT_IMAGE_ERRORS = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)
"""What Pillow raises for undecodable or truncated bytes (UnidentifiedImageError is an OSError)."""

_WHITE = (255, 255, 255)


class LabelError(ValueError):
    """A sample whose label is missing or not an integer; the message names the key, the shard and the field."""


def image_field(sample: dict[str, Any]) -> str | None:
    """The name of the sample's image field as stored (e.g. `JPEG`), or None when it has none."""
    by_lower = {name.lower(): name for name in sample if not name.startswith("__")}
    return next((by_lower[ext] for ext in IMAGE_FIELDS if ext in by_lower), None)


def decode_rgb(data: bytes) -> Image.Image:
    """Decodes encoded image bytes to an RGB image, EXIF orientation applied.

    Transparent pixels (LA, RGBA, P with a transparency entry) are composited over white; 16- and 32-bit
    greyscale (I;16, I) is scaled from its 16-bit range to 8 bits; CMYK and the rest go through Pillow's conversion.

    Raises:
        One of `CORRUPT_IMAGE_ERRORS` for bytes that do not decode.
    """
    return decode_rgb_reduced(data, None).image


class ReducedImage(NamedTuple):
    """An RGB image decoded at 1/`reduction` of its full size (see `decode_rgb_reduced`)."""

    image: Image.Image
    """RGB, ceil(W / reduction) x ceil(H / reduction) pixels."""
    full_size: tuple[int, int]
    """(W, H): the full-size image's width and height, EXIF orientation applied."""
    reduction: int
    """1, 2, 4 or 8: pixel (x, y) of `image` covers pixels [x r, (x + 1) r) x [y r, (y + 1) r) at full size."""


def decode_rgb_reduced(data: bytes, choose_reduction: Callable[[int, int], int] | None) -> ReducedImage:
    """Decodes like `decode_rgb`, a JPEG at a reduced size when `choose_reduction` asks for one.

    libjpeg scales while it decodes (Pillow's draft mode: the inverse DCT of each 8x8 block yields 8 / r pixels),
    which costs a fraction of a full decode. Only JPEGs without an EXIF rotation or mirroring are reduced: for the
    rest the reduced image's pixel grid would not line up with the full-size one after orientation.

    Args:
        data: Encoded image bytes.
        choose_reduction: Maps the full size (width, height) to the reduction wanted, 1, 2, 4 or 8; None for 1.

    Raises:
        One of `CORRUPT_IMAGE_ERRORS` for bytes that do not decode.
    """
    img = Image.open(io.BytesIO(data))  # no `with`: closing an image frees its pixels, and BytesIO holds no file
    full_size, reduction = img.size, 1
    if img.getexif().get(ExifTags.Base.Orientation, 1) != 1:
        img = ImageOps.exif_transpose(img)
        full_size = img.size
    elif choose_reduction is not None and (wanted := choose_reduction(*full_size)) > 1:
        assert wanted in (2, 4, 8), wanted
        # Pillow picks the largest scale whose result is at least the size asked for: W // (W // r) == r here.
        if img.draft(img.mode, (full_size[0] // wanted, full_size[1] // wanted)) is not None:  # None: not a JPEG
            reduction = wanted
    img.load()
    assert img.size == tuple(-(-side // reduction) for side in full_size), (img.size, full_size, reduction)
    return ReducedImage(to_rgb(img), full_size, reduction)


def to_rgb(img: Image.Image) -> Image.Image:
    """Any Pillow mode as RGB (see `decode_rgb`)."""
    if img.mode == "RGB":
        return img
    if img.mode.startswith("I"):  # I;16, I;16B, I;16L, I: 16-bit samples (PNG, TIFF)
        pixels = np.asarray(img, dtype=np.float64) / 257.0
        return Image.fromarray(np.clip(pixels, 0, 255).round().astype(np.uint8)).convert("RGB")
    if img.mode == "F":
        return Image.fromarray(np.clip(np.asarray(img), 0, 255).astype(np.uint8)).convert("RGB")
    if img.mode in ("RGBA", "LA", "PA", "La", "RGBa") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (*_WHITE, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def read_label(sample: dict[str, Any], label_field: str | None) -> int:
    """The sample's integer class label.

    Args:
        sample: A raw sample (fields of bytes, plus `__key__` and `__url__`).
        label_field: None reads the `.cls` field (ASCII digits); a name reads that integer field of the sample's
            `.json`.

    Raises:
        LabelError: If the label is missing or not an integer, naming the key, the shard and the field.
    """
    where = f"sample {sample.get('__key__')} in shard {sample.get('__url__')}"
    if label_field is None:
        raw = _field(sample, "cls")
        if raw is None:
            raise LabelError(
                f"{where} has no .cls label (fields: {', '.join(_names(sample))}); set data.label_field to read "
                "the label from a field of its .json"
            )
        text = raw.decode("utf-8", "replace").strip() if isinstance(raw, bytes) else str(raw).strip()
        if not text.lstrip("-").isdigit():
            raise LabelError(f"{where}: .cls holds {text[:40]!r}, not an integer class index")
        return int(text)
    raw = _field(sample, "json")
    if raw is None:
        raise LabelError(f"{where} has no .json to read data.label_field {label_field!r} from")
    try:
        meta = json.loads(raw)
    except ValueError as exn:
        raise LabelError(f"{where}: its .json does not parse ({exn}), so data.label_field is unreadable") from None
    if not isinstance(meta, dict) or label_field not in meta:
        keys = ", ".join(sorted(meta)) if isinstance(meta, dict) else type(meta).__name__
        raise LabelError(f"{where}: its .json has no field {label_field!r} (data.label_field); it has {keys}")
    value = meta[label_field]
    if isinstance(value, bool) or not isinstance(value, int):
        raise LabelError(f"{where}: .json field {label_field!r} (data.label_field) is {value!r}, not an integer")
    return value


def _field(sample: dict[str, Any], name: str) -> Any:
    """A field by its lower-case name, whatever case it was stored in."""
    return next((value for key, value in sample.items() if key.lower() == name), None)


def _names(sample: dict[str, Any]) -> list[str]:
    return sorted(key for key in sample if not key.startswith("__"))
