"""The order of training samples: shards written class by class still give mixed batches; mixtures of weighted
sources (proportions, determinism, exact resume, the `data.train` schema)."""

import itertools
import os
import random
import re
import shutil

import numpy as np
import pytest
import torch

from core.recipe.config import ConfigError, load_config
from data import pipeline
from data.order import TrainOrder
from data.pipeline import make_train_loader
from data.specs import WeightedShards, dataset_classes, dataset_size, resolve_shards, train_sources
from data.transforms import eval_transform
from tests.launching import MAX_BATCH_CHI2, MAX_MEAN_CHI2, chi_square, position_after, write_class_ordered

NUM_CLASSES, SHARD_SIZE = 10, 50  # write_class_ordered: 40 per class, 400 samples in 8 shards of 1 or 2 classes
BATCH = 40
MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)


@pytest.fixture(scope="module")
def ordered(tmp_path_factory) -> list[str]:
    return resolve_shards(str(write_class_ordered(tmp_path_factory.mktemp("ordered"), "o", NUM_CLASSES)))


def _loader(shards, **overrides) -> torch.utils.data.DataLoader:
    args = dict(
        transform=eval_transform(4, MEAN, STD, crop_pct=1.0),
        batch_size=BATCH,
        seed=3,
        rank=0,
        world_size=1,
        num_workers=2,
    )
    return make_train_loader(shards, **(args | overrides))


def _take(loader, num_batches: int) -> list[dict]:
    return list(itertools.islice(iter(loader), num_batches))


def test_class_ordered_shards_give_batches_close_to_uniform_and_resume_exactly(ordered):
    fresh = _take(_loader(ordered), 12)  # 480 samples: past one pass over the 400
    chi2 = [chi_square(b["label"].tolist(), NUM_CLASSES) for b in fresh]
    assert np.mean(chi2) < MAX_MEAN_CHI2 and max(chi2) < MAX_BATCH_CHI2, chi2
    one_at_a_time = _take(_loader(ordered, num_open_shards=1), 12)
    assert np.mean([chi_square(b["label"].tolist(), NUM_CLASSES) for b in one_at_a_time]) > 2 * MAX_MEAN_CHI2
    resumed = _take(_loader(ordered, positions=[position_after(fresh, 5)]), 7)
    assert [b["key"] for b in resumed] == [b["key"] for b in fresh[5:]]
    assert all(torch.equal(a["image"], b["image"]) for a, b in zip(resumed, fresh[5:], strict=True))


def test_default_shuffle_buffer_holds_the_open_shards_within_a_memory_budget(ordered, tmp_path, monkeypatch):
    assert _loader(ordered).dataset.shuffle_buffer == 8 * SHARD_SIZE  # 8 shards open: all of them
    assert _loader(ordered, num_open_shards=3).dataset.shuffle_buffer == 3 * SHARD_SIZE
    assert _loader(ordered, shuffle_buffer=7).dataset.shuffle_buffer == 7
    bytes_per_sample = sum(os.path.getsize(s) for s in ordered) / (8 * SHARD_SIZE)  # tar headers included
    monkeypatch.setattr(pipeline, "_SHUFFLE_BUFFER_BYTES", 60 * bytes_per_sample)
    assert _loader(ordered).dataset.shuffle_buffer == 60
    shutil.copy(ordered[0], tmp_path / "lone.tar")
    assert _loader([str(tmp_path / "lone.tar")]).dataset.shuffle_buffer == 1000  # no index.json beside it


def _order(urls: list[str], read, **overrides) -> TrainOrder:
    """The raw order of stream 0 of 1 over one source of `urls`, unbuffered."""
    args = dict(rank=0, worker=0, stream_id=0, num_streams=1, resampled=False, num_open=3, shuffle_buffer=0)
    return TrainOrder([WeightedShards(urls, 1.0)], read, lambda *parts: random.Random(str(parts)), **(args | overrides))


def test_interleave_reads_every_sample_once_in_shard_order_with_few_open():
    shards = {f"s{j}": [(j, k) for k in range(j % 4)] for j in range(12)}  # 0 to 3 samples; s0, s4, s8 empty
    reading: set[str] = set()
    most_open = 0

    def read(url: str):
        nonlocal most_open
        reading.add(url)
        most_open = max(most_open, len(reading))
        yield from shards[url]
        reading.discard(url)

    out = list(itertools.islice(_order(list(shards), read), 18))  # one epoch
    assert sorted(out) == sorted(s for samples in shards.values() for s in samples)
    for j in range(12):
        assert [k for i, k in out if i == j] == list(range(j % 4))  # each shard's own order
    assert most_open == 3
    assert len({i for i, _ in out[:6]}) >= 2  # samples of several shards interleaved, not shard after shard


