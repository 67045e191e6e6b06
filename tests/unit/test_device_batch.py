"""Batches cross from the workers as uint8 and become model input on the device (data/device.py): a quarter of the
bytes, the same normalised values as the float32 the workers made before, timm's random erasing and mixing, and
pinned memory that survives mixing.

Shapes: B batch size, H/W image height/width, K classes.
"""

import random

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image
from timm.data.random_erasing import RandomErasing
from torchvision import transforms as T

import data.pipeline
from core.engine.precision import to_device
from data.device import EraseBoxes, batch_to_device
from data.mixing import MixBatches, mixed
from data.pipeline import make_train_loader
from data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    WithMask,
    eval_transform,
    finetune_train_transform,
    pretrain_transform,
)
from pretrain.pictures import _TwoViews

CPU = torch.device("cpu")
SIZE, NUM_CLASSES = 32, 4


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> str:
    """One shard of 8 random 48 x 40 PNGs, labels 0..3."""
    path = str(tmp_path_factory.mktemp("shard") / "s-000000.tar")
    rng = np.random.default_rng(0)
    with wds.TarWriter(path) as writer:
        for i in range(8):
            image = Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8))
            writer.write({"__key__": f"s_{i:08d}", "png": image, "cls": i % NUM_CLASSES})
    return path


def _first_batch(shard: str, transform, batch_size: int = 8) -> dict:
    loader = make_train_loader(
        [shard], transform=transform, batch_size=batch_size, seed=3, rank=0, world_size=1, num_workers=0,
        shuffle_buffer=0, resampled=False,
    )  # fmt: skip
    return next(iter(loader))


def _workers_float32(pixels: torch.Tensor, mean, std) -> torch.Tensor:
    """What `CropFlip.normalise` returned in the worker before batches crossed as uint8 (its code, verbatim)."""
    mean_t, std_t = (torch.tensor(v, dtype=torch.float32).view(3, 1, 1) for v in (mean, std))
    gain, offset = 1 / (255 * std_t), -mean_t / std_t
    return pixels.float().contiguous().mul_(gain).add_(offset)


def test_worker_batch_is_uint8_and_the_device_batch_equals_the_workers_float32(shard):
    batch = _first_batch(shard, pretrain_transform(SIZE, IMAGENET_MEAN, IMAGENET_STD))
    pixels = batch["image"]  # (B, 3, H, W) as it crossed from the worker
    assert pixels.dtype == torch.uint8 and pixels.shape == (8, 3, SIZE, SIZE)
    image = to_device(batch, CPU, "fp32")["image"]
    assert image.dtype == torch.float32 and image.nbytes == 4 * pixels.nbytes  # a quarter of the shared memory
    expected = torch.stack([_workers_float32(p, IMAGENET_MEAN, IMAGENET_STD) for p in pixels])
    assert torch.equal(image, expected)  # bit-exact: the same two rounded float32 operations
    assert torch.equal(to_device(batch, CPU, "fp16")["image"], expected.half())  # fp16 casts after normalising
    assert "normalise" not in to_device(batch, CPU, "fp32")  # consumed: the model sees the fields it saw before


