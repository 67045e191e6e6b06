"""data/decode.py: image fields in any case, every Pillow mode to RGB, EXIF orientation, labels from .cls or JSON."""

import io
import json

import numpy as np
import pytest
from PIL import Image

from data.decode import CORRUPT_IMAGE_ERRORS, LabelError, decode_rgb, decode_rgb_reduced, image_field, read_label


def _encode(img: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"jpg": b"", "txt": b"", "json": b"{}"}, "jpg"),
        ({"JPEG": b"", "cls": b"3"}, "JPEG"),
        ({"webp": b"", "json": b"{}"}, "webp"),
        ({"Png": b""}, "Png"),
        ({"BMP": b"", "txt": b""}, "BMP"),
        ({"bmp": b"", "jpg": b""}, "jpg"),  # looked for in IMAGE_FIELDS order
        ({"txt": b"a caption", "json": b"{}"}, None),
    ],
)
def test_image_field_any_case(fields, expected):
    assert image_field({"__key__": "k", "__url__": "u", **fields}) == expected


def test_modes_become_rgb_with_their_colours():
    grey = _encode(Image.new("L", (5, 4), 100), "PNG")
    out = decode_rgb(grey)
    assert out.mode == "RGB" and out.size == (5, 4) and out.getpixel((0, 0)) == (100, 100, 100)

    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 255))
    rgba.putpixel((0, 0), (0, 0, 255, 0))  # fully transparent blue: shows the white background
    out = decode_rgb(_encode(rgba, "PNG"))
    assert out.getpixel((0, 0)) == (255, 255, 255) and out.getpixel((1, 1)) == (255, 0, 0)

    la = Image.new("LA", (2, 2), (40, 0))
    assert decode_rgb(_encode(la, "PNG")).getpixel((1, 1)) == (255, 255, 255)

    palette = Image.new("P", (3, 3), 1)
    palette.putpalette([0, 0, 0, 0, 200, 0] + [0] * 762)
    palette.info["transparency"] = 0
    palette.putpixel((0, 0), 0)
    out = decode_rgb(_encode(palette, "PNG", transparency=0))
    assert out.getpixel((0, 0)) == (255, 255, 255) and out.getpixel((2, 2)) == (0, 200, 0)

    cmyk = Image.new("CMYK", (3, 3), (0, 255, 255, 0))  # pure red in CMYK
    out = decode_rgb(_encode(cmyk, "JPEG", quality=95))
    red, green, blue = out.getpixel((1, 1))
    assert red > 230 and green < 25 and blue < 25

    deep = Image.fromarray(np.full((3, 3), 65535, dtype=np.uint16))  # I;16: white at 16 bits
    deep.putpixel((0, 0), 257 * 10)
    out = decode_rgb(_encode(deep, "PNG"))
    assert out.getpixel((1, 1)) == (255, 255, 255) and out.getpixel((0, 0)) == (10, 10, 10)


def test_exif_orientation_is_applied():
    img = Image.new("RGB", (6, 2), (0, 0, 0))
    img.putpixel((0, 0), (255, 255, 255))
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated: display by rotating 90 degrees clockwise
    out = decode_rgb(_encode(img, "PNG", exif=exif))
    assert out.size == (2, 6)
    assert out.getpixel((1, 0))[0] > 200  # the top-left pixel moved to the top-right


def test_corrupt_bytes_raise_a_corrupt_image_error():
    good = _encode(Image.new("RGB", (64, 64), (9, 9, 9)), "JPEG")
    for bad in (b"not an image", good[: len(good) // 2]):
        with pytest.raises(CORRUPT_IMAGE_ERRORS):
            decode_rgb(bad)


def _gradient(width: int, height: int) -> Image.Image:
    """Red rising left to right, green top to bottom: smooth, so a reduced decode is its downscaled copy."""
    x, y = np.meshgrid(np.linspace(0, 255, width), np.linspace(0, 255, height))  # (H, W) each
    return Image.fromarray(np.stack([x, y, np.full_like(x, 90)], axis=-1).astype(np.uint8))


def test_reduced_decode_scales_a_jpeg_by_what_the_caller_chooses():
    full = _gradient(803, 601)
    data = _encode(full, "JPEG", quality=90)
    asked = []
    out = decode_rgb_reduced(data, lambda w, h: asked.append((w, h)) or 4)
    assert asked == [(803, 601)] and out.full_size == (803, 601) and out.reduction == 4
    assert out.image.mode == "RGB" and out.image.size == (201, 151)  # ceil(803 / 4), ceil(601 / 4)
    expected = np.asarray(full.reduce(4), dtype=np.float64)[:150, :200]  # means of the whole 4x4 blocks
    assert np.abs(np.asarray(out.image, dtype=np.float64)[:150, :200] - expected).mean() < 0.8  # one pixel off: 1.04
    assert decode_rgb_reduced(data, lambda w, h: 1).image.size == (803, 601)
    assert decode_rgb_reduced(data, None).image.tobytes() == decode_rgb(data).tobytes()


def test_reduced_decode_keeps_full_size_where_it_cannot_reduce():
    png = decode_rgb_reduced(_encode(_gradient(64, 48), "PNG"), lambda w, h: 2)  # no DCT to scale
    assert png.reduction == 1 and png.image.size == png.full_size == (64, 48)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated: the reduced pixel grid would not line up after orientation
    rotated = decode_rgb_reduced(_encode(_gradient(64, 48), "JPEG", exif=exif), lambda w, h: 2)
    assert rotated.reduction == 1 and rotated.image.size == rotated.full_size == (48, 64)
    grey = decode_rgb_reduced(_encode(_gradient(64, 48).convert("L"), "JPEG"), lambda w, h: 2)
    assert grey.reduction == 2 and grey.image.mode == "RGB" and grey.image.size == (32, 24)


def test_reduced_decode_of_corrupt_bytes_raises_a_corrupt_image_error():
    good = _encode(_gradient(256, 256), "JPEG")
    for bad in (b"not an image", good[: len(good) // 2]):
        with pytest.raises(CORRUPT_IMAGE_ERRORS):
            decode_rgb_reduced(bad, lambda w, h: 2)


def _sample(**fields):
    return {"__key__": "k7", "__url__": "shards/a-000003.tar", **fields}


def test_label_from_cls_and_from_json():
    assert read_label(_sample(cls=b"7\n"), None) == 7
    assert read_label(_sample(CLS=b"2"), None) == 2
    assert read_label(_sample(json=json.dumps({"label": 4, "caption": "x"}).encode()), "label") == 4


@pytest.mark.parametrize(
    ("fields", "label_field", "words"),
    [
        ({"jpg": b"", "txt": b"cap"}, None, "has no .cls label"),
        ({"cls": b"dog"}, None, "not an integer"),
        ({"cls": b"1"}, "label", "has no .json"),
        ({"json": b'{"caption": "x"}'}, "label", "has no field 'label'"),
        ({"json": b'{"label": "3"}'}, "label", "'3', not an integer"),
        ({"json": b'{"label": true}'}, "label", "not an integer"),
        ({"json": b"{oops"}, "label", "does not parse"),
    ],
)
def test_bad_labels_name_key_shard_and_field(fields, label_field, words):
    with pytest.raises(LabelError) as caught:
        read_label(_sample(**fields), label_field)
    message = str(caught.value)
    assert words in message and "k7" in message and "shards/a-000003.tar" in message
