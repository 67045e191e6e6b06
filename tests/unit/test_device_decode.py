"""`data.decode: device` (data/device_decode.py) against the worker path: the same boxes and flips from the same RNG
state, the same pixels within a measured tolerance, mixed batches, corrupt files, the real pipeline with its
workers and its resume cursor, and a tiny MAE pretraining whose losses match worker decoding.

Tolerance (the device path on the CPU, float32 antialiased bicubic, against the worker's uint8 kernel; generated
photo-like JPEGs from 96 x 64 to 1024 x 768, 224 px crops at scale (0.2, 1), 30 seeds each): where the worker decodes
at full size, a mean absolute difference of 0.11-0.22 uint8 levels per image, a 99.9th percentile of 1 level, at most
0.013% of pixels off by more than 2 levels and a maximum of 9 (sharp edges in small images blown up, where bicubic
overshoots: the uint8 kernel clips its intermediate pass, float32 does not). Where the worker decodes at a DCT
reduction (2000 x 1500 and larger at 224 px) its own rendering is the approximate one: the two differ by 0.9-2.2 levels
on average (up to 4.2 for one image), while against torchvision's full-size Pillow reference the device path stays at
0.06-0.11 levels and the worker's at 0.9-2.2.

Shapes: B batch size, H/W output height/width.
"""

from __future__ import annotations

import io
import logging
import math

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn
from torchvision.transforms import functional as TF

import data.device_decode
from core.engine.loop import LoopHooks, train
from core.engine.setup import parallelize
from core.engine.stage import StageRun
from core.engine.stream import train_loader
from core.engine.train_state import TrainState
from core.recipe.config import dump_config, load_config
from core.report.logging import MetricsLogger
from data import write as data_write
from data.decode import ReducedImage, decode_rgb
from data.device import batch_to_device
from data.device_decode import DeviceCrops, DeviceJpeg, JpegCrop, decode_crops, stack_images
from data.masking import RandomMaskGenerator
from data.pipeline import make_train_loader, zero_counts
from data.transforms import IMAGENET_MEAN, IMAGENET_STD, CropFlip, View, WithMask, pretrain_transform
from data.write import write_shards
from pretrain.objectives import objective_builder, train_transform
from tests.launching import TINY_MODEL, losses, position_after, read_metrics

CPU = torch.device("cpu")
STD = torch.tensor(IMAGENET_STD).view(3, 1, 1)
MEAN = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)


def _photo(width: int, height: int, seed: int) -> Image.Image:
    """Photo-like: a smooth colour field, sharp-edged rectangles, fine grain and pixel noise (whose entropy, as a
    photo's, decides how a JPEG decodes and resizes)."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8))  # (h, w, 3)
    pixels = np.asarray(coarse.resize((width, height), Image.Resampling.BICUBIC), dtype=np.float32)  # (H, W, 3)
    for _ in range(8):
        x, y = rng.integers(0, width * 3 // 4), rng.integers(0, height * 3 // 4)
        pixels[y : y + height // 5, x : x + width // 5] = rng.integers(0, 256, 3)
    pixels += rng.normal(0, 12, pixels.shape)
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8))


def _encode(image: Image.Image, format: str = "JPEG", **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format, **({"quality": 90} if format == "JPEG" else {}), **kwargs)
    return buffer.getvalue()


def _jpeg(width: int, height: int, seed: int = 0, **kwargs) -> bytes:
    return _encode(_photo(width, height, seed), **kwargs)


def _rotated_jpeg(width: int, height: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # EXIF orientation: rotate 90 degrees clockwise to display
    return _jpeg(width, height, exif=exif.tobytes())


def _bad_huffman_table(data: bytes) -> bytes:
    """`data` with a Huffman table whose code counts overflow: the header still parses (Pillow skips the table), the
    decode fails on every decoder."""
    at = data.index(b"\xff\xc4") + 5  # DHT marker, length (2), table class and id (1): the 16 code counts follow
    return data[:at] + b"\xff" * 16 + data[at + 16 :]


def _both_crops(size: int = 224, scale: tuple[float, float] = (0.2, 1.0)) -> tuple[CropFlip, CropFlip]:
    return (
        pretrain_transform(size, IMAGENET_MEAN, IMAGENET_STD, scale=scale),
        pretrain_transform(size, IMAGENET_MEAN, IMAGENET_STD, scale=scale, decode="device"),
    )


def _device_pixels(crops: list[JpegCrop | torch.Tensor]) -> torch.Tensor:
    """(B, 3, H, W) uint8: the batch's images as `batch_to_device` makes them on the CPU, before normalising."""
    images, failed = decode_crops(stack_images(crops), CPU, [f"k{i}" for i in range(len(crops))])
    assert failed == []
    return images


