"""Image transforms: an RGB PIL image in, a (3, H, W) uint8 tensor out (or a dict of tensors with "image": a second
view for a tokenizer, a patch mask, a random-erasing box).

Images leave the data workers as uint8 and are normalised on the device (data/device.py says why): each transform's
`normalisation` maps the fields it emits as uint8 to the multiply-add that normalises them there, built from the
mean and std it was given, and the data pipeline puts it into every batch.

All randomness comes from the global torch / python / numpy RNGs, which the data pipeline seeds per sample.

A transform with a `decode(bytes)` method decodes its own images: the data pipeline calls it, where it catches and
counts corrupt images, instead of `data.decode.decode_rgb`, and passes what it returns to the transform. The
pretraining crops use this to decode JPEGs at a reduced size when their crop allows it (`CropFlip`), or, with
`data.decode: device`, to leave most JPEGs undecoded: the transform then emits the file, the box and the flip, and
the device decodes and renders them (data/device_decode.py).
"""

import math
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

import numpy as np
import torch
import torchvision.transforms.v2.functional as F2
from PIL import Image
from timm.data.auto_augment import augment_and_mix_transform, auto_augment_transform, rand_augment_transform
from timm.data.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import to_2tuple
from torchvision import transforms as T

from core.compat.timm import posterize_at_least_1_bit
from data.decode import ReducedImage, decode_rgb_reduced, to_rgb
from data.device import EraseBoxes, normalisation
from data.device_decode import DeviceJpeg, JpegCrop, device_jpeg

IMAGENET_MEAN = IMAGENET_DEFAULT_MEAN
IMAGENET_STD = IMAGENET_DEFAULT_STD


def pretrain_transform(
    img_size: int | tuple[int, int],
    mean: Sequence[float],
    std: Sequence[float],
    scale: tuple[float, float] = (0.2, 1.0),
    decode: Literal["worker", "device"] = "worker",
    hflip: float = 0.5,
) -> "CropFlip":
    """MAE's pretraining augmentation: bicubic RandomResizedCrop and a horizontal flip, nothing else.

    The same as torchvision's `Compose([RandomResizedCrop(img_size, scale, interpolation=BICUBIC),
    RandomHorizontalFlip(), ToTensor(), Normalize(mean, std)])`, rendered faster (see `CropFlip`), with ToTensor and
    Normalize left to the device.

    Args:
        img_size: Output size, an int for square images or (height, width).
        mean: Per-channel mean subtracted after scaling pixels to [0, 1].
        std: Per-channel standard deviation divided by.
        scale: Range of the crop's area as a fraction of the image.
        decode: Where JPEGs are decoded and rendered (`data.decode`): in the data worker, or on the training device
            for those it can take (data/device_decode.py).
        hflip: Probability of the horizontal flip (`data.hflip`; I-JEPA: 0).
    """
    view = View(img_size, T.InterpolationMode.BICUBIC, mean, std)
    return CropFlip([view], scale=scale, hflip=hflip, device_decode=decode == "device")