def test_eval_batch_equals_torchvisions_to_tensor_and_normalize_within_two_ulp():
    """The eval crop was normalised by ToTensor + Normalize ((x / 255 - mean) / std) in the worker; the device's
    multiply-add rounds differently. Over every pixel level of every channel the gap is at most 2 ulp of the
    [2, 4) binade that ImageNet's normalised range reaches (4.8e-7)."""
    tolerance = 2 * torch.finfo(torch.float32).eps * 2  # 2 ulp at [2, 4)
    transform = eval_transform(SIZE, IMAGENET_MEAN, IMAGENET_STD)
    to_tensor_normalize = T.Compose([T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    levels = np.tile(np.arange(256, dtype=np.uint8).reshape(16, 16, 1), (1, 1, 3))  # (16, 16, 3): every level
    batch = {"image": torch.from_numpy(levels).permute(2, 0, 1)[None], "normalise": transform.normalisation}
    gap = (batch_to_device(batch, CPU)["image"][0] - to_tensor_normalize(Image.fromarray(levels))).abs()
    assert 0 < gap.max() <= tolerance  # they do differ: the bound is the claim
    rng = np.random.default_rng(1)
    images = [Image.fromarray(rng.integers(0, 256, (37, 45, 3), dtype=np.uint8)) for _ in range(4)]
    batch = {"image": torch.stack([transform(i) for i in images]), "normalise": transform.normalisation}
    worker = T.Compose([transform.resize, transform.crop, to_tensor_normalize])  # the eval transform until now
    expected = torch.stack([worker(i) for i in images])
    torch.testing.assert_close(batch_to_device(batch, CPU)["image"], expected, rtol=0, atol=tolerance)


@pytest.mark.parametrize("probability", [0.25, 1.0])
def test_erase_boxes_are_timms_for_the_same_python_seed(probability):
    """timm's RandomErasing erases a constant normalised image in place; the changed pixels are its box."""
    timm_erase = RandomErasing(probability, mode="pixel", max_count=1, device="cpu")
    ours = EraseBoxes(probability)
    num_boxes = 0
    for seed in range(40):
        height, width = (24, 40) if seed % 2 else (40, 24)
        random.seed(seed)
        erased = timm_erase(torch.full((3, height, width), 7.0))
        after_timm = random.random()
        changed = (erased != 7.0).any(dim=0)  # (H, W)
        random.seed(seed)
        top, left, box_height, box_width, _ = ours(height, width).tolist()
        assert random.random() == after_timm, seed  # as many python draws as timm's
        expected = torch.zeros(height, width, dtype=torch.bool)
        expected[top : top + box_height, left : left + box_width] = True
        assert torch.equal(changed, expected), seed
        num_boxes += box_height > 0
    assert 0 < num_boxes < 40 if probability < 1 else num_boxes == 40


def test_erased_noise_is_standard_normal_and_the_rest_is_the_plain_normalisation(shard):
    """Per-pixel N(0, 1) in normalised units inside each box (timm's mode "pixel"); outside, exactly the un-erased
    normalisation. The noise is a function of the batch: copying it twice (the FLOP count, then the loop) gives the
    same input, and no global RNG of the trainer moves."""
    plain = finetune_train_transform(SIZE, IMAGENET_MEAN, IMAGENET_STD)
    erasing = finetune_train_transform(SIZE, IMAGENET_MEAN, IMAGENET_STD, re_prob=1.0)
    batch, reference = _first_batch(shard, erasing), _first_batch(shard, plain)
    assert torch.equal(batch["image"], reference["image"])  # the same crops: erasing is not in the worker's bytes
    assert batch["erase"].shape == (8, 5) and (batch["erase"][:, 2] > 0).all()
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    image = to_device(batch, CPU, "fp32")["image"]
    assert torch.equal(torch.get_rng_state(), states[0]) and random.getstate() == states[1]
    assert np.array_equal(np.random.get_state()[1], states[2])
    assert torch.equal(to_device(batch, CPU, "fp32")["image"], image)
    inside = torch.zeros(8, 1, SIZE, SIZE, dtype=torch.bool)
    for i, (top, left, height, width, _) in enumerate(batch["erase"].tolist()):
        inside[i, :, top : top + height, left : left + width] = True
    inside = inside.expand_as(image)
    clean = to_device(reference, CPU, "fp32")["image"]
    assert torch.equal(image[~inside], clean[~inside])
    noise = image[inside].double()
    assert noise.numel() > 2000 and abs(noise.mean()) < 0.1 and abs(noise.std() - 1) < 0.05
    assert (noise.abs() > 3).float().mean() < 0.01  # Gaussian tails, not the image's values
    other = {**batch, "erase": batch["erase"].clone()}
    other["erase"][:, 4] += 1  # other samples' noise seeds: other noise
    assert not torch.equal(to_device(other, CPU, "fp32")["image"][inside], image[inside])


def _simulate_cuda_pinning(monkeypatch) -> set[int]:
    """Makes the loader believe CUDA is present and pin every tensor; returns the data pointers it pinned."""
    pinned: set[int] = set()

    def pin_memory(tensor: torch.Tensor, device=None) -> torch.Tensor:
        copy = tensor.clone()  # a pinned copy, as the real call makes
        pinned.add(copy.data_ptr())
        return copy

    monkeypatch.setattr(data.pipeline.torch.cuda, "is_available", lambda: True)  # make_train_loader's pin_memory=
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)  # DataLoader's check
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    return pinned


def test_mixing_keeps_the_loaders_pinned_memory(shard, monkeypatch):
    """The loader's pinned tensors reach the host-to-device copy: mixing adds its draw and replaces nothing, so the
    copy stays asynchronous (timm mixing the images on the host made new, pageable ones)."""
    pinned = _simulate_cuda_pinning(monkeypatch)
    transform = finetune_train_transform(SIZE, IMAGENET_MEAN, IMAGENET_STD, re_prob=0.5)
    loader = make_train_loader(
        [shard], transform=transform, batch_size=8, seed=3, rank=0, world_size=1, num_workers=0, shuffle_buffer=0,
        resampled=False,
    )  # fmt: skip
    assert loader.pin_memory
    mix = MixBatches(num_classes=NUM_CLASSES, mixup=0.8, cutmix=1.0)
    np.random.seed(0)
    batch = next(mixed(iter(loader), mix))
    tensors = [batch["image"], batch["label"], batch["erase"], *batch["normalise"].values()]
    assert all(t.data_ptr() in pinned for t in tensors)
    assert batch["image"].dtype == torch.uint8 and batch["label"].dtype == torch.int64
    out = to_device(batch, CPU, "fp32")  # and on the device: mixed images and (B, K) soft targets
    assert out["image"].dtype == torch.float32 and out["label"].shape == (8, NUM_CLASSES)
    torch.testing.assert_close(out["label"].sum(dim=1), torch.ones(8))


def test_the_picture_batchs_tokenizer_view_is_normalised_with_the_tokenizers_own_mean_and_std():
    second_mean, second_std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    views = _TwoViews(eval_transform(8, IMAGENET_MEAN, IMAGENET_STD), eval_transform(4, second_mean, second_std))
    transform = WithMask(views, lambda: torch.ones(2, 2, dtype=torch.bool))
    out = transform(Image.new("RGB", (20, 20), (200, 100, 30)))
    batch = {name: value[None] for name, value in out.items()} | {"normalise": transform.normalisation}
    on_device = batch_to_device(batch, CPU)
    for name, mean, std in [("image", IMAGENET_MEAN, IMAGENET_STD), ("tokenizer_image", second_mean, second_std)]:
        expected = (torch.tensor([200, 100, 30]) / 255 - torch.tensor(mean)) / torch.tensor(std)  # (3,)
        torch.testing.assert_close(on_device[name][0, :, 0, 0], expected, rtol=0, atol=1e-5)
    assert torch.equal(on_device["mask"], batch["mask"])