def _levels(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.int() - b.int()).abs().float()


# ---------------------------------------------------------------- which images the device takes, which boxes it draws


def test_the_worker_reads_the_header_of_plain_jpegs_and_decodes_the_rest():
    _, device = _both_crops()
    plain = device.decode(_jpeg(500, 375))
    assert isinstance(plain, DeviceJpeg) and plain.full_size == (500, 375)
    others = {
        "png": _encode(_photo(64, 48, 0), "PNG"),
        "greyscale": _encode(_photo(64, 48, 0).convert("L")),
        "cmyk": _encode(_photo(64, 48, 0).convert("CMYK")),
        "progressive": _jpeg(64, 48, progressive=True),
        "exif-rotated": _rotated_jpeg(64, 48),
        "bytes after the end": _jpeg(64, 48) + b"\0" * 8,
    }
    for name, encoded in others.items():
        image = device.decode(encoded)
        assert isinstance(image, ReducedImage) and image.image.mode == "RGB", name
    assert device.decode(others["exif-rotated"]).full_size == (48, 64)  # the box is drawn on the displayed image
    with pytest.raises(OSError):  # cut short: Pillow judges it, as without device decoding
        device.decode(_jpeg(64, 48)[:-400])
    with pytest.raises(OSError):  # a JPEG whose header does not parse fails in the worker, where it is counted
        device.decode(b"\xff\xd8\xff\xe0" + b"\x13" * 64 + b"\xff\xd9")


@pytest.mark.parametrize("size", [(500, 375), (375, 500), (4000, 3000), (160, 120)])
def test_the_device_crop_draws_the_workers_box_and_flip_and_leaves_the_rng_alike(size):
    worker, device = _both_crops()
    data = _jpeg(*size)
    decoded, header = worker.decode(data), device.decode(data)
    for seed in range(20):
        torch.manual_seed(seed)
        expected = worker.draw(decoded.full_size)
        torch.manual_seed(seed)
        worker(decoded)
        after_worker = torch.rand(4)  # what the mask generator then draws
        torch.manual_seed(seed)
        crop = device(header)
        assert isinstance(crop, JpegCrop) and (crop.box, crop.flip) == expected and crop.size == (224, 224)
        assert torch.equal(torch.rand(4), after_worker)


def test_device_decoding_renders_one_bicubic_view_only():
    views = [View(224, TF.InterpolationMode.BICUBIC, IMAGENET_MEAN, IMAGENET_STD)] * 2
    with pytest.raises(ValueError, match="data.decode device renders one bicubic view"):
        CropFlip(views, device_decode=True)
    lanczos = View(112, TF.InterpolationMode.LANCZOS, IMAGENET_MEAN, IMAGENET_STD)
    with pytest.raises(ValueError, match="data.decode device"):
        CropFlip([lanczos], device_decode=True)


# ---------------------------------------------------------------- pixels: the device path on the CPU


@pytest.mark.parametrize("size", [(500, 375), (375, 500), (500, 333), (160, 120), (1024, 768)])
def test_device_pixels_equal_the_workers_where_the_worker_decodes_at_full_size(size):
    worker, device = _both_crops()
    for seed in range(8):
        data = _jpeg(*size, seed=seed)
        assert worker.decode(data).reduction == 1
        torch.manual_seed(seed)
        expected = worker(worker.decode(data))
        torch.manual_seed(seed)
        levels = _levels(_device_pixels([device(device.decode(data))])[0], expected)
        assert levels.mean() < 0.25 and torch.quantile(levels.flatten(), 0.999) <= 1, (seed, levels.mean())
        assert (levels > 2).float().mean() < 2e-4 and levels.max() <= 12, (seed, levels.max())


