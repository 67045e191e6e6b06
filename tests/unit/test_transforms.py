"""Transforms alone: output shape and dtype, normalisation values (on the device, data/device.py), crop geometry,
flips, seeding."""

import random

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from data.device import batch_to_device
from data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    TwoViewCropFlip,
    WithMask,
    eval_transform,
    finetune_train_transform,
    pretrain_transform,
)

ALL_TRANSFORMS = [pretrain_transform, finetune_train_transform, eval_transform]


def _halves(size: int = 32) -> Image.Image:
    """Left half red, right half blue."""
    pixels = np.zeros((size, size, 3), dtype=np.uint8)  # (H, W, 3)
    pixels[:, : size // 2, 0] = 255
    pixels[:, size // 2 :, 2] = 255
    return Image.fromarray(pixels)


def normalised(transform, out) -> torch.Tensor:
    """What the device makes of one sample the transform emitted: its "image", (3, H, W) float32."""
    fields = out if isinstance(out, dict) else {"image": out}
    batch = {name: value[None] for name, value in fields.items()} | {"normalise": transform.normalisation}
    return batch_to_device(batch, torch.device("cpu"))["image"][0]


def test_imagenet_constants_are_timms():
    assert IMAGENET_MEAN == IMAGENET_DEFAULT_MEAN and IMAGENET_STD == IMAGENET_DEFAULT_STD


@pytest.mark.parametrize("make", ALL_TRANSFORMS)
@pytest.mark.parametrize(("img_size", "shape"), [(16, (3, 16, 16)), ((12, 20), (3, 12, 20))])
def test_constant_image_maps_to_normalised_constant(make, img_size, shape):
    colour = (200, 100, 30)
    transform = make(img_size, IMAGENET_MEAN, IMAGENET_STD)
    out = transform(Image.new("RGB", (37, 29), colour))
    assert out.shape == shape and out.dtype == torch.uint8  # leaves the worker as bytes
    assert torch.equal(out, torch.tensor(colour, dtype=torch.uint8).view(3, 1, 1).expand(shape))
    expected = (torch.tensor(colour) / 255 - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)  # (3,)
    image = normalised(transform, out)
    assert image.dtype == torch.float32
    torch.testing.assert_close(image, expected.view(3, 1, 1).expand(shape), rtol=0, atol=1e-5)


def test_eval_transform_resizes_then_centre_crops():
    pixels = np.zeros((40, 40, 3), dtype=np.uint8)
    pixels[8:32, 8:32] = 255  # white centre square, 60% of the side, on black
    image = Image.fromarray(pixels)
    unit = ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))  # mean 0, std 1: outputs are pixel values in [0, 1]
    centre_only = eval_transform(10, *unit, crop_pct=0.4)(image) / 255  # resize to 25 (square 5..20), keep 7..17
    assert centre_only.min() > 0.99
    whole = eval_transform(10, *unit, crop_pct=1.0)(image) / 255  # resize to 10, keep everything
    assert whole[:, 0, 0].max() < 0.05 and whole[:, 5, 5].min() > 0.95
    assert eval_transform(8, *unit)(Image.new("RGB", (30, 60))).shape == (3, 8, 8)  # non-square input
    with pytest.raises(ValueError, match="crop_pct"):
        eval_transform(8, *unit, crop_pct=1.5)


def test_eval_transform_is_deterministic():
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (24, 30, 3), dtype=np.uint8))
    transform = eval_transform(16, IMAGENET_MEAN, IMAGENET_STD)
    assert torch.equal(transform(image), transform(image))


def test_finetune_flip_probability():
    image = _halves()
    unit = ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    # scale (1, 1): the crop is the whole square image, so only the flip changes it
    flipped = finetune_train_transform(32, *unit, scale=(1.0, 1.0), hflip=1.0)(image) / 255
    kept = finetune_train_transform(32, *unit, scale=(1.0, 1.0), hflip=0.0)(image) / 255
    assert flipped[2, :, 0].min() > 0.99 and flipped[0, :, 0].max() < 0.01  # blue now on the left
    assert kept[0, :, 0].min() > 0.99 and kept[2, :, 0].max() < 0.01


