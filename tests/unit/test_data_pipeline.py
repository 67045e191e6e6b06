"""Streaming loaders: shard resolution, rank x worker splitting, determinism, exact resume, corrupt data."""

import io
import itertools
import json
import logging
import os
import random
import re
import shutil

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from data import sources
from data.device import batch_to_device
from data.masking import BlockwiseMaskGenerator
from data.pipeline import _sample_seed, make_eval_loader, make_train_loader
from data.shard_read import ShardReadError, ShardReadPolicy
from data.specs import dataset_size, resolve_shards
from data.transforms import WithMask, eval_transform, pretrain_transform
from data.write import write_shards
from tests.launching import position_after

NUM_SHARDS, SHARD_SIZE, NUM_CLASSES, SIZE = 8, 12, 4, 8
MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
ALL_KEYS = [f"train_{i:08d}" for i in range(NUM_SHARDS * SHARD_SIZE)]


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> str:
    """8 shards of 12 synthetic 8x8 images; sample i has label i % 4."""
    out = str(tmp_path_factory.mktemp("shards"))
    source = sources.synthetic(NUM_SHARDS * SHARD_SIZE, SIZE, NUM_CLASSES, seed=0, split="train")
    write_shards(
        source.samples(), out, shard_size=SHARD_SIZE, split="train", classes=source.classes, source="synthetic"
    )
    return out


def _take(loader, num_batches: int) -> list[dict]:
    return list(itertools.islice(iter(loader), num_batches))


def _train(shards: list[str], **overrides) -> torch.utils.data.DataLoader:
    args = dict(
        transform=pretrain_transform(SIZE, MEAN, STD),
        batch_size=8,
        seed=7,
        rank=0,
        world_size=1,
        num_workers=0,
        shuffle_buffer=20,
        resampled=False,
    )
    return make_train_loader(shards, **(args | overrides))


def _assert_same_batches(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x["key"] == y["key"]
        torch.testing.assert_close(x["image"], y["image"], rtol=0, atol=0)
        assert torch.equal(x["label"], y["label"]) and torch.equal(x["num_corrupt"], y["num_corrupt"])


def test_resolve_shards_and_dataset_size(shard_dir, tmp_path):
    expected = [os.path.join(shard_dir, f"train-{i:06d}.tar") for i in range(NUM_SHARDS)]
    assert resolve_shards(shard_dir) == expected
    assert resolve_shards(os.path.join(shard_dir, "train-{000000..000007}.tar")) == expected
    assert resolve_shards(os.path.join(shard_dir, "train-*.tar")) == expected
    assert resolve_shards(expected[:3]) == expected[:3]
    assert dataset_size(shard_dir) == 96
    assert dataset_size(os.path.join(shard_dir, "train-{000002..000003}.tar")) == 24
    shutil.copy(expected[0], tmp_path / "lone.tar")
    assert dataset_size([str(tmp_path / "lone.tar")]) is None  # no index.json beside it


def test_resolve_shards_errors_name_the_shard_or_pattern(shard_dir, tmp_path):
    missing = os.path.join(shard_dir, "train-000099.tar")
    with pytest.raises(ValueError, match=re.escape(missing)):
        resolve_shards([os.path.join(shard_dir, "train-000000.tar"), missing])
    with pytest.raises(ValueError, match=re.escape(os.path.join(shard_dir, "train-000008.tar"))):
        resolve_shards(os.path.join(shard_dir, "train-{000000..000009}.tar"))
    for pattern in ("val-{000000..000003}.tar", "val-*.tar"):
        with pytest.raises(ValueError, match=re.escape(f"{os.path.join(shard_dir, pattern)} matches no files")):
            resolve_shards(os.path.join(shard_dir, pattern))
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path} has no index.json")):
        resolve_shards(str(tmp_path))


def test_too_few_shards_for_ranks_and_workers(shard_dir):
    shards = resolve_shards(shard_dir)
    with pytest.raises(ValueError, match=re.escape(shards[0]) + r".*8 shards .* 16 streams"):
        _train(shards, world_size=8, num_workers=2)
    _train(shards, world_size=8, num_workers=2, resampled=True)  # resampling needs no split
    with pytest.raises(ValueError, match=re.escape(shards[0]) + r".*8 shards for 9 ranks"):
        make_eval_loader(shards, transform=None, batch_size=4, rank=0, world_size=9, num_workers=0)