@pytest.mark.parametrize("size", [(2000, 1500), (3000, 1000), (4000, 3000)])
def test_device_pixels_follow_the_full_size_reference_where_the_worker_reduces(size):
    """The worker decodes these at 1/2 or 1/4 (libjpeg's DCT scaling); the device decodes them whole, which is what
    torchvision's Pillow path renders."""
    worker, device = _both_crops()
    for seed in range(3):
        data = _jpeg(*size, seed=seed)
        assert worker.decode(data).reduction > 1
        torch.manual_seed(seed)
        expected = worker(worker.decode(data))
        torch.manual_seed(seed)
        crop = device(device.decode(data))
        pixels = _device_pixels([crop])[0]
        (top, left, height, width), flip = crop.box, crop.flip
        reference = TF.resized_crop(
            decode_rgb(data), top, left, height, width, [224, 224], TF.InterpolationMode.BICUBIC
        )
        reference = TF.pil_to_tensor(TF.hflip(reference) if flip else reference)
        assert _levels(pixels, reference).mean() < 0.2, seed
        assert _levels(pixels, expected).mean() < 5, seed  # the worker's reduced decode is the approximate one


def test_a_batch_carries_worker_pixels_and_jpeg_files_in_its_order():
    worker, device = _both_crops(64)
    files = [_jpeg(96, 80, 1), _encode(_photo(90, 70, 2), "PNG"), _jpeg(120, 90, 3), _rotated_jpeg(100, 60)]
    expected, crops = [], []
    for seed, encoded in enumerate(files):
        torch.manual_seed(seed)
        expected.append(worker(worker.decode(encoded)))
        torch.manual_seed(seed)
        crops.append(device(device.decode(encoded)))
    batch = stack_images(crops)
    assert isinstance(batch, DeviceCrops) and batch.on_device.tolist() == [True, False, True, False]
    assert batch.pixels.shape == (2, 3, 64, 64) and batch.jpeg.numel() == len(files[0]) + len(files[2])
    assert batch.ends.tolist() == [len(files[0]), len(files[0]) + len(files[2])]
    assert batch.crops.tolist() == [[*crops[i].box, crops[i].flip] for i in (0, 2)]
    pixels = _device_pixels(crops)
    assert pixels.shape == (4, 3, 64, 64) and pixels.dtype == torch.uint8
    assert torch.equal(pixels[1], expected[1]) and torch.equal(pixels[3], expected[3])  # rendered in the worker
    for i in (0, 2):
        assert _levels(pixels[i], expected[i]).mean() < 0.3
    assert torch.equal(stack_images(expected), torch.stack(expected))  # no JPEG for the device: a plain tensor
    only_files = stack_images([crops[0], crops[2]])
    assert only_files.pixels.shape == (0, 3, 64, 64) and _device_pixels([crops[0], crops[2]]).shape == (2, 3, 64, 64)


# ---------------------------------------------------------------- files the device cannot decode


def _batch(crops: list[JpegCrop | torch.Tensor], transform: CropFlip) -> dict:
    return {
        "image": stack_images(crops),
        "key": [f"s{i}" for i in range(len(crops))],
        "num_corrupt": torch.tensor(2),
        "normalise": transform.normalisation,
    }


def test_a_jpeg_the_device_rejects_is_decoded_with_pillow(monkeypatch, caplog):
    """nvJPEG refuses some valid files (arithmetic coding, odd subsampling) and its batched call then returns nothing:
    forced here on the CPU by a decoder that rejects one file."""
    _, device = _both_crops(64)
    crops = [device(device.decode(_jpeg(96 + 8 * i, 80, i))) for i in range(3)]
    expected = _device_pixels(crops)
    rejected = crops[1].data
    real_decode = data.device_decode.decode_jpeg

    def fussy(files, **kwargs):
        for file in files if isinstance(files, list) else [files]:
            if file.numel() == len(rejected):
                raise RuntimeError("nvjpeg: unsupported")
        return real_decode(files, **kwargs)

    monkeypatch.setattr(data.device_decode, "decode_jpeg", fussy)
    batch = _batch(crops, device)
    with caplog.at_level(logging.WARNING, logger="data.device_decode"):
        out = batch_to_device(batch, CPU)
    levels = (out["image"] + MEAN / STD) * STD * 255  # the normalisation undone: (B, 3, H, W) uint8 levels
    assert (levels - expected.float()).abs().max() < 1e-3  # Pillow's libjpeg-turbo decodes as torchvision's
    assert batch["num_corrupt"].item() == 2 and "s1: decoded with Pillow" in caplog.text


