"""Shards written by other tools (img2dataset-style jpg + txt + json, no .cls): what the loaders stream and skip,
labels from a JSON field, `python -m data index` and `inspect` (tests/foreign_shards.py writes the shards)."""

from __future__ import annotations

import itertools
import json
import logging
import re
import shutil

import pytest
import torch
import webdataset as wds
from PIL import Image

from core.recipe.config import load_config
from data.__main__ import inspect_shards, main
from data.decode import LabelError
from data.index import index_shards
from data.pipeline import make_eval_loader, make_train_loader
from data.specs import dataset_classes, dataset_size, resolve_shards
from data.transforms import eval_transform, pretrain_transform
from tests.foreign_shards import CAPTION_ONLY, GOOD_KEYS, LABELS, SIZES, TRUNCATED, encode, write_img2dataset_shards
from tests.launching import position_after

SIZE = 16
MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[str]:
    return [str(p) for p in write_img2dataset_shards(tmp_path_factory.mktemp("laion"))]


def _recording_transform(image: Image.Image) -> dict[str, torch.Tensor]:
    """The eval transform, plus what the loader handed it: its mode (1 for RGB) and its (width, height)."""
    return {
        "image": eval_transform(SIZE, MEAN, STD, crop_pct=1.0)(image),
        "is_rgb": torch.tensor(image.mode == "RGB"),
        "size": torch.tensor(image.size),
    }


def _eval(shards: list[str], **labels) -> list[dict]:
    loader = make_eval_loader(
        shards, transform=_recording_transform, batch_size=4, rank=0, world_size=1, num_workers=0, **labels
    )
    return list(loader)


def test_pretraining_streams_every_decodable_image_and_counts_the_two_bad_samples(shards, caplog):
    with caplog.at_level(logging.WARNING, logger="data.pipeline"):
        batches = _eval(shards, labels=False)
    assert [b["key"] for b in batches] == [GOOD_KEYS[:4], GOOD_KEYS[4:]]
    assert [int(b["num_corrupt"]) for b in batches] == [0, 2]  # the caption-only sample, then the truncated JPEG
    for batch in batches:
        assert batch["image"].shape == (4, 3, SIZE, SIZE) and batch["image"].dtype == torch.uint8
        assert batch["label"].tolist() == [-1] * 4 and batch["is_rgb"].all()
        assert [tuple(s) for s in batch["size"].tolist()] == [SIZES[k] for k in batch["key"]]  # EXIF rotation on
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert CAPTION_ONLY in warnings[0] and shards[0] in warnings[0] and "no image field" in warnings[0]
    assert "has json, txt" in warnings[0]
    assert TRUNCATED in warnings[1] and shards[1] in warnings[1] and "corrupt image jpg" in warnings[1]


def test_endless_pretraining_stream_skips_and_counts_every_epoch(shards):
    loader = make_train_loader(
        shards, transform=pretrain_transform(SIZE, MEAN, STD), batch_size=4, seed=0, rank=0, world_size=1,
        num_workers=0, shuffle_buffer=0, resampled=False, labels=False,
    )  # fmt: skip
    batches = list(itertools.islice(iter(loader), 4))  # 16 samples: exactly two epochs of the 8 good ones
    for epoch in (batches[:2], batches[2:]):
        assert sorted(k for b in epoch for k in b["key"]) == sorted(GOOD_KEYS)
    # Skipped samples are counted with the next sample kept: shard 0's caption-only sample ends its shard, so when
    # shard 0 comes last in the second epoch it is counted only in the batch after these.
    shard0_last = batches[-1]["key"][-1].startswith("00000")
    assert sum(int(b["num_corrupt"]) for b in batches) == (3 if shard0_last else 4)


def test_fine_tuning_reads_labels_from_the_json_field(shards):
    batches = _eval(shards, label_field="label")
    assert [k for b in batches for k in b["key"]] == GOOD_KEYS
    assert [v for b in batches for v in b["label"].tolist()] == [LABELS[k] for k in GOOD_KEYS]
    loader = make_train_loader(
        shards, transform=_recording_transform, batch_size=8, seed=3, rank=0, world_size=1, num_workers=2,
        shuffle_buffer=4, resampled=True, label_field="label",
    )  # fmt: skip
    for batch in itertools.islice(iter(loader), 3):
        assert batch["label"].tolist() == [LABELS[k] for k in batch["key"]]