@pytest.mark.parametrize("num_open_shards", [1, 8])
@pytest.mark.parametrize(("world_size", "num_workers"), [(1, 0), (2, 0), (2, 2), (4, 2)])
def test_train_split_reads_every_shard_once_per_epoch(shard_dir, world_size, num_workers, num_open_shards):
    shards = resolve_shards(shard_dir)
    streams = world_size * max(num_workers, 1)
    batches_per_epoch = NUM_SHARDS // world_size  # batch size = shard size, no shuffle buffer: epochs end on batches
    epochs, shards_per_batch = [[], []], []
    for rank in range(world_size):
        loader = _train(
            shards,
            batch_size=SHARD_SIZE,
            shuffle_buffer=0,
            rank=rank,
            world_size=world_size,
            num_workers=num_workers,
            num_open_shards=num_open_shards,
        )
        batches = _take(loader, 2 * batches_per_epoch)
        for epoch in range(2):
            for batch in batches[epoch * batches_per_epoch : (epoch + 1) * batches_per_epoch]:
                shards_per_batch.append(len({int(k.split("_")[1]) // SHARD_SIZE for k in batch["key"]}))
                epochs[epoch].extend(batch["key"])
    assert sorted(epochs[0]) == ALL_KEYS and sorted(epochs[1]) == ALL_KEYS
    assert epochs[0] != epochs[1]  # the shard order is reshuffled every epoch
    if num_open_shards == 1 or streams == NUM_SHARDS:  # one shard at a time: each batch is one shard
        assert set(shards_per_batch) == {1}
    else:  # each stream's shards of the epoch are read at once, their samples interleaved
        assert min(shards_per_batch) >= 2


@pytest.mark.parametrize(
    ("world_size", "num_workers", "batch_size", "used_workers"), [(1, 0, 7, 0), (3, 2, 5, 2), (4, 4, 16, 2)]
)
def test_eval_loader_sees_every_sample_once(shard_dir, world_size, num_workers, batch_size, used_workers):
    shards = resolve_shards(shard_dir)
    keys, labels = [], []
    for rank in range(world_size):
        transform = eval_transform(SIZE, MEAN, STD, crop_pct=1.0)
        loader = make_eval_loader(
            shards,
            transform=transform,
            batch_size=batch_size,
            rank=rank,
            world_size=world_size,
            num_workers=num_workers,
        )
        assert loader.num_workers == used_workers  # fewer workers than asked when shards run short
        for batch in loader:
            assert batch["image"].shape == (len(batch["key"]), 3, SIZE, SIZE) and batch["image"].dtype == torch.uint8
            assert len(batch["key"]) <= batch_size
            keys.extend(batch["key"])
            labels.extend(batch["label"].tolist())
    assert sorted(keys) == ALL_KEYS
    assert labels == [int(k.split("_")[1]) % NUM_CLASSES for k in keys]
    if world_size == 1 and num_workers == 0:
        assert keys == ALL_KEYS  # shards and samples in order


@pytest.mark.parametrize(("num_workers", "resampled"), [(0, False), (2, False), (2, True)])
def test_same_arguments_same_batches_and_a_saved_position_resumes_exactly(shard_dir, num_workers, resampled):
    shards = resolve_shards(shard_dir)
    fresh = _take(_train(shards, num_workers=num_workers, resampled=resampled), 15)  # 120 samples: past one epoch
    _assert_same_batches(fresh, _take(_train(shards, num_workers=num_workers, resampled=resampled), 15))
    position = json.loads(json.dumps(position_after(fresh, 9)))  # as a checkpoint's rank file holds it
    resumed = _take(_train(shards, num_workers=num_workers, resampled=resampled, positions=[position]), 6)
    _assert_same_batches(resumed, fresh[9:])
    other_seed = _take(_train(shards, num_workers=num_workers, resampled=resampled, seed=8), 15)
    assert [b["key"] for b in other_seed] != [b["key"] for b in fresh]


def test_resampled_ranks_draw_different_streams(shard_dir):
    shards = resolve_shards(shard_dir)
    rank0 = _take(_train(shards, resampled=True, world_size=2, rank=0), 4)
    rank1 = _take(_train(shards, resampled=True, world_size=2, rank=1), 4)
    assert [b["key"] for b in rank0] != [b["key"] for b in rank1]
    assert {k for b in rank0 + rank1 for k in b["key"]} <= set(ALL_KEYS)


def test_a_resumed_stream_decodes_and_transforms_only_its_new_batches(shard_dir):
    calls = []
    transform = eval_transform(SIZE, MEAN, STD, crop_pct=1.0)

    def counting_transform(image: Image.Image) -> torch.Tensor:
        calls.append(1)
        return transform(image)

    shards = resolve_shards(shard_dir)
    position = position_after(_take(_train(shards, batch_size=4), 5), 5)
    _take(_train(shards, transform=counting_transform, batch_size=4, positions=[position]), 2)
    assert len(calls) == 2 * 4  # the two batches, no read-ahead; none of the 20 samples before


def test_in_process_loader_leaves_global_rng_untouched(shard_dir):
    shards = resolve_shards(shard_dir)
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    batches = _take(_train(shards), 3)
    assert torch.equal(torch.get_rng_state(), states[0])
    assert random.getstate() == states[1]
    numpy_state = np.random.get_state()
    assert np.array_equal(numpy_state[1], states[2][1]) and numpy_state[2:] == states[2][2:]
    torch.manual_seed(999)  # augmentation does not depend on the caller's RNG either
    _assert_same_batches(batches, _take(_train(shards), 3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_in_process_loader_leaves_cuda_rng_untouched(shard_dir):
    torch.cuda.manual_seed(5)
    state = torch.cuda.get_rng_state()
    batches = _take(_train(resolve_shards(shard_dir)), 2)
    assert torch.equal(torch.cuda.get_rng_state(), state)
    assert batches[0]["image"].is_pinned()  # pinned for fast host-to-device copies when CUDA is present


def _write_corrupt_shard(path: str, corrupt: set[int], num_samples: int = 10) -> None:
    """Samples `c_{i}` with 4x4 PNGs, except garbage bytes for the indices in `corrupt`."""
    with wds.TarWriter(path) as writer:
        for i in range(num_samples):
            buffer = io.BytesIO()
            Image.new("RGB", (4, 4), (i, i, i)).save(buffer, format="PNG")
            image = b"garbage, not a png" if i in corrupt else buffer.getvalue()
            writer.write({"__key__": f"c_{i:08d}", "png": image, "cls": i % 2})


def test_corrupt_images_are_skipped_counted_and_logged(tmp_path, caplog):
    shard = str(tmp_path / "c-000000.tar")
    _write_corrupt_shard(shard, corrupt={3, 6})
    transform = eval_transform(4, MEAN, STD, crop_pct=1.0)
    with caplog.at_level(logging.WARNING, logger="data.pipeline"):
        batches = list(
            make_eval_loader([shard], transform=transform, batch_size=4, rank=0, world_size=1, num_workers=0)
        )
    assert [b["key"] for b in batches] == [
        ["c_00000000", "c_00000001", "c_00000002", "c_00000004"],
        ["c_00000005", "c_00000007", "c_00000008", "c_00000009"],
    ]
    assert [int(b["num_corrupt"]) for b in batches] == [1, 1]
    assert batches[0]["num_corrupt"].dtype == torch.int64
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and all(shard in w for w in warnings)
    assert "c_00000003" in warnings[0] and "c_00000006" in warnings[1]
    train = _take(_train([shard], transform=transform, batch_size=4, shuffle_buffer=0), 3)
    assert [int(b["num_corrupt"]) for b in train] == [1, 1, 1]  # 3 -> batch 0, 6 -> batch 1, next epoch's 3


@pytest.mark.parametrize("num_workers", [0, 1])
def test_unreadable_shards_stop_an_evaluation_naming_the_shard(shard_dir, tmp_path, num_workers):
    """After its tries (data/shard_read.py; training skips such a shard instead, tests/unit/test_shard_read.py)."""
    garbage = tmp_path / "garbage.tar"
    garbage.write_bytes(b"this is not a tar file" * 100)
    truncated = tmp_path / "truncated.tar"
    with open(os.path.join(shard_dir, "train-000000.tar"), "rb") as f:
        truncated.write_bytes(f.read()[:20000])  # cut inside a member
    transform = eval_transform(SIZE, MEAN, STD)
    for shard in (str(garbage), str(truncated)):
        loader = make_eval_loader(
            [shard], transform=transform, batch_size=4, rank=0, world_size=1, num_workers=num_workers,
            read_policy=ShardReadPolicy(retries=1, backoff_s=0.0),
        )  # fmt: skip
        with pytest.raises(ShardReadError, match=f"cannot read shard {re.escape(shard)}: .* \\(2 tries\\)"):
            list(loader)


def test_grayscale_images_become_rgb_and_match_the_transform(tmp_path):
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(6, SIZE, SIZE), dtype=np.uint8)  # (N, H, W)
    samples = [(f"g_{i:08d}", Image.fromarray(p), i % 2, {}) for i, p in enumerate(pixels)]
    write_shards(samples, str(tmp_path), shard_size=6, split="g", classes=["a", "b"], source="test")
    transform = eval_transform(SIZE, MEAN, STD, crop_pct=1.0)
    (batch,) = make_eval_loader(
        resolve_shards(str(tmp_path)), transform=transform, batch_size=6, rank=0, world_size=1, num_workers=0
    )
    assert batch["image"].shape == (6, 3, SIZE, SIZE) and batch["label"].tolist() == [0, 1, 0, 1, 0, 1]
    assert torch.equal(batch["image"], torch.from_numpy(pixels)[:, None].expand(6, 3, SIZE, SIZE))  # grey everywhere
    mean, std = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)
    expected = (torch.from_numpy(pixels).float()[:, None] / 255 - mean) / std  # (N, 3, H, W)
    torch.testing.assert_close(batch_to_device(batch, torch.device("cpu"))["image"], expected, rtol=0, atol=1e-5)


def test_dict_transform_outputs_are_stacked_and_reproducible(shard_dir):
    transform = eval_transform(SIZE, MEAN, STD, crop_pct=1.0)

    def with_mask(image: Image.Image) -> dict[str, torch.Tensor]:
        return {"image": transform(image), "mask": torch.rand(4) < 0.5}  # e.g. a BEiT mask made in the worker

    shards = resolve_shards(shard_dir)
    first = _take(_train(shards, transform=with_mask), 2)
    again = _take(_train(shards, transform=with_mask), 2)
    assert first[0]["mask"].shape == (8, 4) and first[0]["mask"].dtype == torch.bool
    assert all(torch.equal(a["mask"], b["mask"]) for a, b in zip(first, again, strict=True))
    assert len({tuple(m.tolist()) for m in first[0]["mask"]}) > 1  # each sample draws its own mask


@pytest.mark.parametrize("num_workers", [0, 2])
def test_blockwise_masks_travel_with_the_batch_and_resume_exactly(shard_dir, num_workers):
    transform = WithMask(
        eval_transform(SIZE, MEAN, STD, crop_pct=1.0), BlockwiseMaskGenerator((4, 4), 6, min_patches=2)
    )
    shards = resolve_shards(shard_dir)
    fresh = _take(_train(shards, transform=transform, num_workers=num_workers), 6)
    assert fresh[0]["mask"].shape == (8, 4, 4) and fresh[0]["mask"].dtype == torch.bool
    assert all((b["mask"].flatten(1).sum(1) == 6).all() for b in fresh)  # the exact budget in every sample
    position = position_after(fresh, 4)
    resumed = _take(_train(shards, transform=transform, num_workers=num_workers, positions=[position]), 2)
    assert all(torch.equal(a["mask"], b["mask"]) for a, b in zip(resumed, fresh[4:], strict=True))


def test_per_sample_seeds_are_distinct_and_balanced():
    """Neighbouring samples of one stream, and the same sample of neighbouring streams, get unrelated seeds."""
    seeds = [_sample_seed(stream, index) for stream in (1, 2) for index in range(5000)]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**64 for s in seeds)
    assert seeds[:3] == [_sample_seed(1, i) for i in range(3)]  # a function of (stream, index) alone
    for bit in (0, 17, 63):  # each bit set about half the time: not the stream seed plus a small offset
        assert abs(np.mean([(s >> bit) & 1 for s in seeds]) - 0.5) < 0.03, bit
