"""`data.decode: device`: the pretraining crop's JPEGs decoded on the training device instead of in the data workers.

An 8-GPU node has 12-16 cores per GPU, and an H100 training MAE ViT-B at 40% MFU takes ~6,700 images/s: decoding is
most of a data worker's CPU (~1.2 ms of ~1.8-2 ms per ImageNet-sized JPEG, benchmarks/results/data.md). With
`data.decode: device` the worker only reads the JPEG's header (~0.02-0.03 ms: size, EXIF orientation, colour mode)
and draws the crop box and flip exactly as `CropFlip` draws them (the same RNG calls, so a seeded sample gets the
same box in both modes): ~0.1 ms per image. The training process decodes the batch with `torchvision.io.decode_jpeg`
on its device (batched nvJPEG on CUDA, A100/H100's hardware JPEG engines for baseline JPEGs; libjpeg-turbo on the
CPU), then crops, resizes and flips each image as the worker would have.

Which samples go to the device is decided per sample in the worker (`device_jpeg`): a baseline JPEG in YCbCr / RGB
(Pillow mode "RGB") without an EXIF rotation, whose data ends with the end-of-image marker. Everything else is
decoded in the worker as before: PNG and the other formats, greyscale and CMYK JPEGs, EXIF-rotated ones (the box is
drawn on the rotated image), progressive JPEGs (nvJPEG decodes those on the host CPU of the training process, one at
a time: worse than the worker) and files cut short (Pillow then judges them, and counts them as corrupt as before).
A batch may carry both kinds: its "image" is then a `DeviceCrops` (the worker-rendered pixels, the JPEG files end to
end, the boxes and flips, and which sample is which), which `data.device.batch_to_device` turns into the same
(B, 3, H, W) uint8 the worker path gives before it normalises it. A batch with no JPEG for the device stays a plain
tensor.

Corrupt images: a header that does not parse raises in the worker (`device_jpeg`), where the pipeline skips and counts
the sample as today. A body that fails on the device is decoded one file at a time, and a file the device rejects is
decoded by Pillow in the training process (nvJPEG refuses some valid files, e.g. arithmetic coding); a file that
Pillow cannot decode either trains as a black image, is logged with its key and is counted in the batch's
"num_corrupt" (in the worker path it would have been skipped; the other samples and their boxes are the same).

Pixels: the box is resized in float32 by torch's antialiased bicubic (`F.interpolate(mode="bicubic",
antialias=True)`), rounded to uint8 (as torchvision does on a GPU): the same on the CPU and on CUDA, against the
worker's native uint8 kernel, which also decodes large JPEGs at a DCT reduction (data/decode.py). The two agree
within a level or two on average (tests/unit/test_device_decode.py states the measured tolerance).

Shapes: B batch size, J samples decoded on the device, H/W output height/width, h/w a decoded image's, N bytes.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from PIL import ExifTags, Image
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.v2.functional import pil_to_tensor

from data.decode import CORRUPT_IMAGE_ERRORS, decode_rgb

log = logging.getLogger(__name__)

_SOI, _EOI = b"\xff\xd8\xff", b"\xff\xd9"  # start of image (and the next marker's first byte), end of image


class DeviceJpeg(NamedTuple):
    """A JPEG the device will decode, as `CropFlip.decode` hands it to the transform: its file and full size."""

    data: bytes
    full_size: tuple[int, int]
    """(W, H), as Pillow reads it from the header (no EXIF rotation applies)."""


class JpegCrop(NamedTuple):
    """One sample's image as it leaves the transform with `data.decode: device`: the file and what to render."""

    data: bytes
    box: tuple[int, int, int, int]
    """(top, left, height, width) on the full-size image: torchvision's `RandomResizedCrop.get_params` draw."""
    flip: bool
    size: tuple[int, int]
    """Output (H, W)."""


class DeviceCrops(NamedTuple):
    """A batch's "image" when some of its JPEGs are decoded on the device. Every field is a tensor, so DataLoader
    pins each one (a namedtuple is pinned field by field) and `batch_to_device` reads the small ones on the host
    without waiting for the device."""

    pixels: torch.Tensor
    """(B - J, 3, H, W) uint8: the samples the worker decoded and rendered, in batch order."""
    jpeg: torch.Tensor
    """(N,) uint8: the J JPEG files, end to end."""
    ends: torch.Tensor
    """(J,) int64: where each file ends in `jpeg` (it starts where the one before ends)."""
    crops: torch.Tensor
    """(J, 5) int64: each file's box on its full-size image (top, left, height, width), then its flip (0 or 1)."""
    on_device: torch.Tensor
    """(B,) bool: which samples are JPEG files (in order), the rest being `pixels` (in order)."""


def device_jpeg(data: bytes) -> DeviceJpeg | None:
    """The JPEG for the device to decode, or None for an image the worker decodes (see the module docstring).

    Reads the header only: markers up to the scan, and the EXIF block.

    Raises:
        One of `data.decode.CORRUPT_IMAGE_ERRORS` for a JPEG whose header does not parse.
    """
    if not data.startswith(_SOI) or not data.endswith(_EOI):
        return None  # not a JPEG, or one cut short (or with bytes after its end): the worker's decode judges it
    image = Image.open(io.BytesIO(data))
    if image.format != "JPEG" or image.mode != "RGB" or "progressive" in image.info:
        return None
    if image.getexif().get(ExifTags.Base.Orientation, 1) != 1:
        return None
    return DeviceJpeg(data, image.size)