@pytest.mark.parametrize("make", [pretrain_transform, finetune_train_transform])
def test_random_transforms_follow_the_torch_seed(make):
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (40, 40, 3), dtype=np.uint8))
    transform = make(16, IMAGENET_MEAN, IMAGENET_STD)
    torch.manual_seed(5)
    first = transform(image)
    torch.manual_seed(5)
    assert torch.equal(first, transform(image))
    assert not all(torch.equal(first, transform(image)) for _ in range(3))  # draws differ without reseeding


def test_pretrain_crop_area_follows_scale():
    ramp = np.tile(np.linspace(0, 255, 64).astype(np.uint8)[None, :, None], (64, 1, 3))  # (H, W, 3) left to right
    image = Image.fromarray(ramp)
    unit = ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    torch.manual_seed(0)
    # The ramp's range inside the output is the crop's width as a fraction of the image's width.
    small = [pretrain_transform(16, *unit, scale=(0.005, 0.01))(image)[0] / 255 for _ in range(10)]
    assert all(x.max() - x.min() < 0.15 for x in small)  # width <= sqrt(0.01 * 4/3) of the image
    full = pretrain_transform(16, *unit, scale=(1.0, 1.0))(image)[0] / 255
    assert full.max() - full.min() > 0.9


def test_two_views_share_one_crop_and_flip():
    pixels = np.zeros((40, 40, 3), dtype=np.uint8)
    pixels[:, :10, 0] = 255  # a red band on the left: where it lands tells the crop and the flip
    image = Image.fromarray(pixels)
    transform = TwoViewCropFlip(32, 16, (0, 0, 0), (1, 1, 1), (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), scale=(0.3, 1.0))
    for seed in range(20):
        torch.manual_seed(seed)
        out = transform(image)
        assert out["image"].shape == (3, 32, 32) and out["tokenizer_image"].shape == (3, 16, 16)
        assert out["image"].dtype == out["tokenizer_image"].dtype == torch.uint8
        small = torch.nn.functional.avg_pool2d(out["image"][None] / 255, 2)[0]  # the encoder view at 16 px, [0, 1]
        second = out["tokenizer_image"] / 255
        assert (small[0] - second[0]).abs().mean() < 0.1, seed  # same crop and flip, two resolutions


def test_two_views_carry_their_own_normalisations():
    second_mean, second_std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    transform = TwoViewCropFlip(32, 16, IMAGENET_MEAN, IMAGENET_STD, second_mean, second_std)
    out = transform(Image.new("RGB", (40, 40), (200, 100, 30)))
    batch = {name: view[None] for name, view in out.items()} | {"normalise": transform.normalisation}
    on_device = batch_to_device(batch, torch.device("cpu"))
    for name, mean, std in [("image", IMAGENET_MEAN, IMAGENET_STD), ("tokenizer_image", second_mean, second_std)]:
        expected = (torch.tensor([200, 100, 30]) / 255 - torch.tensor(mean)) / torch.tensor(std)  # (3,)
        torch.testing.assert_close(on_device[name][0, :, 0, 0], expected, rtol=0, atol=1e-5)


def test_with_mask_adds_the_generator_output():
    crop = eval_transform(8, IMAGENET_MEAN, IMAGENET_STD)
    transform = WithMask(crop, lambda: torch.ones(2, 2, dtype=torch.bool))
    out = transform(_halves(16))
    assert set(out) == {"image", "mask"} and out["image"].shape == (3, 8, 8) and out["mask"].all()
    assert transform.normalisation is crop.normalisation  # the device normalises what the wrapped transform emits


