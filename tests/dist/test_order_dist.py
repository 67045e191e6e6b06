"""The order of training samples over 2 ranks x 2 data workers (tests/dist/order_worker.py under torchrun: the stream
a stage builds from the recipe's data section). Shards written class by class give batches close to uniform on
every rank, and a stream resumed from the saved data positions repeats the uninterrupted one; a mixture of two
non-resampled sources draws them by weight, and each source's epoch is split over the 4 streams without overlap; an
elastic resume on 1 rank reads exactly what the 4 streams of 2 ranks had left of the epoch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launching import (
    MAX_BATCH_CHI2,
    MAX_MEAN_CHI2,
    chi_square,
    torchrun,
    write_class_ordered,
)

pytestmark = pytest.mark.dist

DATA = ["data.num_workers=2", "data.global_batch_size=80"]  # 40 per rank


def _draw(out: Path, num_batches: int, *overrides: str, save_after: int = 0, resume_from: Path | None = None,
          nproc: int = 2) -> list[list[dict]]:  # fmt: skip
    """Each rank's batches (keys and labels) from a torchrun of order_worker.py; its data positions after
    `save_after` batches are left in `out`."""
    out.mkdir(parents=True)
    torchrun("order_worker.py", out, num_batches, save_after, resume_from or "-", *overrides, nproc=nproc)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(nproc)]


def test_class_ordered_shards_mix_on_two_ranks_and_resume_exactly(tmp_path):
    shards = write_class_ordered(tmp_path / "ordered", "o", num_classes=10)
    fresh = _draw(tmp_path / "fresh", 12, f"data.train={shards}", *DATA, save_after=5)
    for batches in fresh:
        chi2 = [chi_square(b["label"], 10) for b in batches]
        assert sum(chi2) / len(chi2) < MAX_MEAN_CHI2 and max(chi2) < MAX_BATCH_CHI2, chi2
    assert fresh[0][0]["key"] != fresh[1][0]["key"]  # each rank has its own streams
    resumed = _draw(tmp_path / "resumed", 7, f"data.train={shards}", *DATA, resume_from=tmp_path / "fresh")
    assert resumed == [batches[5:] for batches in fresh]


def test_non_resampled_mixture_draws_by_weight_and_splits_each_epoch(tmp_path):
    a = write_class_ordered(tmp_path / "a", "a", num_classes=10)  # 400 samples, 8 shards: 2 per stream
    b = write_class_ordered(tmp_path / "b", "b", num_classes=5)  # 200 samples, 4 shards: 1 per stream
    mixture = f"data.train=[{{shards: {a}}}, {{shards: {b}, weight: 0.5}}]"
    drawn = _draw(tmp_path / "mix", 12, mixture, "data.resampled=false", "data.shuffle_buffer=0", *DATA)
    epoch_share = {"a": 100, "b": 50}  # samples of each source a stream reads per epoch
    first_epoch = {"a": [], "b": []}
    for batches in drawn:
        keys = [k for batch in batches for k in batch["key"]]
        share = sum(k.startswith("a_") for k in keys) / len(keys)
        assert abs(share - 2 / 3) < 4 * (2 / 9 / len(keys)) ** 0.5, share  # 4 binomial standard deviations
        for worker in range(2):  # DataLoader takes batch i from worker i % 2
            stream = [k for batch in batches[worker::2] for k in batch["key"]]
            for source, size in epoch_share.items():
                first_epoch[source] += [k for k in stream if k.startswith(f"{source}_")][:size]
    assert sorted(first_epoch["a"]) == [f"a_{i:08d}" for i in range(400)]  # the 4 streams: disjoint, complete
    assert sorted(first_epoch["b"]) == [f"b_{i:08d}" for i in range(200)]


@pytest.mark.faults
def test_elastic_resume_on_one_rank_reads_the_rest_of_the_epoch_once(tmp_path):
    shards = write_class_ordered(tmp_path / "ordered", "o", num_classes=10)  # 400 samples in 8 shards
    data = [f"data.train={shards}", "data.resampled=false", "data.shuffle_buffer=0", "data.num_open_shards=1"]
    old = _draw(tmp_path / "old", 3, *data, *DATA, save_after=3)  # 240 samples of the 400
    consumed = [k for batches in old for batch in batches for k in batch["key"]]
    one_rank = ["data.num_workers=1", "data.global_batch_size=40"]
    (new,) = _draw(tmp_path / "new", 5, *data, *one_rank, resume_from=tmp_path / "old", nproc=1)
    rest = [k for batch in new for k in batch["key"]][: 400 - len(consumed)]
    assert sorted(consumed + rest) == [f"o_{i:08d}" for i in range(400)]
