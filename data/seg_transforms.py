"""Transforms that move a segmentation sample's image and mask together (data/segmentation.py holds the format).

The training transform draws one random scale, crop and flip and applies them to the image (bilinear) and to the mask
(nearest neighbour, padding with the ignore id), then a photometric jitter to the image alone: the ADE20K set-up of
BEiT and MAE (mmsegmentation's Resize with ratio_range (0.5, 2.0), RandomCrop, RandomFlip,
PhotoMetricDistortion). The evaluation transform resizes the image only: predictions are scored at the mask's own
resolution (finetune/segmentation.py resizes the logits back to it).

Both return uint8 images, normalised on the device like every other transform's (data/device.py), and the mask as
"seg" int64. All randomness comes from the global torch RNG, which the data pipeline seeds per sample.

Shapes: H/W the stored image's height and width, h/w after the transform.
"""

from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch
import torchvision.transforms.v2.functional as F2
from PIL import Image
from timm.layers import to_2tuple
from torchvision.transforms import InterpolationMode

from data.device import normalisation
from data.segmentation import IGNORE_INDEX, SEG_FIELD


class SegTrainTransform:
    """Random scale, crop and flip of image and mask together, then photometric jitter of the image.

    Args:
        crop_size: The crop, an int for square or (height, width): the model's input.
        mean: Per-channel mean of the normalisation (on the device).
        std: Per-channel standard deviation.
        base_size: The short side of the image at scale 1 (ADE20K: 512, the crop's); None: the crop's short side.
        scale: Range of the scale drawn per sample (uniform), relative to `base_size`.
        hflip: Probability of a horizontal flip.
        photometric: Jitter brightness, contrast, saturation and hue, each with probability 1/2.
    """

    seg_field = SEG_FIELD  # the data pipeline reads this field of every sample and passes it as `seg`

    def __init__(
        self,
        crop_size: int | tuple[int, int],
        mean: Sequence[float],
        std: Sequence[float],
        *,
        base_size: int | None = None,
        scale: tuple[float, float] = (0.5, 2.0),
        hflip: float = 0.5,
        photometric: bool = True,
    ):
        self.crop = to_2tuple(crop_size)
        self.base_size = base_size or min(self.crop)
        if not 0 < scale[0] <= scale[1]:
            raise ValueError(f"scale must be a range (low, high) with 0 < low <= high, got {scale}")
        self.scale, self.hflip, self.photometric = tuple(scale), hflip, photometric
        self.normalisation = {"image": normalisation(mean, std)}

    def __call__(self, image: Image.Image, seg: np.ndarray) -> dict[str, torch.Tensor]:
        """{"image": (3, h, w) uint8, "seg": (h, w) int64}, h x w the crop."""
        pixels, mask = _pair(image, seg)
        low, high = self.scale
        factor = self.base_size * (low + (high - low) * torch.rand(1).item()) / min(pixels.shape[-2:])
        size = [max(1, round(side * factor)) for side in pixels.shape[-2:]]
        pixels = F2.resize(pixels, size, InterpolationMode.BILINEAR, antialias=True)  # (3, h', w')
        mask = F2.resize(mask, size, InterpolationMode.NEAREST_EXACT)  # (1, h', w')
        pixels, mask = _pad_to(pixels, mask, self.crop)
        top = int(torch.randint(pixels.shape[-2] - self.crop[0] + 1, ()))
        left = int(torch.randint(pixels.shape[-1] - self.crop[1] + 1, ()))
        pixels = pixels[:, top : top + self.crop[0], left : left + self.crop[1]]
        mask = mask[:, top : top + self.crop[0], left : left + self.crop[1]]
        if torch.rand(1).item() < self.hflip:
            pixels, mask = pixels.flip(-1), mask.flip(-1)
        if self.photometric:
            pixels = photometric_jitter(pixels)
        return {"image": pixels.contiguous(), "seg": mask[0].long()}


class SegEvalTransform:
    """The image resized for the model, the mask as stored (scores are taken at its resolution).

    Args:
        crop_size: The model's input, an int for square or (height, width).
        mean: Per-channel mean of the normalisation.
        std: Per-channel standard deviation.
        mode: "whole": the image resized to the crop, predicted in one pass; "slide": its short side resized to
            `base_size` (aspect kept), predicted window by window (finetune/segmentation.py).
        base_size: The short side for "slide"; None: the crop's short side.
    """

    seg_field = SEG_FIELD

    def __init__(
        self,
        crop_size: int | tuple[int, int],
        mean: Sequence[float],
        std: Sequence[float],
        *,
        mode: Literal["whole", "slide"] = "whole",
        base_size: int | None = None,
    ):
        self.crop, self.mode = to_2tuple(crop_size), mode
        self.base_size = base_size or min(self.crop)
        self.normalisation = {"image": normalisation(mean, std)}

    def __call__(self, image: Image.Image, seg: np.ndarray) -> dict[str, torch.Tensor]:
        """{"image": (3, h, w) uint8, "seg": (H, W) int64}."""
        pixels, mask = _pair(image, seg)
        return {"image": self.resize(pixels), "seg": mask[0].long()}

    def resize(self, pixels: torch.Tensor) -> torch.Tensor:
        """(3, H, W) uint8 -> (3, h, w) uint8, the image as the model sees it (a mask needs none of this)."""
        if self.mode == "whole":
            size = list(self.crop)
        else:
            factor = self.base_size / min(pixels.shape[-2:])
            size = [max(1, round(side * factor)) for side in pixels.shape[-2:]]
        return F2.resize(pixels, size, InterpolationMode.BILINEAR, antialias=True).contiguous()


def photometric_jitter(pixels: torch.Tensor) -> torch.Tensor:
    """mmsegmentation's PhotoMetricDistortion ranges on a (3, h, w) uint8 image, each op with probability 1/2:
    brightness +-32 levels, contrast and saturation x [0.5, 1.5], hue +-18 degrees of 180 (OpenCV's hue scale)."""
    draws = torch.rand(8).tolist()  # four coins, four magnitudes
    if draws[0] < 0.5:
        pixels = (pixels.short() + round(64 * draws[1] - 32)).clamp(0, 255).to(torch.uint8)
    if draws[2] < 0.5:
        pixels = F2.adjust_contrast(pixels, 0.5 + draws[3])
    if draws[4] < 0.5:
        pixels = F2.adjust_saturation(pixels, 0.5 + draws[5])
    if draws[6] < 0.5:
        pixels = F2.adjust_hue(pixels, (2 * draws[7] - 1) * 18 / 180)
    return pixels


def _pair(image: Image.Image, seg: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The image as (3, H, W) uint8 and the mask as (1, H, W) uint8, refusing masks of another size."""
    if seg.shape != (image.height, image.width):
        raise ValueError(f"mask of {seg.shape[1]}x{seg.shape[0]} for an image of {image.width}x{image.height}")
    pixels = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)
    return pixels, torch.from_numpy(np.ascontiguousarray(seg))[None]


def _pad_to(pixels: torch.Tensor, mask: torch.Tensor, size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pads image (with 0) and mask (with the ignore id) at the bottom and right up to at least `size`."""
    pad_h, pad_w = max(size[0] - pixels.shape[-2], 0), max(size[1] - pixels.shape[-1], 0)
    if not (pad_h or pad_w):
        return pixels, mask
    padding = [0, 0, pad_w, pad_h]  # left, top, right, bottom
    return F2.pad(pixels, padding, fill=0), F2.pad(mask, padding, fill=IGNORE_INDEX)