def stack_images(images: Sequence[torch.Tensor | JpegCrop]) -> torch.Tensor | DeviceCrops:
    """The batch's "image": (B, 3, H, W) uint8 stacked as ever when the worker rendered every sample, else a
    `DeviceCrops` of the rendered ones and the JPEG crops."""
    files = [image for image in images if isinstance(image, JpegCrop)]
    if not files:
        return torch.stack(images)
    height, width = files[0].size
    rendered = [image for image in images if not isinstance(image, JpegCrop)]
    pixels = torch.stack(rendered) if rendered else torch.empty((0, 3, height, width), dtype=torch.uint8)
    return DeviceCrops(
        pixels=pixels,
        jpeg=torch.frombuffer(bytearray().join(f.data for f in files), dtype=torch.uint8),  # one copy
        ends=torch.tensor([len(f.data) for f in files], dtype=torch.int64).cumsum(0),
        crops=torch.tensor([[*f.box, f.flip] for f in files], dtype=torch.int64),
        on_device=torch.tensor([isinstance(image, JpegCrop) for image in images]),
    )


def decode_crops(crops: DeviceCrops, device: torch.device, keys: Sequence[str]) -> tuple[torch.Tensor, list[int]]:
    """The batch's images on `device`, as the worker path renders them.

    Args:
        crops: The batch's "image" (pinned on a CUDA host).
        device: Where to decode and render.
        keys: The batch's sample keys, for the log.

    Returns:
        (B, 3, H, W) uint8 on `device`, and the batch positions of the JPEGs that decode neither on the device nor
        with Pillow (black images).
    """
    height, width = crops.pixels.shape[-2:]
    ends = crops.ends.tolist()  # host tensors: no wait for the device
    files = [crops.jpeg[start:end] for start, end in zip([0, *ends[:-1]], ends, strict=True)]  # (n,) uint8 views
    positions = crops.on_device.nonzero().flatten().tolist()  # the J samples' places in the batch
    decoded = _decode_files(files, device, [keys[i] for i in positions])  # (3, h, w) uint8 each, None: corrupt
    rendered = torch.stack(
        [
            _render(image, box, (height, width)) if image is not None else _black(device, height, width)
            for image, box in zip(decoded, crops.crops.tolist(), strict=True)
        ]
    ).to(torch.uint8)  # (J, 3, H, W)
    failed = [positions[j] for j, image in enumerate(decoded) if image is None]
    if len(positions) == len(crops.on_device):
        return rendered, failed
    pixels = crops.pixels.to(device, non_blocking=True)  # (B - J, 3, H, W)
    rows, j, k = [], 0, 0
    for on_device in crops.on_device.tolist():
        rows.append(rendered[j : j + 1] if on_device else pixels[k : k + 1])
        j, k = j + on_device, k + (not on_device)
    return torch.cat(rows), failed


def _decode_files(files: list[torch.Tensor], device: torch.device, keys: list[str]) -> list[torch.Tensor | None]:
    """(3, h, w) uint8 per file on `device`: all at once (nvJPEG's batched decode on CUDA), file by file if that
    fails (it returns nothing when one file fails), then with Pillow on the host for a file the device rejects;
    None for a file Pillow cannot decode either."""
    try:
        return decode_jpeg(files, mode=ImageReadMode.RGB, device=device)
    except RuntimeError:
        pass
    images = []
    for file, key in zip(files, keys, strict=True):
        try:
            images.append(decode_jpeg(file, mode=ImageReadMode.RGB, device=device))
            continue
        except RuntimeError as device_error:
            error = device_error
        try:
            image = pil_to_tensor(decode_rgb(file.numpy().tobytes())).to(device)
            log.warning("sample %s: decoded with Pillow, as %s cannot decode its JPEG (%s)", key, device, error)
            images.append(image)
        except CORRUPT_IMAGE_ERRORS as exn:
            log.warning("sample %s: corrupt JPEG (%s; Pillow: %s); it trains as a black image", key, error, exn)
            images.append(None)
    return images


def _render(image: torch.Tensor, crop: list[int], size: tuple[int, int]) -> torch.Tensor:
    """A `DeviceCrops.crops` row rendered from its (3, h, w) uint8 image: the box resized to (3, H, W) float32 by
    antialiased bicubic, clamped and rounded as torchvision rounds a uint8 resize on a GPU, then flipped."""
    top, left, box_height, box_width, flip = crop
    region = image[None, :, top : top + box_height, left : left + box_width].float()  # (1, 3, height, width)
    out = F.interpolate(region, size=size, mode="bicubic", antialias=True, align_corners=False)[0]
    out = out.clamp_(0, 255).round_()  # integral values in [0, 255]
    return out.flip(-1) if flip else out


def _black(device: torch.device, height: int, width: int) -> torch.Tensor:
    return torch.zeros((3, height, width), device=device)