def finetune_train_transform(
    img_size: int | tuple[int, int],
    mean: Sequence[float],
    std: Sequence[float],
    scale: tuple[float, float] = (0.08, 1.0),
    hflip: float = 0.5,
    auto_augment: str | None = None,
    re_prob: float = 0.0,
) -> "FinetuneCrop":
    """Fine-tuning augmentation (DeiT / MAE fine-tuning): timm's training pipeline for these options.

    Bicubic RandomResizedCrop over a wide area range, horizontal flip, an optional timm AutoAugment / RandAugment /
    AugMix policy, to tensor, normalize, then optional timm RandomErasing of one box with per-pixel N(0, 1) noise
    (in normalized units; the box is drawn here, in the worker, and normalisation and noise happen on the device,
    see data/device.py). This is `timm.data.create_transform(is_training=True, interpolation="bicubic",
    re_mode="pixel", re_count=1)` with three differences, so that the policy-free transform stays crop + flip and
    costs what the pretraining crop does: torchvision's RandomResizedCrop draws (from torch rather than python
    `random`), rendered by `CropFlip`'s tensor path (within a few levels of Pillow's), and no ColorJitter (which timm
    adds by default only when no policy is given).

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
    policy = _augment_policy(auto_augment, min(to_2tuple(img_size)), mean) if auto_augment else None
    erase = EraseBoxes(re_prob) if re_prob > 0 else None
    return FinetuneCrop(View(img_size, T.InterpolationMode.BICUBIC, mean, std), scale, hflip, policy, erase)


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
    return posterize_at_least_1_bit(transform)  # Pillow >= 11 refuses the 0 bits timm asks for at m10


def eval_transform(
    img_size: int | tuple[int, int],
    mean: Sequence[float],
    std: Sequence[float],
    crop_pct: float = 0.875,
) -> "CentreCrop":
    """Evaluation: resize the shorter side to `img_size / crop_pct` (bicubic), then centre-crop `img_size`; ToTensor
    and Normalize happen on the device.

    With the defaults at 224 px this is the usual resize 256, centre crop 224.

    Args:
        img_size: Output size, an int for square images or (height, width).
        mean: Per-channel mean.
        std: Per-channel standard deviation.
        crop_pct: Fraction of the resized shorter side that the crop keeps.
    """
    if not 0 < crop_pct <= 1:
        raise ValueError(f"crop_pct must be in (0, 1], got {crop_pct}")
    height, width = to_2tuple(img_size)
    resize_to = math.floor(max(height, width) / crop_pct)  # the crop fits in both dimensions
    return CentreCrop(T.Resize(resize_to, interpolation=T.InterpolationMode.BICUBIC), (height, width), mean, std)


class CentreCrop:
    """A PIL resize, then the centre (height, width): (3, H, W) uint8 for "image", normalised on the device."""

    def __init__(self, resize: T.Resize, size: tuple[int, int], mean: Sequence[float], std: Sequence[float]):
        self.resize, self.crop = resize, T.CenterCrop(size)
        self.normalisation = {"image": normalisation(mean, std)}

    def __call__(self, image: Image.Image) -> torch.Tensor:
        """(3, H, W) uint8."""
        return F2.pil_to_tensor(self.crop(self.resize(image)))


class View(NamedTuple):
    """One rendering of a `CropFlip` box: its output size, resampling filter and normalisation."""

    size: int | tuple[int, int]
    """Output size, an int for square images or (height, width)."""
    interpolation: T.InterpolationMode
    mean: Sequence[float]
    std: Sequence[float]


class CropFlip:
    """torchvision's RandomResizedCrop and RandomHorizontalFlip for one or more views of the same box and flip, at a
    fraction of the cost; ToTensor and Normalize follow on the device (`normalisation`).

    The box and the flip are torchvision's own draws (`RandomResizedCrop.get_params` on the full-size image, then
    `torch.rand(1) < hflip`), so the same torch RNG state gives the same box. Rendering differs from the PIL path:

    - the image becomes a uint8 tensor once, and each view is resized by torchvision's tensor path (torch's
      antialiased uint8 kernels, within a few levels of Pillow's result) and flipped, with no intermediate PIL
      image; the device normalises it straight from uint8 with one multiply-add per channel;
    - with `decode` (which the data pipeline calls), a JPEG is decoded at 1/2, 1/4 or 1/8 of its size (libjpeg's
      DCT scaling) when every box the crop can draw on it still has at least the largest view's resolution at that
      size. The box is then rendered from the reduced image, its edges rounded to the reduced pixel grid (under half
      a pixel of the output). An ImageNet photo (~500 x 375) is never reduced for a 224 px crop; a 12 MP one is,
      by 4 at scale (0.2, 1).

    With `device_decode` (`data.decode: device`, one bicubic view), `decode` only reads the header of a JPEG the
    device can take (`data.device_decode.device_jpeg`), and the transform returns the file with the box and flip it
    draws (a `JpegCrop`), which the device renders as this class would (data/device_decode.py); the other images are
    decoded and rendered here.

    Args:
        views: The renderings, each of the same box and flip.
        scale: Range of the box's area as a fraction of the image (torchvision's `scale`).
        ratio: Range of the box's aspect ratio, width / height (torchvision's `ratio`).
        hflip: Probability of flipping horizontally.
        device_decode: Leave the JPEGs the device can decode to the device.

    Raises:
        ValueError: `device_decode` with another view than one bicubic one (the device renders only that).
    """

    def __init__(
        self,
        views: Sequence[View],
        scale: tuple[float, float] = (0.2, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        hflip: float = 0.5,
        device_decode: bool = False,
    ):
        self.scale, self.ratio, self.hflip = tuple(scale), tuple(ratio), hflip
        self.renderings = [(to_2tuple(v.size), v.interpolation) for v in views]  # per view: (height, width), filter
        self.normalisation = {"image": normalisation(views[0].mean, views[0].std)}  # what __call__ emits
        if device_decode and [mode for _, mode in self.renderings] != [T.InterpolationMode.BICUBIC]:
            raise ValueError("data.decode device renders one bicubic view on the device, not these views")
        self.device_decode = device_decode

    def decode(self, data: bytes) -> ReducedImage | DeviceJpeg:
        """Decodes image bytes to RGB, a JPEG at the largest reduction this crop allows (see the class docstring);
        with `device_decode`, a JPEG the device can take is only read up to its header.

        Raises:
            One of `data.decode.CORRUPT_IMAGE_ERRORS` for bytes that do not decode (a header, with `device_decode`).
        """
        jpeg = device_jpeg(data) if self.device_decode else None
        return jpeg if jpeg is not None else decode_rgb_reduced(data, self.max_reduction)

    def max_reduction(self, width: int, height: int) -> int:
        """The largest JPEG reduction (1, 2, 4 or 8) at which every box this crop can draw on a full-size
        width x height image keeps at least every view's output resolution."""
        box_width, box_height = smallest_box(width, height, self.scale, self.ratio)
        sizes = [size for size, _ in self.renderings]  # (height, width) each
        need_height, need_width = max(h for h, _ in sizes), max(w for _, w in sizes)
        return next((r for r in (8, 4, 2) if box_width >= r * need_width and box_height >= r * need_height), 1)

    def __call__(self, image: Image.Image | ReducedImage | DeviceJpeg) -> torch.Tensor | JpegCrop:
        """The first view, (3, H, W) uint8; for a JPEG left to the device, its file with the box and flip drawn."""
        if isinstance(image, DeviceJpeg):
            box, flip = self.draw(image.full_size)  # the draws `pixels` makes
            return JpegCrop(image.data, box, flip, self.renderings[0][0])
        return self.pixels(image)[0]

    def pixels(self, image: Image.Image | ReducedImage) -> list[torch.Tensor]:
        """Draws one box and one flip, then renders every view: (3, H, W) uint8 each."""
        if not isinstance(image, ReducedImage):
            image = ReducedImage(to_rgb(image), image.size, 1)
        box, flip = self.draw(image.full_size)
        top, left, box_height, box_width = reduced_box(box, image.reduction)
        pixels = torch.from_numpy(np.array(image.image)).permute(2, 0, 1)  # (3, h, w) uint8 over an (h, w, 3) buffer
        views = []
        for size, interpolation in self.renderings:
            view = F2.resized_crop(pixels, top, left, box_height, box_width, list(size), interpolation, antialias=True)
            views.append(view.flip(-1) if flip else view)  # (3, H, W) uint8
        return views

    def draw(self, full_size: tuple[int, int]) -> tuple[tuple[int, int, int, int], bool]:
        """torchvision's draws for a full-size (width, height) image: the (top, left, height, width) box, then the
        flip (`RandomHorizontalFlip` draws `torch.rand(1)` whatever its probability)."""
        width, height = full_size
        # get_params reads only the image's dimensions: a (0, H, W) tensor has the full-size ones and no pixels
        box = T.RandomResizedCrop.get_params(torch.empty(0, height, width), list(self.scale), list(self.ratio))
        return box, bool(torch.rand(1) < self.hflip)


