"""What a batch from the data pipeline becomes on the device: the one place its uint8 images are normalised, its
random-erasing boxes filled and its Mixup / CutMix applied.

Images cross from the data workers as uint8 and are normalised after the host-to-device copy, because the bytes in
flight between workers and trainer live in shared memory (/dev/shm): DataLoader keeps up to 2 (`prefetch_factor`)
batches per worker there. A (256, 3, 224, 224) batch is 38.5 MB as uint8 against 154 MB as float32. Docker's default
/dev/shm of 64 MB therefore holds one such batch as uint8 and none as float32 (a worker that cannot map its batch
dies with a bus error); a per-device batch of 64 is 9.6 MB, so 2 workers (4 batches, 38.5 MB) fit the default, where
float32 needed 154 MB. More workers or larger batches still need `docker run --shm-size=...` (or `--ipc=host`):
about 2 x workers x batch x 3 x H x W bytes, plus a BEiT tokenizer view.

With `data.decode: device` the workers hand over most JPEGs still encoded, with the crop box and flip they drew, and
the batch is decoded and rendered here (data/device_decode.py). JPEG bytes are 5-10x smaller than the decoded image
(a 500 x 375 photo at quality 90: ~95 KB against 563 KB), but the worker path ships the 224 px crop, not the image,
and an ImageNet-sized JPEG is about that crop's size (147 KB as uint8): /dev/shm per batch stays about the same (less
for larger outputs, more for a 112 px tokenizer crop). The saving is the workers' CPU.

A batch carries what the device needs, so that every path that feeds a model (the training loop, evaluation, the
kNN monitor, pictures, the FLOP count) turns it into the same input by calling `batch_to_device`, with no other
knowledge of the recipe:
    "normalise"  {field: (2, 3, 1, 1) float32}: per uint8 field, the multiply-add [1 / (255 std), -mean / std] built
                 from the recipe's mean and std (`data.mean` / `data.std`, a tokenizer's own for its view) by the
                 transform (`normalisation`), attached to every batch by the pipeline
    "erase"      (B, 5) int64: per sample the random-erasing box (top, left, height, width; height 0 for none) the
                 worker drew, and a seed for its noise (`EraseBoxes`)
    "mix"        `data.mixing.MixDraw`: the Mixup / CutMix draw made in the training process (data/mixing.py)
The three are consumed here; the model sees "image" (B, 3, H, W) float32 and the other fields as before. An "image"
that is a `data.device_decode.DeviceCrops` (`data.decode: device`) is decoded and rendered here first, into the
(B, 3, H, W) uint8 the workers would have made.

Order, as timm's pipeline has it (erasing in the worker after normalisation, mixing on whole batches after):
normalise, erase, mix. The copies are `non_blocking`: the loader pins every tensor of a batch (CUDA present), and
mixing no longer replaces the images and labels on the host, so the copy stays asynchronous.

Shapes: B batch size, H/W image height/width, K classes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch

from data.device_decode import DeviceCrops, decode_crops
from data.mixing import MixDraw, apply_mix

ERASE_FIELDS = 5
"""An "erase" row: top, left, height, width, noise seed."""
_SEED_BOUND = 2**62  # noise seeds drawn in [0, 2**62); a batch's seed is their sum modulo 2**63


def normalisation(mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """ToTensor and Normalize as one multiply-add per channel: (x / 255 - mean) / std = x gain + offset.

    Returns:
        (2, 3, 1, 1) float32: [gain, offset], gain = 1 / (255 std) and offset = -mean / std, computed in float32 as
        the workers did when they normalised, so that the CPU result is bit-identical to theirs.
    """
    mean_t, std_t = (torch.tensor(v, dtype=torch.float32).view(3, 1, 1) for v in (mean, std))
    return torch.stack([1 / (255 * std_t), -mean_t / std_t])


def normalise(pixels: torch.Tensor, affine: torch.Tensor) -> torch.Tensor:
    """uint8 (..., 3, H, W) -> float32 on the same device, by the `normalisation` multiply-add `affine` (2, 3, 1, 1).

    Two rounded operations (no fused multiply-add), so a GPU gives the CPU's bits.
    """
    return pixels.float().mul_(affine[0]).add_(affine[1])


class EraseBoxes:
    """timm's `RandomErasing(probability, mode="pixel", max_count=1)` split in two: this draws the box in the data
    worker, `erase` fills it on the device with per-pixel N(0, 1) noise in normalised units after normalisation.

    The box comes from the same python `random` draws as timm's (probability, then up to 10 tries of area and log
    aspect ratio, then the corner), so a seeded sample gets timm's box; the noise seed comes from the global torch
    RNG, which the pipeline seeds per sample, so a run's noise is reproducible and independent of the trainer's RNGs.

    Args:
        probability: Chance of erasing a box.
        min_area, max_area: Range of the box's area as a fraction of the image (timm's defaults).
        min_aspect: Smallest height / width ratio; the largest is its inverse (timm's default).
    """

    def __init__(self, probability: float, min_area: float = 0.02, max_area: float = 1 / 3, min_aspect: float = 0.3):
        self.probability, self.min_area, self.max_area = probability, min_area, max_area
        self.log_aspect = (math.log(min_aspect), math.log(1 / min_aspect))

    def __call__(self, height: int, width: int) -> torch.Tensor:
        """(5,) int64: (top, left, box height, box width, noise seed) for a height x width image; height 0: none."""
        box = (0, 0, 0, 0)
        if random.random() <= self.probability:
            for _ in range(10):
                area = random.uniform(self.min_area, self.max_area) * height * width
                aspect = math.exp(random.uniform(*self.log_aspect))
                h, w = int(round(math.sqrt(area * aspect))), int(round(math.sqrt(area / aspect)))
                if w < width and h < height:
                    box = (random.randint(0, height - h), random.randint(0, width - w), h, w)
                    break
        seed = int(torch.randint(_SEED_BOUND, ()))
        return torch.tensor([*box, seed], dtype=torch.int64)


def erase(images: torch.Tensor, boxes: torch.Tensor, seed: int) -> torch.Tensor:
    """Fills each sample's box with N(0, 1) noise drawn from a generator seeded with `seed`.

    Args:
        images: (B, 3, H, W) float32 normalised images.
        boxes: (B, 5) int64 "erase" rows on the same device.
        seed: The noise seed (`batch_seed`).

    Returns:
        (B, 3, H, W): `images` outside the boxes, noise inside.
    """
    height, width = images.shape[-2:]
    top, left, box_height, box_width = boxes[:, :4].T  # (B,) each
    rows, cols = torch.arange(height, device=images.device), torch.arange(width, device=images.device)
    in_rows = (rows >= top[:, None]) & (rows < (top + box_height)[:, None])  # (B, H)
    in_cols = (cols >= left[:, None]) & (cols < (left + box_width)[:, None])  # (B, W)
    inside = (in_rows[:, :, None] & in_cols[:, None, :])[:, None]  # (B, 1, H, W)
    # The meta device (a FLOP count) has no generator, and its tensors hold no values to reproduce.
    generator = None if images.device.type == "meta" else torch.Generator(images.device).manual_seed(seed)
    noise = torch.randn(images.shape, generator=generator, device=images.device, dtype=images.dtype)
    return torch.where(inside, noise, images)


def batch_seed(boxes: torch.Tensor) -> int:
    """The noise seed of a batch: its samples' seeds summed modulo 2**63, read from the (B, 5) "erase" rows on the
    host (before the copy: no device sync)."""
    return sum(boxes[:, 4].tolist()) % 2**63


def batch_to_device(batch: dict, device: torch.device) -> dict:
    """The model's input in float32: tensors copied to `device` (non_blocking), JPEGs left to the device decoded
    (`data.decode: device`), the uint8 fields "normalise" names normalised, the "erase" boxes filled, the "mix" draw
    applied.

    A batch without these fields (a stand-in of float zeros, a synthetic benchmark batch) is only copied. A JPEG that
    decodes neither on the device nor with Pillow becomes a black image and is added to `batch["num_corrupt"]`, the
    host count the training loop reads after this call (data/device_decode.py).
    """
    seed = batch_seed(batch["erase"]) if "erase" in batch else 0
    out = {key: _copy(value, device) for key, value in batch.items() if key not in ("normalise", "erase", "mix")}
    if isinstance(batch.get("image"), DeviceCrops):
        out["image"], failed = decode_crops(batch["image"], device, batch["key"])
        if failed:
            batch["num_corrupt"] = batch["num_corrupt"] + len(failed)
            out["num_corrupt"] = _copy(batch["num_corrupt"], device)
    for field, affine in batch.get("normalise", {}).items():
        out[field] = normalise(out[field], affine.to(device, non_blocking=True))
    if "erase" in batch:
        out["image"] = erase(out["image"], batch["erase"].to(device, non_blocking=True), seed)
    mix: MixDraw | None = batch.get("mix")
    if mix is not None:
        out["image"], out["label"] = apply_mix(out["image"], out["label"], mix)
    return out


def _copy(value, device: torch.device):
    return value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
