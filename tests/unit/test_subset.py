"""data/subset.py: a fixed number of samples per class, chosen deterministically and copied unchanged."""

import json
from collections import Counter

import pytest
import webdataset as wds

from data import sources
from data.subset import first_per_class, write_per_class_subset
from data.write import write_shards


def _source_shards(path, num_samples=120):
    """Synthetic 4-class shards written in the seeded random order `python -m data write` uses."""
    source = sources.synthetic(num_samples=num_samples, image_size=8, num_classes=4, seed=1, split="train")
    order = sources.shuffled_order(source.num_samples, 0)
    write_shards(
        source.samples(order), str(path), shard_size=25, split="train", classes=source.classes, source="t",
        shuffle_seed=0,
    )  # fmt: skip
    return source, order


def _stored(folder):
    index = json.loads((folder / "index.json").read_text())
    return index, [s for shard in index["shards"] for s in wds.tarfile_samples([{"url": str(folder / shard["name"])}])]


def test_first_per_class_keeps_the_first_n_of_each_class_in_shard_order(tmp_path):
    source, order = _source_shards(tmp_path / "src")
    kept = first_per_class(str(tmp_path / "src"), 5, num_classes=4)

    labels = [source.load(i).label for i in order]
    expected = [
        f"train_{i:08d}" for n, (i, label) in enumerate(zip(order, labels, strict=True)) if labels[:n].count(label) < 5
    ]
    assert [s["__key__"] for s in kept] == expected  # shard order, the first 5 of each class
    assert Counter(int(s["cls"]) for s in kept) == {0: 5, 1: 5, 2: 5, 3: 5}


def test_written_subset_has_exactly_n_per_class_every_class_per_shard_and_is_deterministic(tmp_path):
    _source_shards(tmp_path / "src")
    index = write_per_class_subset(str(tmp_path / "src"), str(tmp_path / "a"), 6, num_shards=3, seed=2)
    write_per_class_subset(str(tmp_path / "src"), str(tmp_path / "b"), 6, num_shards=3, seed=2)

    _, stored = _stored(tmp_path / "a")
    assert index["num_samples"] == 24 and [s["num_samples"] for s in index["shards"]] == [8, 8, 8]
    assert Counter(int(s["cls"]) for s in stored) == {0: 6, 1: 6, 2: 6, 3: 6}
    for shard in index["shards"]:  # shuffled after the choice: no shard is left with the last classes only
        cls = {int(s["cls"]) for s in wds.tarfile_samples([{"url": str(tmp_path / "a" / shard["name"])}])}
        assert len(cls) >= 3
    for name in ["index.json"] + [s["name"] for s in index["shards"]]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()

    chosen = {s["__key__"] for s in first_per_class(str(tmp_path / "src"), 6, num_classes=4)}
    assert {s["__key__"] for s in stored} == chosen
    by_key = {s["__key__"]: s for s in _stored(tmp_path / "src")[1]}
    for sample in stored:  # image bytes unchanged; the source key recorded
        assert sample["png"] == by_key[sample["__key__"]]["png"]
        assert json.loads(sample["json"])["source_key"] == sample["__key__"]


def test_a_class_short_of_samples_is_named(tmp_path):
    _source_shards(tmp_path / "src", num_samples=40)  # about 10 per class
    with pytest.raises(ValueError, match=r"fewer than 20 samples of classes \{"):
        first_per_class(str(tmp_path / "src"), 20, num_classes=4)
    with pytest.raises(ValueError, match=r"label 3 outside \[0, 3\)"):
        first_per_class(str(tmp_path / "src"), 10, num_classes=3)  # class 3 shows up before 30 are kept