def test_a_missing_label_stops_fine_tuning_naming_key_shard_and_field(tmp_path):
    paths = [str(p) for p in write_img2dataset_shards(tmp_path, drop_label="000010003")]
    with pytest.raises(LabelError, match=rf"sample 000010003 in shard {re.escape(paths[1])}: .* no field 'label'"):
        _eval(paths, label_field="label")
    train = make_train_loader(
        paths[1:], transform=_recording_transform, batch_size=8, seed=0, rank=0, world_size=1, num_workers=1,
        shuffle_buffer=0, resampled=False, label_field="label",
    )  # fmt: skip
    with pytest.raises(LabelError, match=r"sample 000010003 .* no field 'label'"):  # raised again from the worker
        next(iter(train))
    with pytest.raises(LabelError, match=rf"sample 000000000 in shard {re.escape(paths[0])} has no .cls label"):
        _eval(paths)  # labels from .cls by default: img2dataset shards have none
    assert [k for b in _eval(paths, labels=False) for k in b["key"]] == GOOD_KEYS  # pretraining needs none


def test_resume_is_exact_across_samples_without_an_image(shards):
    """Shard 0 per epoch: 4 images, then the caption-only sample, counted with the next epoch's first batch. The
    position after 3 batches of 2 lies past 7 raw samples, the caption-only one among them."""

    def batches(position: dict | None, num: int) -> list[dict]:
        loader = make_train_loader(
            shards[:1], transform=pretrain_transform(SIZE, MEAN, STD), batch_size=2, seed=5, rank=0, world_size=1,
            num_workers=0, shuffle_buffer=0, resampled=False, labels=False,
            positions=None if position is None else [position],
        )  # fmt: skip
        return list(itertools.islice(iter(loader), num))

    fresh = batches(None, 6)
    resumed = batches(position_after(fresh, 3), 3)
    assert [int(b["num_corrupt"]) for b in fresh] == [0, 0, 1, 0, 1, 0]
    for a, b in zip(fresh[3:], resumed, strict=True):
        assert a["key"] == b["key"] and torch.equal(a["num_corrupt"], b["num_corrupt"])
        torch.testing.assert_close(a["image"], b["image"], rtol=0, atol=0)  # same positions, same augmentation


def test_index_counts_samples_and_classes_and_epochs_convert(tmp_path):
    paths = write_img2dataset_shards(tmp_path / "laion")
    main(["index", str(tmp_path / "laion" / "{00000..00001}.tar"), "--label-field", "label"])
    index = json.loads((tmp_path / "laion" / "index.json").read_text())
    assert index["shards"] == [{"name": "00000.tar", "num_samples": 4}, {"name": "00001.tar", "num_samples": 5}]
    assert index["num_samples"] == 9 and index["num_without_image"] == 1
    assert index["classes"] == ["0", "1", "2", "3"] and index["label_counts"] == [3, 3, 2, 1]
    assert index["labels_from"] == ".json field label"
    assert not list((tmp_path / "laion").glob("*.tmp"))  # written under a temporary name, then moved

    folder = str(tmp_path / "laion")
    assert resolve_shards(folder) == [str(p) for p in paths]
    assert dataset_size(folder) == dataset_size(str(tmp_path / "laion" / "*.tar")) == 9
    assert dataset_size([str(paths[1])]) == 5
    assert dataset_classes(folder) == ["0", "1", "2", "3"]
    cfg = load_config(None, [f"data.train={folder}", "data.global_batch_size=3", "schedule={epochs: 2}"])
    assert cfg.steps(dataset_size(cfg.data.train)) == (6, 0)

    with pytest.raises(ValueError, match=re.escape(f"{folder}/index.json already exists; pass --force")):
        index_shards(folder, label_field="label")
    shutil.copy(paths[1], tmp_path / "laion" / "00002.tar")  # a folder is re-indexed with every *.tar now in it
    _, unlabelled = index_shards(folder, force=True)  # no --label-field and no .cls: no classes
    assert [s["num_samples"] for s in unlabelled["shards"]] == [4, 5, 5] and unlabelled["num_samples"] == 14
    assert unlabelled["classes"] == [] and unlabelled["labels_from"] is None and unlabelled["num_without_cls"] == 14
    assert dataset_classes(folder) == [] and dataset_size(folder) == 14


