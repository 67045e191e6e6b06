"""The fast pretraining crop (data/transforms.py `CropFlip`) against torchvision's RandomResizedCrop path: the same
boxes and flips, the same box statistics after a reduced JPEG decode, the same pixels within a few levels, and
corrupt images still counted when the pipeline lets the transform decode."""

import io
import math

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image
from torchvision import transforms as T
from torchvision.transforms import functional as TF

from data.decode import ReducedImage, decode_rgb
from data.device import batch_to_device
from data.pipeline import make_train_loader
from data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    TwoViewCropFlip,
    WithMask,
    pretrain_transform,
    reduced_box,
    smallest_box,
)

SCALE = (0.2, 1.0)
RATIO = (3 / 4, 4 / 3)
STD = torch.tensor(IMAGENET_STD).view(3, 1, 1)


def _photo(width: int, height: int, seed: int = 0) -> Image.Image:
    """A smooth random colour field with a few sharp-edged rectangles: structure that shows any shift of the box."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8))  # (h, w, 3)
    pixels = np.array(coarse.resize((width, height), Image.Resampling.BICUBIC))  # (H, W, 3)
    for _ in range(6):
        x, y = rng.integers(0, width * 3 // 4), rng.integers(0, height * 3 // 4)
        pixels[y : y + height // 5, x : x + width // 5] = rng.integers(0, 256, 3)
    return Image.fromarray(pixels)


def _jpeg(image: Image.Image, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90, **kwargs)
    return buffer.getvalue()


def _torchvision_pretrain(img_size: int) -> T.Compose:
    """What `pretrain_transform` stands for: torchvision's PIL path."""
    return T.Compose(
        [
            T.RandomResizedCrop(img_size, scale=SCALE, interpolation=T.InterpolationMode.BICUBIC),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


@pytest.mark.parametrize("size", [(500, 375), (375, 500), (1000, 120), (90, 900), (3000, 2000), (20, 20)])
def test_same_rng_state_draws_torchvisions_box_and_flip(size):
    crop, image = pretrain_transform(224, IMAGENET_MEAN, IMAGENET_STD), Image.new("RGB", size)
    rrc = _torchvision_pretrain(224).transforms[0]
    for seed in range(100):  # the narrow sizes reach get_params' central fallback crop
        torch.manual_seed(seed)
        expected = rrc.get_params(image, rrc.scale, rrc.ratio), bool(torch.rand(1) < 0.5)
        next_draw = torch.rand(1)
        torch.manual_seed(seed)
        assert crop.draw(size) == expected, seed
        assert torch.equal(torch.rand(1), next_draw), seed  # as many draws as torchvision's pair of transforms


def _ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical CDFs."""
    points = np.concatenate([a, b])
    cdf_a = np.searchsorted(np.sort(a), points, side="right") / len(a)
    cdf_b = np.searchsorted(np.sort(b), points, side="right") / len(b)
    return float(np.abs(cdf_a - cdf_b).max())


def _box_statistics(boxes: np.ndarray, width: int, height: int) -> dict[str, np.ndarray]:
    """Area fraction, log aspect ratio and relative centre of (top, left, height, width) boxes (N, 4)."""
    top, left, h, w = boxes.T.astype(np.float64)
    return {
        "scale": h * w / (width * height),
        "log_ratio": np.log(w / h),
        "centre_x": (left + w / 2) / width,
        "centre_y": (top + h / 2) / height,
    }


@pytest.mark.parametrize(("size", "reduction"), [((500, 375), 1), ((2000, 1500), 2), ((4000, 3000), 4)])
def test_box_statistics_after_reduction_match_torchvisions(size, reduction):
    """Boxes the fast path renders (drawn on the full-size geometry, mapped onto the reduced decode, scaled back)
    against boxes of torchvision's RandomResizedCrop on the full image, each under its own seed."""
    crop, rrc, num = pretrain_transform(224, IMAGENET_MEAN, IMAGENET_STD), T.RandomResizedCrop(224, scale=SCALE), 3000
    assert crop.max_reduction(*size) == reduction
    torch.manual_seed(1)
    ours = np.array([[x * reduction for x in reduced_box(crop.draw(size)[0], reduction)] for _ in range(num)])
    torch.manual_seed(2)
    image = Image.new("RGB", size)
    theirs = np.array([rrc.get_params(image, rrc.scale, rrc.ratio) for _ in range(num)])
    bound = 1.95 * math.sqrt(2 / num)  # the KS critical value at alpha = 0.001 for two samples of `num`
    ours_stats, theirs_stats = _box_statistics(ours, *size), _box_statistics(theirs, *size)
    for name, values in ours_stats.items():
        assert _ks_statistic(values, theirs_stats[name]) < bound, name
    torch.manual_seed(2)
    narrower = T.RandomResizedCrop(224, scale=(0.25, 1.0))  # the test can tell a slightly different crop apart
    other = np.array([narrower.get_params(image, narrower.scale, narrower.ratio) for _ in range(num)])
    assert _ks_statistic(ours_stats["scale"], _box_statistics(other, *size)["scale"]) > bound
    if reduction > 1:  # every box rendered from a reduced decode keeps the output resolution there
        assert (ours[:, 2:] >= 224 * reduction).all()


def test_reduced_box_stays_within_half_a_reduced_pixel():
    for box in [(0, 0, 1500, 2000), (3, 5, 701, 999), (17, 1, 450, 451)]:
        for reduction in (1, 2, 4, 8):
            top, left, height, width = reduced_box(box, reduction)
            edges = np.array([top, left, top + height, left + width]) * reduction
            full = np.array([box[0], box[1], box[0] + box[2], box[1] + box[3]])
            assert np.abs(edges - full).max() <= reduction / 2, (box, reduction)


def test_smallest_box_bounds_every_drawn_box():
    rng = np.random.default_rng(0)
    rrc = T.RandomResizedCrop(224, scale=SCALE)
    sizes = [(500, 375), (3000, 2000), (1000, 120), (90, 900), (224, 224)]
    sizes += [tuple(int(v) for v in rng.integers(50, 5000, 2)) for _ in range(20)]
    torch.manual_seed(0)
    for width, height in sizes:
        min_width, min_height = smallest_box(width, height, SCALE, RATIO)
        image = torch.empty(0, height, width)
        boxes = np.array([rrc.get_params(image, rrc.scale, rrc.ratio) for _ in range(500)])
        assert boxes[:, 3].min() >= min_width and boxes[:, 2].min() >= min_height, (width, height)
        if RATIO[0] <= width / height <= RATIO[1]:  # the bound is nearly reached, not just safe
            assert boxes[:, 3].min() < 1.25 * min_width and boxes[:, 2].min() < 1.25 * min_height, (width, height)


def test_reduction_follows_the_largest_view():
    single = pretrain_transform(224, IMAGENET_MEAN, IMAGENET_STD)
    assert [single.max_reduction(w, h) for w, h in [(500, 375), (1024, 768), (2000, 1500), (4032, 3024)]] == [
        1,
        1,
        2,
        4,
    ]
    assert pretrain_transform(112, IMAGENET_MEAN, IMAGENET_STD).max_reduction(2000, 1500) == 4
    two_views = TwoViewCropFlip(224, 112, IMAGENET_MEAN, IMAGENET_STD, (0.5,) * 3, (0.5,) * 3)
    assert two_views.max_reduction(2000, 1500) == 2  # limited by the 224 px view
    assert pretrain_transform((224, 448), IMAGENET_MEAN, IMAGENET_STD).max_reduction(2000, 1500) == 1


def _normalised(transform, out: torch.Tensor | dict) -> dict[str, torch.Tensor]:
    """The normalised views the device makes of one sample `transform` emitted: (3, H, W) float32 each."""
    fields = out if isinstance(out, dict) else {"image": out}
    batch = {name: view[None] for name, view in fields.items()} | {"normalise": transform.normalisation}
    return {name: view[0] for name, view in batch_to_device(batch, torch.device("cpu")).items()}


def _normalised_levels(x: torch.Tensor) -> torch.Tensor:
    """A difference of ImageNet-normalised images in 8-bit pixel levels."""
    return x * STD * 255


def test_fast_path_matches_torchvision_where_no_reduction_applies():
    data = _jpeg(_photo(500, 375))
    crop, plain = pretrain_transform(224, IMAGENET_MEAN, IMAGENET_STD), _torchvision_pretrain(224)
    reduced, image = crop.decode(data), decode_rgb(data)
    assert reduced.reduction == 1 and reduced.full_size == (500, 375)
    assert np.array_equal(np.asarray(reduced.image), np.asarray(image))
    for seed in range(10):
        torch.manual_seed(seed)
        pixels = crop(reduced)
        ours = _normalised(crop, pixels)["image"]
        torch.manual_seed(seed)
        theirs = plain(image)
        assert ours.shape == theirs.shape == (3, 224, 224) and ours.dtype == torch.float32
        levels = _normalised_levels(ours - theirs).abs()
        assert levels.max() <= 3 and levels.mean() < 0.05, (seed, levels.max(), levels.mean())
        torch.manual_seed(seed)
        assert torch.equal(crop(image), pixels)  # a PIL image in: the same output


def test_two_views_match_torchvision_where_no_reduction_applies():
    data = _jpeg(_photo(500, 375, seed=1))
    second_mean, second_std = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    transform = TwoViewCropFlip(224, 112, IMAGENET_MEAN, IMAGENET_STD, second_mean, second_std)
    image, rrc = decode_rgb(data), T.RandomResizedCrop(224, scale=SCALE)
    for seed in range(10):
        torch.manual_seed(seed)
        out = _normalised(transform, transform(transform.decode(data)))
        torch.manual_seed(seed)
        top, left, height, width = rrc.get_params(image, rrc.scale, rrc.ratio)
        flip = torch.rand(1) < 0.5
        for name, size, mode, (mean, std) in [
            ("image", 224, T.InterpolationMode.BICUBIC, (IMAGENET_MEAN, IMAGENET_STD)),
            ("tokenizer_image", 112, T.InterpolationMode.LANCZOS, (second_mean, second_std)),
        ]:
            view = TF.resized_crop(image, top, left, height, width, [size, size], interpolation=mode)
            expected = TF.normalize(TF.to_tensor(TF.hflip(view) if flip else view), mean, std)
            levels = (out[name] - expected).abs() * torch.tensor(std).view(3, 1, 1) * 255
            assert levels.max() <= 3 and levels.mean() < 0.05, (seed, name, levels.max(), levels.mean())


def test_reduced_decode_renders_the_same_picture():
    data = _jpeg(_photo(2000, 1500, seed=2))
    crop, plain = pretrain_transform(224, IMAGENET_MEAN, IMAGENET_STD), _torchvision_pretrain(224)
    reduced, image = crop.decode(data), decode_rgb(data)
    assert reduced.reduction == 2 and reduced.full_size == (2000, 1500) and reduced.image.size == (1000, 750)
    for seed in range(5):
        torch.manual_seed(seed)
        ours = _normalised(crop, crop(reduced))["image"]
        torch.manual_seed(seed)
        levels = _normalised_levels(ours - plain(image)).abs()
        # libjpeg's 4x4 inverse DCT against Pillow's bicubic antialiasing: close, not equal (here means of 0.3-0.5
        # levels, 99th percentiles of 3-7). Moving the box by one pixel of the reduced image gives 0.8-1.2 and 11-18.
        assert levels.mean() < 0.7 and torch.quantile(levels.flatten(), 0.99) < 10, (seed, levels.mean())


def _write_shard(path: str, images: list[bytes]) -> None:
    with wds.TarWriter(path) as writer:
        for i, data in enumerate(images):
            writer.write({"__key__": f"s_{i:08d}", "jpg": data, "cls": i % 2})


def test_pipeline_decodes_with_the_transform_and_counts_corrupt_images(tmp_path):
    good = _jpeg(_photo(960, 720, seed=3))  # reduced by 4 for a 64 px crop at scale (0.2, 1)
    images = [good, good[: len(good) // 2], good, b"garbage, not a jpeg", good, good]
    shard = str(tmp_path / "s-000000.tar")
    _write_shard(shard, images)
    transform = WithMask(
        pretrain_transform(64, IMAGENET_MEAN, IMAGENET_STD), lambda: torch.ones(4, 4, dtype=torch.bool)
    )
    assert transform.decode(good).reduction == 4
    loader = make_train_loader(
        [shard],
        transform=transform,
        batch_size=4,
        seed=0,
        rank=0,
        world_size=1,
        num_workers=0,
        shuffle_buffer=0,
        resampled=False,
    )
    batch = next(iter(loader))
    assert batch["key"] == ["s_00000000", "s_00000002", "s_00000004", "s_00000005"]
    assert int(batch["num_corrupt"]) == 2  # the truncated JPEG fails inside `decode`, the garbage at open
    assert batch["image"].shape == (4, 3, 64, 64) and batch["mask"].shape == (4, 4, 4)
    assert batch["image"].dtype == torch.uint8 and torch.equal(
        batch["normalise"]["image"], transform.normalisation["image"]
    )


def test_pipeline_passes_what_decode_returns_to_the_transform(tmp_path):
    shard = str(tmp_path / "s-000000.tar")
    _write_shard(shard, [_jpeg(_photo(64, 48))] * 2)
    seen = []

    class Recording:
        def decode(self, data: bytes) -> ReducedImage:
            return ReducedImage(Image.new("RGB", (1, 1)), (len(data), 0), 1)

        def __call__(self, image: ReducedImage) -> torch.Tensor:
            seen.append(image)
            return torch.zeros(3, 2, 2)

    loader = make_train_loader(
        [shard], transform=Recording(), batch_size=2, seed=0, rank=0, world_size=1, num_workers=0, shuffle_buffer=0
    )
    next(iter(loader))
    assert len(seen) >= 2 and all(isinstance(s, ReducedImage) and s.full_size[0] > 100 for s in seen)