def test_the_buffer_gives_its_first_sample_after_first_fill_then_grows_by_one_per_sample(monkeypatch):
    """The buffer starts giving at FIRST_FILL samples and grows one per sample given, up to shuffle_buffer; a
    stream restarted from its cursor mid-ramp yields what the uninterrupted one does."""
    monkeypatch.setattr("data.order.FIRST_FILL", 10)
    shards = {f"s{j}": [(j, k) for k in range(100)] for j in range(4)}
    drawn = 0

    def read(url: str):
        nonlocal drawn
        for sample in shards[url]:
            drawn += 1
            yield sample

    order = _order(list(shards), read, shuffle_buffer=30, num_open=2)
    sizes = []
    for _ in range(40):
        next(order)
        sizes.append(len(order.buffer))
    assert sizes[:3] == [9, 10, 11] and sizes[20:] == [29] * 20  # +1 a sample, then full (30 before each pick)
    assert drawn == 40 + 29  # nothing is read ahead of what the ramp needs
    cursor = order.state()
    ahead = list(itertools.islice(order, 30))
    restarted = _order(list(shards), lambda url: iter(shards[url]), shuffle_buffer=30, num_open=2, state=cursor)
    assert list(itertools.islice(restarted, 30)) == ahead


def test_interleave_raises_when_an_endless_stream_of_shards_is_empty():
    with pytest.raises(ValueError, match=r"none of the 2 shards a, b holds a sample"):
        next(_order(["a", "b"], lambda url: iter(()), resampled=True, num_open=2))
    with pytest.raises(ValueError, match=r"shards (a, b|b, a) of stream 0 hold no samples"):
        next(_order(["a", "b"], lambda url: iter(())))


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory) -> list[list[str]]:
    """Two sources of 8 class-ordered shards each, keys `a_*` and `b_*`; b has 5 classes."""
    root = tmp_path_factory.mktemp("mix")
    return [
        resolve_shards(str(write_class_ordered(root / "a", "a", NUM_CLASSES))),
        resolve_shards(str(write_class_ordered(root / "b", "b", 5))),
    ]


@pytest.mark.parametrize("resampled", [True, False])
def test_mixture_draws_sources_by_weight_in_every_worker_and_resumes_exactly(two_sources, resampled):
    mixture = [WeightedShards(two_sources[0], 1.0), WeightedShards(two_sources[1], 0.5)]
    fresh = _take(_loader(mixture, resampled=resampled), 24)  # 960 samples, 480 from each of the 2 workers
    for worker in range(2):  # DataLoader takes batch i from worker i % 2
        keys = [k for b in fresh[worker::2] for k in b["key"]]
        share = sum(k.startswith("a_") for k in keys) / len(keys)
        assert abs(share - 2 / 3) < 4 * (2 / 9 / len(keys)) ** 0.5, share  # 4 binomial standard deviations
    assert all(
        label < 5 for b in fresh for k, label in zip(b["key"], b["label"].tolist(), strict=True) if k.startswith("b_")
    )
    again = _take(_loader(mixture, resampled=resampled), 24)
    assert [b["key"] for b in again] == [b["key"] for b in fresh]
    resumed = _take(_loader(mixture, resampled=resampled, positions=[position_after(fresh, 9)]), 15)
    assert [b["key"] for b in resumed] == [b["key"] for b in fresh[9:]]
    other = _take(_loader(mixture, resampled=resampled, seed=4), 24)
    assert [b["key"] for b in other] != [b["key"] for b in fresh]


def test_mixture_of_one_source_is_the_plain_stream(two_sources):
    plain = _take(_loader(two_sources[0], num_workers=0), 3)
    single = _take(_loader([WeightedShards(two_sources[0], 2.0)], num_workers=0), 3)
    assert [b["key"] for b in single] == [b["key"] for b in plain]


def test_mixture_sources_are_checked_one_by_one(two_sources):
    few = WeightedShards(two_sources[1][:3], 1.0)
    with pytest.raises(ValueError, match=r"mixture source 1, shard spec .*3 shards cannot be split over 4 streams"):
        _loader([WeightedShards(two_sources[0], 1.0), few], resampled=False, world_size=2)
    with pytest.raises(ValueError, match=r"mixture source 0, shard spec .*weight must be > 0, got 0.0"):
        _loader([WeightedShards(two_sources[0], 0.0), few])