def _seed_like_the_pipeline(seed: int) -> None:
    """Seeds the global torch, python and numpy RNGs, as data/pipeline.py does before each sample's transform."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _noise(height: int = 48, width: int = 40) -> Image.Image:
    return Image.fromarray(np.random.default_rng(2).integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.mark.parametrize("policy", [None, "rand-m9-mstd0.5-inc1", "original", "augmix-m5-w4-d2"])
@pytest.mark.parametrize(("img_size", "shape"), [(24, (3, 24, 24)), ((16, 28), (3, 16, 28))])
def test_finetune_augmented_shape_and_dtype(policy, img_size, shape):
    transform = finetune_train_transform(img_size, IMAGENET_MEAN, IMAGENET_STD, auto_augment=policy, re_prob=0.5)
    for seed in range(3):
        _seed_like_the_pipeline(seed)
        out = transform(_noise())
        assert out["image"].shape == shape and out["image"].dtype == torch.uint8
        assert out["erase"].shape == (5,) and out["erase"].dtype == torch.int64  # the box, drawn in the worker
        image = normalised(transform, out)
        assert image.shape == shape and image.dtype == torch.float32 and image.isfinite().all()


@pytest.mark.parametrize("policy", ["rand-m9-mstd0.5-inc1", "original"])
def test_auto_augment_changes_images_reproducibly_under_the_pipeline_seeds(policy):
    plain = finetune_train_transform(24, IMAGENET_MEAN, IMAGENET_STD)
    augmented = finetune_train_transform(24, IMAGENET_MEAN, IMAGENET_STD, auto_augment=policy)
    image, num_changed = _noise(), 0
    for seed in range(12):
        _seed_like_the_pipeline(seed)
        reference = plain(image)
        _seed_like_the_pipeline(seed)
        first = augmented(image)
        random.random(), np.random.rand(), torch.rand(())  # move every RNG on before reseeding
        _seed_like_the_pipeline(seed)
        assert torch.equal(first, augmented(image)), seed  # the policy draws from the seeded global RNGs only
        num_changed += not torch.equal(first, reference)  # same seed, same crop: any difference is the policy's
    assert num_changed >= 6  # ops are skipped with some probability, and some change nothing: a few images pass


def test_auto_augment_rejects_unknown_policies():
    with pytest.raises(ValueError, match="not-a-policy"):
        finetune_train_transform(16, IMAGENET_MEAN, IMAGENET_STD, auto_augment="not-a-policy")
    with pytest.raises(ValueError, match="rand-q9"):
        finetune_train_transform(16, IMAGENET_MEAN, IMAGENET_STD, auto_augment="rand-q9")


def test_random_erasing_replaces_one_box_with_noise():
    """The worker draws the box, the device fills it (tests/unit/test_device_batch.py compares both with timm's)."""
    colour = (200, 100, 30)
    image = Image.new("RGB", (40, 40), colour)
    plain = finetune_train_transform(32, IMAGENET_MEAN, IMAGENET_STD)
    clean = normalised(plain, plain(image))  # (3, 32, 32), one value per channel
    erase = finetune_train_transform(32, IMAGENET_MEAN, IMAGENET_STD, re_prob=1.0)
    for seed in range(10):
        _seed_like_the_pipeline(seed)
        out = erase(image)
        assert torch.equal(out["image"], plain(image))  # uint8 from the worker: the box is not in it yet
        changed = (normalised(erase, out) - clean).abs().amax(dim=0) > 1e-4  # (32, 32): no longer the colour
        rows, cols = changed.any(dim=1).nonzero()[:, 0], changed.any(dim=0).nonzero()[:, 0]
        box = changed[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1]
        assert box.all(), seed  # the changed pixels fill one rectangle
        assert 0.02 * 32 * 32 * 0.8 <= box.numel() <= 32 * 32 / 3 * 1.2, seed  # timm's default area range
        top, left, height, width, _ = out["erase"].tolist()
        assert (rows.min(), cols.min(), box.shape) == (top, left, (height, width)), seed
    never = finetune_train_transform(32, IMAGENET_MEAN, IMAGENET_STD, re_prob=0.0)
    for seed in range(10):
        _seed_like_the_pipeline(seed)
        assert torch.equal(normalised(never, never(image)), clean)
    with pytest.raises(ValueError, match="re_prob"):
        finetune_train_transform(32, IMAGENET_MEAN, IMAGENET_STD, re_prob=1.5)


def test_posterize_at_the_top_magnitude_keeps_one_bit():
    """timm's PosterizeIncreasing asks Pillow for 0 bits at magnitude 10 (m9 + mstd0.5 reaches it); Pillow refuses."""
    transform = finetune_train_transform(32, IMAGENET_MEAN, IMAGENET_STD, auto_augment="rand-m9-mstd0.5-inc1")
    policy = transform.policy
    op = next(op for op in policy.ops if op.name == "PosterizeIncreasing")
    op.magnitude, op.magnitude_std, op.prob = 10, 0, 1.0
    out = op(_halves(32))
    assert set(np.asarray(out).flatten().tolist()) <= {0, 128}  # one bit per channel