class TwoViewCropFlip(CropFlip):
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
        encoder = View(img_size, T.InterpolationMode.BICUBIC, mean, std)
        super().__init__([encoder, View(second_size, T.InterpolationMode.LANCZOS, second_mean, second_std)], scale)
        self.normalisation["tokenizer_image"] = normalisation(second_mean, second_std)

    def __call__(self, image: Image.Image | ReducedImage) -> dict[str, torch.Tensor]:
        """(3, H, W) and (3, h, w) uint8."""
        first, second = self.pixels(image)
        return {"image": first, "tokenizer_image": second}


class FinetuneCrop(CropFlip):
    """`CropFlip`'s box and flip rendered once (uint8), then an optional PIL policy and an optional random-erasing
    box: the fine-tuning transform (see `finetune_train_transform`).

    Args:
        view: The rendering.
        scale: Range of the box's area as a fraction of the image.
        hflip: Probability of flipping horizontally.
        policy: A PIL-to-PIL augmentation applied to the rendered crop, or None.
        erase: Draws the erasing box, which the device fills after normalisation (data/device.py), or None.
    """

    def __init__(
        self,
        view: View,
        scale: tuple[float, float],
        hflip: float,
        policy: Callable[[Image.Image], Image.Image] | None,
        erase: EraseBoxes | None,
    ):
        super().__init__([view], scale=scale, hflip=hflip)
        self.policy, self.erase = policy, erase

    def __call__(self, image: Image.Image | ReducedImage) -> torch.Tensor | dict[str, torch.Tensor]:
        """(3, H, W) uint8; with erasing {"image": it, "erase": (5,) int64 box and noise seed}."""
        (pixels,) = self.pixels(image)  # (3, H, W) uint8
        if self.policy is not None:
            augmented = self.policy(Image.fromarray(pixels.permute(1, 2, 0).numpy()))  # (H, W, 3) buffer, RGB
            pixels = torch.from_numpy(np.array(augmented)).permute(2, 0, 1)
        return pixels if self.erase is None else {"image": pixels, "erase": self.erase(*pixels.shape[-2:])}