def test_specs_of_a_recipe_mixture(two_sources):
    dirs = [s[0].rsplit("/", 1)[0] for s in two_sources]
    cfg = load_config(None, [f"data.train=[{{shards: {dirs[0]}}}, {{shards: {dirs[1]}, weight: 0.25}}]"])
    assert cfg.data.is_mixture
    assert train_sources(cfg.data.train) == [WeightedShards(two_sources[0], 1.0), WeightedShards(two_sources[1], 0.25)]
    assert resolve_shards(cfg.data.train) == two_sources[0] + two_sources[1]  # every shard, source after source
    assert dataset_size(cfg.data.train) is None  # a mixture has no size of its own
    assert dataset_size(dirs[0]) == 400
    with pytest.raises(ValueError, match=re.escape(f"mixture sources {dirs[0]} and {dirs[1]} list different classes")):
        dataset_classes(cfg.data.train)
    same = load_config(None, [f"data.train=[{{shards: {dirs[0]}}}, {{shards: {two_sources[0][:2]}}}]"])
    assert dataset_classes(same.data.train) == [f"c{k}" for k in range(NUM_CLASSES)]
    assert train_sources(dirs[1]) == [WeightedShards(two_sources[1], 1.0)]  # a plain spec: one source


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.train=[{shards: a, weight: 0}]"], "data.train[0].weight: Input should be greater than 0"),
        (["data.train=[{shards: a}, {shards: b, weight: -1}]"], "data.train[1].weight: Input should be greater"),
        (["data.train=[{shards: a, weight: .inf}]"], "data.train[0].weight: Input should be a finite number"),
        (["data.train=[{shards: a}, {shards: b, wieght: 1}]"], "data.train[1].wieght: unknown key (did you mean"),
        (["data.train=[{weight: 1}]"], "data.train[0].shards: Field required"),
        (["data.train=[a, {shards: b}]"], "data.train[0]: Input should be a valid dictionary"),
        (
            ["data.train=[{shards: a}]", "schedule.steps=null", "schedule.epochs=2"],
            "a schedule in epochs with a mixture in data.train needs data.samples_per_epoch",
        ),
        (["data.num_open_shards=0"], "data.num_open_shards: Input should be greater than 0"),
    ],
)
def test_mixture_schema_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value)


def test_plain_specs_keep_their_meaning_and_mixtures_round_trip():
    assert load_config(None, ["data.train=/d/train"]).data.train == "/d/train"
    plain = load_config(None, ["data.train=[/d/a.tar, /d/b.tar]"]).data
    assert plain.train == ["/d/a.tar", "/d/b.tar"] and not plain.is_mixture
    cfg = load_config(None, ["data.train=[{shards: /d/in1k}, {shards: '/w/web-{0..9}.tar', weight: 0.5}]"])
    assert [(s.shards, s.weight) for s in cfg.data.train] == [("/d/in1k", 1.0), ("/w/web-{0..9}.tar", 0.5)]
    mixture = "data.train=[{shards: a}, {shards: b, weight: 0.5}]"
    epochs = load_config(None, [mixture, "data.samples_per_epoch=1000", "schedule.steps=null", "schedule.epochs=2"])
    assert epochs.steps(epochs.data.samples_per_epoch) == (8, 0)  # 2000 samples at 256 per step, rounded up


def test_launch_plan_gives_each_mixture_source_its_share_and_passes(two_sources):
    from core.engine.plan import mixture_plan

    dirs = [s[0].rsplit("/", 1)[0] for s in two_sources]
    cfg = load_config(None, [f"data.train=[{{shards: {dirs[0]}}}, {{shards: {two_sources[1]}, weight: 0.5}}]"])
    lines = mixture_plan(cfg.data.train, num_samples=1200).splitlines()
    assert (
        lines[0]
        == f"[mimpipe] data.train[0] {dirs[0]}: weight 1, 66.7% of the samples, ~2.00 passes over its 400 samples"
    )
    assert lines[1].startswith(f"[mimpipe] data.train[1] [{two_sources[1][0]} ... {two_sources[1][-1]}] (4 shards)")
    assert lines[1].endswith("weight 0.5, 33.3% of the samples, ~2.00 passes over its 200 samples")
