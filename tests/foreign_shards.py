"""Shards as other tools write them, for the tests: img2dataset-style `key.jpg` + `key.txt` + `key.json` (no `.cls`),
with the image kinds web-scale data holds and two samples the loaders must skip."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image

GOOD_KEYS = ["000000000", "000000001", "000000002", "000000003", "000010000", "000010001", "000010003", "000010004"]
"""The samples with a decodable image, in shard order."""
LABELS = {"000000000": 0, "000000001": 1, "000000002": 2, "000000003": 1, "000010000": 0, "000010001": 2}
LABELS |= {"000010002": 1, "000010003": 0, "000010004": 3}
"""The `label` field of each sample's JSON that has an image (the truncated one included)."""
CAPTION_ONLY, TRUNCATED = "000000004", "000010002"
SIZES = {  # (width, height) after EXIF orientation
    "000000000": (40, 30),
    "000000001": (24, 24),
    "000000002": (32, 20),
    "000000003": (20, 20),
    "000010000": (20, 40),
    "000010001": (36, 28),
    "000010003": (30, 30),
    "000010004": (26, 22),
}


def encode(img: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def _noise(size: tuple[int, int], seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)  # (H, W, 3)
    return Image.fromarray(pixels)


def _images() -> dict[str, tuple[str, bytes]]:
    """Key -> (field, encoded image) for every sample that has an image."""
    rgba = _noise((24, 24), 1).convert("RGBA")
    rgba.putalpha(Image.linear_gradient("L").resize((24, 24)))
    deep = Image.fromarray(np.arange(400, dtype=np.uint16).reshape(20, 20) * 160)  # I;16
    rotated = _noise((40, 20), 4)
    exif = rotated.getexif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display, so 40x20 shows as 20x40
    palette = _noise((26, 22), 7).convert("P", palette=Image.Palette.ADAPTIVE, colors=8)
    return {
        "000000000": ("jpg", encode(_noise((40, 30), 0), "JPEG")),
        "000000001": ("png", encode(rgba, "PNG")),
        "000000002": ("jpg", encode(_noise((32, 20), 2).convert("CMYK"), "JPEG")),
        "000000003": ("png", encode(deep, "PNG")),
        "000010000": ("jpg", encode(rotated, "JPEG", exif=exif)),
        "000010001": ("JPEG", encode(_noise((36, 28), 5), "JPEG")),
        "000010002": ("jpg", encode(_noise((64, 64), 6), "JPEG")[:300]),  # cut inside the scan data
        "000010003": ("jpg", encode(_noise((30, 30), 3).convert("L"), "JPEG")),
        "000010004": ("png", encode(palette, "PNG", transparency=0)),
    }


def write_img2dataset_shards(folder: Path, *, drop_label: str | None = None, repeat: int = 1) -> list[Path]:
    """Writes `00000.tar` (keys 000000000-000000004) and `00001.tar` (keys 000010000-000010004) into `folder`.

    Every sample has a caption `.txt` and a `.json` with `url`, `caption` and `label` (none for `drop_label`);
    `CAPTION_ONLY` has no image and `TRUNCATED` a cut JPEG. `repeat` > 1 writes each shard's samples that many
    times over (keys suffixed `r1`, `r2`, ...), for runs that need more samples.
    """
    folder.mkdir(parents=True, exist_ok=True)
    images = _images()
    paths = []
    for shard, keys in enumerate([[f"00000000{i}" for i in range(5)], [f"00001000{i}" for i in range(5)]]):
        paths.append(folder / f"{shard:05d}.tar")
        with wds.TarWriter(str(paths[-1])) as writer:
            for copy in range(repeat):
                for key in keys:
                    meta = {"url": f"https://example.com/{key}.jpg", "caption": f"picture {key}"}
                    if key in LABELS and key != drop_label:
                        meta["label"] = LABELS[key]
                    sample = {"__key__": key + (f"r{copy}" if copy else ""), "txt": meta["caption"], "json": meta}
                    if key in images:
                        field, data = images[key]
                        sample[field] = data
                    writer.write(sample)
    return paths