def test_a_corrupt_body_trains_as_a_black_image_and_is_counted(caplog):
    worker, device = _both_crops(64)
    good, bad = _jpeg(96, 80, 0), _bad_huffman_table(_jpeg(96, 80, 1))
    with pytest.raises(OSError):
        worker.decode(bad)  # the worker path skips it (and counts it)
    crops = [device(device.decode(good)), device(device.decode(bad)), device(device.decode(good))]
    batch = _batch(crops, device)
    with caplog.at_level(logging.WARNING, logger="data.device_decode"):
        out = batch_to_device(batch, CPU)
    black = (-MEAN / STD).expand(3, 64, 64)
    assert torch.allclose(out["image"][1], black, atol=1e-6)
    assert not torch.allclose(out["image"][0], black) and out["image"].isfinite().all()
    assert batch["num_corrupt"].item() == 3 and out["num_corrupt"].item() == 3  # 2 from the worker, 1 here
    assert "s1: corrupt JPEG" in caplog.text and "black image" in caplog.text


def test_the_loader_pins_every_tensor_of_a_device_batch(monkeypatch):
    """DataLoader pins a batch only on a CUDA host; its pin function is called here with `Tensor.pin_memory`
    recorded, as on such a host."""
    from torch.utils.data._utils.pin_memory import pin_memory

    _, device = _both_crops(64)
    crops = [device(device.decode(_jpeg(96, 80, 0))), torch.zeros(3, 64, 64, dtype=torch.uint8)]
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: pinned.append(self.shape) or self.clone())
    out = pin_memory({"image": stack_images(crops)})
    assert isinstance(out["image"], DeviceCrops) and len(pinned) == len(DeviceCrops._fields)


# ---------------------------------------------------------------- the pipeline, its workers and its cursor

SIZE, GRID = 32, (4, 4)


def _header_only(name: str, image: bytes) -> tuple[str, tuple[int, int]]:
    """`data.write.check_image_bytes` without its check that the bytes are whole: the extension and size from the
    header alone."""
    with Image.open(io.BytesIO(image)) as img:
        return ("png" if img.format == "PNG" else "jpg"), img.size


