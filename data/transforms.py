"""Image transforms: an RGB PIL image in, a normalized (3, H, W) float32 tensor out.

All randomness comes from the global torch RNG, which the data pipeline seeds per sample.
"""

import math
from collections.abc import Sequence

from timm.data.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torchvision import transforms as T

IMAGENET_MEAN = IMAGENET_DEFAULT_MEAN
IMAGENET_STD = IMAGENET_DEFAULT_STD


def pretrain_transform(
    img_size: int | tuple[int, int],
    mean: Sequence[float],
    std: Sequence[float],
    scale: tuple[float, float] = (0.2, 1.0),
) -> T.Compose:
    """MAE's pretraining augmentation: bicubic RandomResizedCrop and a horizontal flip, nothing else.

    Args:
        img_size: Output size, an int for square images or (height, width).
        mean: Per-channel mean subtracted after scaling pixels to [0, 1].
        std: Per-channel standard deviation divided by.
        scale: Range of the crop's area as a fraction of the image.
    """
    return _crop_flip(img_size, mean, std, scale, hflip=0.5)


def finetune_train_transform(
    img_size: int | tuple[int, int],
    mean: Sequence[float],
    std: Sequence[float],
    scale: tuple[float, float] = (0.08, 1.0),
    hflip: float = 0.5,
) -> T.Compose:
    """Fine-tuning augmentation: bicubic RandomResizedCrop over a wider area range and a horizontal flip.

    Args:
        img_size: Output size, an int for square images or (height, width).
        mean: Per-channel mean.
        std: Per-channel standard deviation.
        scale: Range of the crop's area as a fraction of the image.
        hflip: Probability of flipping horizontally.
    """
    return _crop_flip(img_size, mean, std, scale, hflip)


def eval_transform(
    img_size: int | tuple[int, int],
    mean: Sequence[float],
    std: Sequence[float],
    crop_pct: float = 0.875,
) -> T.Compose:
    """Evaluation: resize the shorter side to `img_size / crop_pct` (bicubic), then centre-crop `img_size`.

    With the defaults at 224 px this is the usual resize 256, centre crop 224.

    Args:
        img_size: Output size, an int for square images or (height, width).
        mean: Per-channel mean.
        std: Per-channel standard deviation.
        crop_pct: Fraction of the resized shorter side that the crop keeps.
    """
    if not 0 < crop_pct <= 1:
        raise ValueError(f"crop_pct must be in (0, 1], got {crop_pct}")
    height, width = (img_size, img_size) if isinstance(img_size, int) else img_size
    resize_to = math.floor(max(height, width) / crop_pct)  # the crop fits in both dimensions
    return T.Compose(
        [
            T.Resize(resize_to, interpolation=T.InterpolationMode.BICUBIC),
            T.CenterCrop((height, width)),
            T.ToTensor(),
            T.Normalize(mean, std),
        ]
    )


def _crop_flip(
    img_size: int | tuple[int, int],
    mean: Sequence[float],
    std: Sequence[float],
    scale: tuple[float, float],
    hflip: float,
) -> T.Compose:
    """Bicubic RandomResizedCrop, horizontal flip with probability `hflip`, to tensor, normalize."""
    return T.Compose(
        [
            T.RandomResizedCrop(img_size, scale=scale, interpolation=T.InterpolationMode.BICUBIC),
            T.RandomHorizontalFlip(hflip),
            T.ToTensor(),
            T.Normalize(mean, std),
        ]
    )
