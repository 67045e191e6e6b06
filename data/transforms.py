"""Image transforms: an RGB PIL image in, a normalized (3, H, W) float32 tensor out (or a dict of tensors with
"image": a second view for a tokenizer, a patch mask).

All randomness comes from the global torch / python / numpy RNGs, which the data pipeline seeds per sample.
"""

import math
from collections.abc import Callable, Sequence

import torch
import torchvision.transforms.functional as TF
from PIL import Image
from timm.data.auto_augment import augment_and_mix_transform, auto_augment_transform, posterize, rand_augment_transform
from timm.data.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.data.random_erasing import RandomErasing
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
    auto_augment: str | None = None,
    re_prob: float = 0.0,
) -> T.Compose:
    """Fine-tuning augmentation (DeiT / MAE fine-tuning): timm's training pipeline for these options.

    Bicubic RandomResizedCrop over a wide area range, horizontal flip, an optional timm AutoAugment / RandAugment /
    AugMix policy, to tensor, normalize, then optional timm RandomErasing of one box with per-pixel N(0, 1) noise
    (in normalized units). This is `timm.data.create_transform(is_training=True, interpolation="bicubic",
    re_mode="pixel", re_count=1)` with two differences, so that the policy-free transform stays crop + flip:
    torchvision's RandomResizedCrop (same sampling, drawn from torch rather than python `random`) and no
    ColorJitter (which timm adds by default only when no policy is given).

    Args:
        img_size: Output size, an int for square images or (height, width).
        mean: Per-channel mean; also the fill colour of the policy's geometric ops (as timm does).
        std: Per-channel standard deviation.
        scale: Range of the crop's area as a fraction of the image.
        hflip: Probability of flipping horizontally.
        auto_augment: A timm policy string such as "rand-m9-mstd0.5-inc1" (RandAugment), "original" or "v0"
            (AutoAugment), "augmix-m5-w4-d2" (AugMix); None for none.
        re_prob: Probability of erasing a random box after normalisation; 0 disables it.

    Raises:
        ValueError: If `re_prob` is outside [0, 1] or timm rejects the policy string.
    """
    if not 0.0 <= re_prob <= 1.0:
        raise ValueError(f"re_prob must be in [0, 1], got {re_prob}")
    steps: list[Callable] = [
        T.RandomResizedCrop(img_size, scale=scale, interpolation=T.InterpolationMode.BICUBIC),
        T.RandomHorizontalFlip(hflip),
    ]
    if auto_augment:
        steps.append(_augment_policy(auto_augment, min(_pair(img_size)), mean))
    steps += [T.ToTensor(), T.Normalize(mean, std)]
    if re_prob > 0:
        steps.append(RandomErasing(re_prob, mode="pixel", max_count=1, device="cpu"))
    return T.Compose(steps)


def _augment_policy(policy: str, min_side: int, mean: Sequence[float]) -> Callable[[Image.Image], Image.Image]:
    """A timm PIL-to-PIL augmentation policy with the hyperparameters `timm.data.create_transform` gives it.

    Its ops draw from the global python and numpy RNGs.
    """
    hparams = {
        "translate_const": int(min_side * 0.45),  # pixels, for the absolute Translate ops
        "img_mean": tuple(min(255, round(255 * m)) for m in mean),  # fill of the uncovered area, RGB 0..255
        "interpolation": Image.Resampling.BICUBIC,  # as the crop (timm: the `interpolation` argument)
    }
    try:
        if policy.startswith("rand"):
            transform = rand_augment_transform(policy, hparams)
        elif policy.startswith("augmix"):
            transform = augment_and_mix_transform(policy, {**hparams, "translate_pct": 0.3})
        else:
            transform = auto_augment_transform(policy, hparams)
    except (AssertionError, KeyError, ValueError) as error:  # timm checks policy strings with asserts
        raise ValueError(f"auto_augment {policy!r} is not a valid timm policy: {error}") from error
    ops = list(getattr(transform, "ops", [])) + [op for sub in getattr(transform, "policy", []) for op in sub]
    for op in ops:
        if op.name.startswith("Posterize"):
            op.aug_fn = _posterize_at_least_1_bit
    return transform


def _posterize_at_least_1_bit(img: Image.Image, bits_to_keep: int, **kwargs) -> Image.Image:
    """timm's posterize asks for 0 bits at the top magnitude (`PosterizeIncreasing` at m10, reached by m9 with
    mstd0.5), which Pillow >= 11 rejects; one bit is the same picture at the extreme of the range."""
    return posterize(img, max(1, bits_to_keep), **kwargs)


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


class TwoViewCropFlip:
    """One RandomResizedCrop and flip, rendered at two resolutions: the encoder's view ("image", bicubic) and a
    second view ("tokenizer_image", Lanczos) for an image tokenizer, as BEiT does (224 px and 112 px).

    Args:
        img_size: The encoder's input size.
        second_size: The tokenizer's input size.
        mean, std: Normalisation of the encoder's view.
        second_mean, second_std: Normalisation of the tokenizer's view (the tokenizer's own).
        scale: Range of the crop's area as a fraction of the image.
    """

    def __init__(self, img_size, second_size, mean, std, second_mean, second_std, scale=(0.2, 1.0)):
        self.sizes = (_pair(img_size), _pair(second_size))
        self.norms = (T.Normalize(mean, std), T.Normalize(second_mean, second_std))
        self.crop = T.RandomResizedCrop(self.sizes[0], scale=scale)
        self.modes = (T.InterpolationMode.BICUBIC, T.InterpolationMode.LANCZOS)

    def __call__(self, image: Image.Image) -> dict[str, torch.Tensor]:
        top, left, height, width = self.crop.get_params(image, self.crop.scale, self.crop.ratio)
        flip = torch.rand(()) < 0.5
        views = []
        for size, mode, norm in zip(self.sizes, self.modes, self.norms, strict=True):
            view = TF.resized_crop(image, top, left, height, width, list(size), interpolation=mode)
            views.append(norm(TF.to_tensor(TF.hflip(view) if flip else view)))
        return {"image": views[0], "tokenizer_image": views[1]}


class WithMask:
    """Adds a per-sample patch mask, drawn in the data worker, to an image transform's output ("mask": (gh, gw) bool).

    Args:
        transform: Image transform returning a tensor or a dict of tensors with "image".
        mask_generator: Called with no argument; returns a (gh, gw) bool mask (see data/masking.py).
    """

    def __init__(self, transform: Callable, mask_generator: Callable[[], torch.Tensor]):
        self.transform, self.mask_generator = transform, mask_generator

    def __call__(self, image: Image.Image) -> dict[str, torch.Tensor]:
        out = self.transform(image)
        fields = out if isinstance(out, dict) else {"image": out}
        return {**fields, "mask": self.mask_generator()}


def _pair(size: int | Sequence[int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