@pytest.fixture(scope="module")
def jpeg_shards(tmp_path_factory) -> list[str]:
    """Two shards of 24 samples: photo-like JPEGs of many shapes, a PNG, a greyscale and an EXIF-rotated JPEG, and a
    JPEG cut short (corrupt in both modes)."""
    out = tmp_path_factory.mktemp("jpeg_shards")
    rng = np.random.default_rng(0)
    samples = []
    for i in range(48):
        width, height = int(rng.integers(40, 160)), int(rng.integers(40, 160))
        data = _jpeg(width, height, seed=i)
        if i == 5:
            data = _encode(_photo(width, height, i), "PNG")
        elif i == 11:
            data = _encode(_photo(width, height, i).convert("L"))
        elif i == 17:
            data = _rotated_jpeg(width, height)
        elif i == 23:
            data = data[: len(data) // 2]
        samples.append((f"img{i:04d}", data, i % 4, {}))
    # `data write` refuses a JPEG cut short (its bytes are checked); the loaders' handling of one already in a shard
    # (another tool wrote it, or the disk damaged it) is what this fixture is for, so it is written unchecked.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(data_write, "check_image_bytes", _header_only)
        write_shards(samples, str(out), shard_size=24, split="train", classes=["a", "b", "c", "d"], source="test")
    return sorted(str(p) for p in out.glob("train-*.tar"))


def _mode_loader(shards, decode: str, num_workers: int, positions=None):
    crop = pretrain_transform(SIZE, IMAGENET_MEAN, IMAGENET_STD, decode=decode)
    return make_train_loader(
        shards, transform=WithMask(crop, RandomMaskGenerator(GRID, 0.5)), batch_size=8, seed=7, rank=0,
        world_size=1, num_workers=num_workers, shuffle_buffer=16, labels=False, positions=positions,
    )  # fmt: skip


def _take(loader, num_batches: int) -> list[dict]:
    batches = iter(loader)
    return [next(batches) for _ in range(num_batches)]


def test_the_stream_with_device_decoding_gives_the_workers_batches(jpeg_shards):
    """Through the real pipeline, a DataLoader worker and the device step on the CPU: the same samples, masks, counts
    and cursors, images within the tolerance."""
    worker = _take(_mode_loader(jpeg_shards, "worker", 1), 7)
    device = _take(_mode_loader(jpeg_shards, "device", 1), 7)
    num_on_device = 0
    for a, b in zip(worker, device, strict=True):
        assert isinstance(b["image"], DeviceCrops) and isinstance(a["image"], torch.Tensor)
        num_on_device += int(b["image"].on_device.sum())
        assert a["key"] == b["key"] and torch.equal(a["mask"], b["mask"]) and torch.equal(a["label"], b["label"])
        for name in ("num_corrupt", "num_shard_reads", "num_skipped_shards"):
            assert torch.equal(a[name], b[name]), name
        assert a["cursor"] == b["cursor"]
        pixels_a, pixels_b = batch_to_device(a, CPU)["image"], batch_to_device(b, CPU)["image"]
        levels = ((pixels_a - pixels_b) * STD * 255).abs()  # normalised differences in uint8 levels
        assert levels.mean() < 0.4 and levels.max() <= 8, (levels.mean(), levels.max())
    assert sum(int(b["num_corrupt"]) for b in device) == 1  # the JPEG cut short, skipped in the worker
    assert 0 < num_on_device < 7 * 8  # the PNG, greyscale and rotated ones were rendered in the worker


def test_a_seeded_stream_draws_the_same_boxes_in_both_modes(jpeg_shards, monkeypatch):
    drawn = {"worker": [], "device": []}
    real_draw = CropFlip.draw
    for mode in drawn:
        monkeypatch.setattr(CropFlip, "draw", _recording(real_draw, drawn[mode]))
        _take(_mode_loader(jpeg_shards, mode, 0), 5)
    assert len(drawn["worker"]) >= 40 and drawn["worker"] == drawn["device"]


def _recording(draw, into: list):
    def recorded(self, full_size):
        into.append(draw(self, full_size))
        return into[-1]

    return recorded


def test_a_device_decoding_stream_resumes_from_its_cursor(jpeg_shards):
    batches = _take(_mode_loader(jpeg_shards, "device", 0), 5)
    resumed = _take(_mode_loader(jpeg_shards, "device", 0, positions=[position_after(batches, 3)]), 2)
    for a, b in zip(batches[3:], resumed, strict=True):
        assert a["key"] == b["key"] and torch.equal(a["mask"], b["mask"])
        for x, y in zip(a["image"], b["image"], strict=True):
            assert torch.equal(x, y)


# ---------------------------------------------------------------- the recipe key and a pretraining run


def test_the_recipe_key_is_refused_where_the_device_cannot_render_the_crop():
    for overrides in (["objective.kind=simmim"], ["stage=tokenizer"], ["objective.kind=beit"]):
        assert load_config(None, ["data.decode=device", *overrides]).data.decode == "device"
    with pytest.raises(ValueError, match="data.decode is set, but stage finetune does not read it"):
        load_config(None, ["stage=finetune", "objective.kind=classification", "data.decode=device"])
    beit_tokenizer = ["objective.kind=beit", "objective.target.kind=tokenizer", "objective.target.path=/tok"]
    with pytest.raises(ValueError, match="data.decode device does not fit objective.target.kind tokenizer"):
        load_config(None, ["data.decode=device", *beit_tokenizer])
    with pytest.raises(ValueError, match="data.decode"):
        load_config(None, ["data.decode=gpu"])


STEPS = 5


def _pretrain_losses(shards: str, run_dir, decode: str, dist) -> dict[int, float]:
    model = [f"model.{key}={value}" for key, value in TINY_MODEL.items()]
    cfg = load_config(
        None,
        [
            f"run_dir={run_dir}", f"data.train={shards}", f"data.decode={decode}", "data.num_workers=0",
            "data.global_batch_size=8", "data.shuffle_buffer=16", *model, "objective.decoder_embed_dim=32",
            "objective.decoder_depth=1", "objective.decoder_num_heads=2", f"schedule.steps={STEPS}",
            "schedule.warmup_steps=1", "optim.base_lr=1e-3", "engine.device=cpu", "engine.zero_stage=0",
            "engine.precision=fp32", "engine.peak_tflops=1", "logging.every_steps=1", "logging.image_every_steps=0",
            "checkpoint.every_steps=100",
        ],
    )  # fmt: skip
    run_dir.mkdir()
    torch.manual_seed(cfg.seed)
    engine, optimizer = parallelize(objective_builder(cfg)(), cfg=cfg, dist=dist, run_dir=run_dir)
    batches = iter(train_loader(cfg, dist, train_transform(cfg), labels=False, positions=None))
    logger = MetricsLogger(run_dir, enabled=True, tensorboard=False, total_steps=STEPS)
    run = StageRun(cfg, "", dist, run_dir, dump_config(cfg), None, STEPS, 1, None, TrainState(), logger)
    train(run, engine, optimizer, batches, LoopHooks())
    logger.close()
    assert all(m.get("data/corrupt_samples", 0) == 0 for m in read_metrics(run_dir))
    return losses(run_dir)


def test_mae_pretrains_with_device_decoding_as_with_worker_decoding(one_rank, jpeg_shards, tmp_path):
    clean = jpeg_shards[1]  # its 24 samples hold no corrupt one, so both modes stream the same samples
    worker = _pretrain_losses(clean, tmp_path / "worker", "worker", one_rank)
    device = _pretrain_losses(clean, tmp_path / "device", "device", one_rank)
    assert sorted(device) == list(range(1, STEPS + 1)) and all(math.isfinite(v) for v in device.values())
    assert device != worker  # the device rendered the images (within 0.2% of the losses here)
    for step, loss in device.items():
        assert loss == pytest.approx(worker[step], rel=1e-2), (step, device, worker)


class _Brightness(nn.Module):
    """A one-parameter objective over the images the loop hands it."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, batch: dict) -> dict:
        return {"loss": (batch["image"] * self.scale).pow(2).mean()}


def test_the_loop_counts_a_jpeg_that_fails_on_the_device(one_rank, tmp_path):
    """The loop reads a batch's counts after `to_device`, which adds the files the device could not decode."""
    _, device = _both_crops(16)
    crops = [device(device.decode(_jpeg(48, 40, 0))), device(device.decode(_bad_huffman_table(_jpeg(48, 40, 1))))]
    steps = 3
    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path}", f"schedule.steps={steps}", "schedule.warmup_steps=0", "engine.zero_stage=0",
            "engine.device=cpu", "engine.precision=fp32", "engine.peak_tflops=1", "data.global_batch_size=2",
            "logging.every_steps=1", "checkpoint.every_steps=100",
        ],
    )  # fmt: skip
    engine, optimizer = parallelize(_Brightness(), cfg=cfg, dist=one_rank, run_dir=tmp_path)

    def batches():
        while True:
            yield {**_batch(crops, device), **zero_counts()}

    logger = MetricsLogger(tmp_path, enabled=True, tensorboard=False, total_steps=steps)
    run = StageRun(cfg, "", one_rank, tmp_path, dump_config(cfg), None, steps, 0, None, TrainState(), logger)
    train(run, engine, optimizer, batches(), LoopHooks())
    logger.close()
    counted = [m["data/corrupt_samples"] for m in read_metrics(tmp_path) if "data/corrupt_samples" in m]
    assert counted == [1.0, 2.0, 3.0]  # one per batch, running total