def smallest_box(width: int, height: int, scale: tuple[float, float], ratio: tuple[float, float]) -> tuple[int, int]:
    """Lower bounds on the width and the height of a box that `RandomResizedCrop.get_params` returns for a
    width x height image.

    A drawn box has area >= min(scale) x width x height and aspect ratio (w / h) within `ratio`, so w >=
    sqrt(area min(ratio)) and h >= sqrt(area / max(ratio)) (less a margin for float32 rounding); after 10 rejected
    draws it falls back to the central crop at the aspect ratio nearest the image's.
    """
    area, low, high = min(scale) * width * height, min(ratio), max(ratio)
    drawn = math.floor(math.sqrt(area * low) * (1 - 1e-6)), math.floor(math.sqrt(area / high) * (1 - 1e-6))
    if width / height < low:
        fallback = width, int(round(width / low))
    elif width / height > high:
        fallback = int(round(height * high)), height
    else:
        fallback = width, height
    return min(drawn[0], fallback[0]), min(drawn[1], fallback[1])


def reduced_box(box: tuple[int, int, int, int], reduction: int) -> tuple[int, int, int, int]:
    """A full-size (top, left, height, width) box on the image reduced `reduction` times, edges on its pixel grid."""
    if reduction == 1:
        return box
    top, left, height, width = box
    top_r, left_r = round(top / reduction), round(left / reduction)
    return top_r, left_r, round((top + height) / reduction) - top_r, round((left + width) / reduction) - left_r


class WithMask:
    """Adds a per-sample patch mask, drawn in the data worker, to an image transform's output ("mask": (gh, gw) bool).

    Args:
        transform: Image transform returning a tensor or a dict of tensors with "image".
        mask_generator: Called with no argument; returns a (gh, gw) bool mask (see data/masking.py).
    """

    def __init__(self, transform: Callable, mask_generator: Callable[[], torch.Tensor]):
        self.transform, self.mask_generator = transform, mask_generator
        if hasattr(transform, "decode"):
            self.decode = transform.decode  # the pipeline decodes images the way the wrapped transform reads them
        if hasattr(transform, "normalisation"):
            self.normalisation = transform.normalisation  # and the device normalises what it emits

    def __call__(self, image: Image.Image | ReducedImage) -> dict[str, torch.Tensor]:
        out = self.transform(image)
        fields = out if isinstance(out, dict) else {"image": out}
        return {**fields, "mask": self.mask_generator()}