def test_index_reads_cls_labels_and_refuses_shards_in_several_folders(tmp_path):
    """ImageNet in webdataset form: `key.JPEG` + `key.cls`, in two folders."""
    jpeg = encode(Image.new("RGB", (8, 8), (9, 9, 9)), "JPEG")
    keys, labels = [f"val_{i:08d}" for i in range(5)], [0, 4, 4, 1, 0]
    shards = [str(tmp_path / "a" / "x-000000.tar"), str(tmp_path / "b" / "x-000000.tar")]
    for shard, part in zip(shards, (slice(0, 3), slice(3, 5)), strict=True):
        (tmp_path / shard).parent.mkdir()
        with wds.TarWriter(shard) as writer:
            for key, label in zip(keys[part], labels[part], strict=True):
                writer.write({"__key__": key, "JPEG": jpeg, "cls": label})
    with pytest.raises(ValueError, match=r"shards span 2 folders .*pass --out FOLDER"):
        index_shards(shards)
    path, index = index_shards(shards, out=str(tmp_path / "all"))
    assert path == str(tmp_path / "all" / "index.json")
    assert [s["name"] for s in index["shards"]] == ["../a/x-000000.tar", "../b/x-000000.tar"]
    assert index["classes"] == ["0", "1", "2", "3", "4"] and index["label_counts"] == [2, 1, 0, 0, 2]
    assert index["labels_from"] == ".cls" and index["num_without_cls"] == 0
    assert dataset_size(str(tmp_path / "all")) == 5 and dataset_classes(str(tmp_path / "all"))[-1] == "4"
    batches = _eval(resolve_shards(str(tmp_path / "all")))  # labels from .cls
    assert [k for b in batches for k in b["key"]] == keys and [v for b in batches for v in b["label"]] == labels


def test_inspect_shows_fields_modes_and_labels_without_an_index(tmp_path):
    folder = str(tmp_path / "laion")
    write_img2dataset_shards(tmp_path / "laion")
    lines = inspect_shards(folder, num_show=5)
    assert lines[0] == f"shards: 2 ({folder}/00000.tar ... {folder}/00001.tar)"
    assert lines[1] == "samples: 9 (index.json: None); without an image: 1 (the loaders skip them)"
    assert lines[4:] == [
        "  000000000: jpg 40x30 RGB  no label  other fields: json, txt",
        "  000000001: png 24x24 RGBA  no label  other fields: json, txt",
        "  000000002: jpg 32x20 CMYK  no label  other fields: json, txt",
        "  000000003: png 20x20 I;16  no label  other fields: json, txt",
        "  000000004: no image (skipped by the loaders)  fields: json, txt",
    ]
    lines = inspect_shards(f"{folder}/00001.tar", num_show=5, label_field="label")
    assert lines[1] == "samples: 5 (index.json: None)"
    assert lines[4:6] == [
        "  000010000: jpg 20x40 RGB  label 0 (?)  other fields: json, txt",  # size as decoded: EXIF-rotated
        "  000010001: jpeg 36x28 RGB  label 2 (?)  other fields: json, txt",  # stored as .JPEG
    ]
    assert lines[6].startswith("  000010002: jpg corrupt (") and "skipped by the loaders  label 1 (?)" in lines[6]
    assert lines[7:] == [
        "  000010003: jpg 30x30 L  label 0 (?)  other fields: json, txt",
        "  000010004: png 26x22 P  label 3 (?)  other fields: json, txt",
    ]
