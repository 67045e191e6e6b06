"""Shard writing: sources, tar layout, index.json, the `python -m data` command line."""

import gzip
import io
import json
import os

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from data import sources
from data.__main__ import inspect_shards, main
from data.write import write_shards
from tests.helpers.datasets import FASHION_MNIST, needs_fashion_mnist

FM_DIR = FASHION_MNIST


def _read_tar(path: str) -> list[dict]:
    return list(wds.tarfile_samples([{"url": path}]))


def test_round_trip_keys_labels_pixels_and_index(tmp_path):
    source = sources.synthetic(num_samples=50, image_size=12, num_classes=4, seed=3, split="train")
    expected = list(sources.synthetic(num_samples=50, image_size=12, num_classes=4, seed=3, split="train").samples())
    index = write_shards(
        source.samples(), str(tmp_path), shard_size=16, split="train", classes=source.classes, source="synthetic"
    )

    with open(tmp_path / "index.json") as f:
        assert json.load(f) == index
    assert [s["name"] for s in index["shards"]] == [f"train-{i:06d}.tar" for i in range(4)]
    assert [s["num_samples"] for s in index["shards"]] == [16, 16, 16, 2]
    assert index["num_samples"] == 50 and index["image_size"] == [12, 12] and index["classes"] == source.classes
    assert index["shuffle_seed"] is None  # written in the order given
    assert sorted(os.listdir(tmp_path)) == ["index.json"] + [s["name"] for s in index["shards"]]  # no .tmp left

    stored = [sample for s in index["shards"] for sample in _read_tar(str(tmp_path / s["name"]))]
    assert [s["__key__"] for s in stored] == [e.key for e in expected] == [f"train_{i:08d}" for i in range(50)]
    for sample, ref in zip(stored, expected, strict=True):
        assert int(sample["cls"]) == ref.label == json.loads(sample["json"])["label"]
        assert json.loads(sample["json"])["source_index"] == int(ref.key.split("_")[1])
        pixels = np.asarray(Image.open(io.BytesIO(sample["png"])))
        np.testing.assert_array_equal(pixels, np.asarray(ref.image))  # PNG is lossless


def test_jpeg_bytes_are_stored_unchanged_and_mixed_sizes_give_no_image_size(tmp_path):
    buffer = io.BytesIO()
    Image.new("RGB", (10, 6), (200, 30, 30)).save(buffer, format="JPEG")
    jpeg = buffer.getvalue()
    samples = [("a_0", jpeg, 0, {}), ("a_1", Image.new("L", (8, 8), 7), 1, {})]
    index = write_shards(samples, str(tmp_path), shard_size=10, split="a", classes=["x", "y"], source="t")
    stored = _read_tar(str(tmp_path / "a-000000.tar"))
    assert stored[0]["jpg"] == jpeg and "png" in stored[1]
    assert index["image_size"] is None


def test_write_rejects_bad_samples_and_existing_output(tmp_path):
    def write(sample: tuple, out: str) -> dict:
        return write_shards([sample], str(tmp_path / out), shard_size=2, split="k", classes=["x"], source="t")

    image = Image.new("RGB", (4, 4))
    with pytest.raises(ValueError, match="label 5"):
        write(("k_0", image, 5, {}), "a")
    with pytest.raises(ValueError, match="k.0"):
        write(("k.0", image, 0, {}), "b")
    with pytest.raises(ValueError, match="neither JPEG nor PNG"):
        write(("k_0", b"GIF89a", 0, {}), "c")
    write(("k_0", image, 0, {}), "d")
    with pytest.raises(ValueError, match="index.json"):
        write(("k_0", image, 0, {}), "d")


def test_synthetic_is_deterministic_and_classes_differ_in_colour():
    first = list(sources.synthetic(40, 16, 4, seed=1, split="s").samples())
    again = list(sources.synthetic(60, 16, 4, seed=1, split="s").samples())[:40]  # a prefix of a larger set
    other = list(sources.synthetic(40, 16, 4, seed=2, split="s").samples())
    assert all(np.array_equal(np.asarray(a.image), np.asarray(b.image)) for a, b in zip(first, again, strict=True))
    assert not np.array_equal(np.asarray(first[0].image), np.asarray(other[0].image))
    assert [s.label for s in first] == [i % 4 for i in range(40)]
    # The brightest pixels of each image carry the class colour: their mean hue differs between classes.
    hues = [[] for _ in range(4)]
    for s in first:
        hsv = np.asarray(s.image.convert("HSV"), dtype=np.float64).reshape(-1, 3)
        hues[s.label].append(np.median(hsv[hsv[:, 2] > 200, 0]))
    class_hues = sorted(np.median(h) for h in hues)
    assert min(np.diff(class_hues)) > 30  # of 255


@needs_fashion_mnist
def test_fashion_mnist_cli_writes_real_images(tmp_path, capsys):
    out = tmp_path / "fm"
    main(f"write --source fashion-mnist --split test --limit 50 --out {out} --shard-size 20".split())
    index = json.loads((out / "index.json").read_text())
    assert index["num_samples"] == 50 and [s["num_samples"] for s in index["shards"]] == [20, 20, 10]
    assert index["image_size"] == [28, 28] and index["classes"][9] == "Ankle boot" and index["split"] == "test"

    images = sources.read_idx(os.path.join(FM_DIR, "t10k-images-idx3-ubyte.gz"), 0x803)  # (10000, 28, 28)
    labels = sources.read_idx(os.path.join(FM_DIR, "t10k-labels-idx1-ubyte.gz"), 0x801)  # (10000,)
    assert images.shape == (10000, 28, 28) and labels.shape == (10000,)
    stored = _read_tar(str(out / "test-000000.tar"))
    order = sources.shuffled_order(10000, seed=0)[:20]  # --limit takes the first samples of the shuffled order
    assert [s["__key__"] for s in stored] == [f"test_{i:08d}" for i in order]
    assert index["shuffle_seed"] == 0
    for i, sample in zip(order, stored, strict=True):
        assert int(sample["cls"]) == labels[i] and 0 <= labels[i] < 10
        np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(sample["png"]))), images[i])

    capsys.readouterr()
    main(["inspect", str(out)])
    text = capsys.readouterr().out
    assert "shards: 3" in text and "samples: 50 (index.json: 50)" in text and "Ankle boot" in text
    assert f"test_{order[0]:08d}: png 28x28 L  label " in text and "other fields: cls, json" in text
    assert "shuffle_seed: 0" in text


def test_fashion_mnist_missing_or_bad_files_name_the_path(tmp_path):
    missing = r"--path \(.*\): no train-images-idx3-ubyte.gz.*apt-get install -y dataset-fashion-mnist"
    with pytest.raises(ValueError, match=missing):
        sources.fashion_mnist(str(tmp_path), "test")
    bad = tmp_path / "labels.gz"
    with gzip.open(bad, "wb") as f:
        f.write((0x803).to_bytes(4, "big") + (1).to_bytes(4, "big") + b"\x00")
    with pytest.raises(ValueError, match=r"labels.gz: IDX magic number 0x00000803, expected 0x00000801"):
        sources.read_idx(str(bad), 0x801)
    with pytest.raises(ValueError, match="split"):
        sources.fashion_mnist(None, "val")


def test_imagefolder_sorted_classes_formats_and_inspect(tmp_path):
    root = tmp_path / "tree"
    colours = {"cat": (250, 0, 0), "ant": (0, 250, 0)}
    for name, colour in colours.items():
        (root / name).mkdir(parents=True)
        Image.new("RGB", (9, 7), colour).save(root / name / "b.bmp")
        Image.new("RGB", (9, 7), colour).save(root / name / "a.png")
    (root / "ant" / "notes.txt").write_text("not an image")
    (root / ".ipynb_checkpoints").mkdir()  # hidden folders are not classes
    args = [
        "write",
        "--source",
        "imagefolder",
        "--path",
        str(root),
        "--out",
        str(tmp_path / "out"),
        "--shard-size",
        "3",
    ]
    main([*args, "--no-shuffle"])  # the source's own order: classes and files sorted

    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert index["classes"] == ["ant", "cat"] and index["num_samples"] == 4 and index["image_size"] == [7, 9]
    stored = [s for shard in index["shards"] for s in _read_tar(str(tmp_path / "out" / shard["name"]))]
    assert [json.loads(s["json"])["path"] for s in stored] == ["ant/a.png", "ant/b.bmp", "cat/a.png", "cat/b.bmp"]
    assert [int(s["cls"]) for s in stored] == [0, 0, 1, 1]
    assert stored[0]["png"] == (root / "ant" / "a.png").read_bytes()  # PNG files are kept as they are
    decoded = np.asarray(Image.open(io.BytesIO(stored[3]["png"])))  # the BMP, re-encoded losslessly
    assert decoded.shape == (7, 9, 3) and (decoded == colours["cat"]).all()

    lines = inspect_shards(str(tmp_path / "out" / "train-*.tar"), num_show=2)
    assert lines[0].startswith("shards: 2") and lines[1] == "samples: 4 (index.json: 4)"
    assert lines[4:] == [
        "  train_00000000: png 9x7 RGB  label 0 (ant)  other fields: cls, json",
        "  train_00000001: png 9x7 RGB  label 0 (ant)  other fields: cls, json",
    ]


def _tree(root, num_classes: int, per_class: int) -> None:
    """A class-per-folder tree of 4x4 PNGs whose pixel value encodes (class, file)."""
    for c in range(num_classes):
        (root / f"class{c}").mkdir(parents=True)
        for k in range(per_class):
            Image.new("L", (4, 4), c * per_class + k).save(root / f"class{c}" / f"{k:02d}.png")


def test_imagefolder_is_written_in_a_seeded_shuffled_order_with_stable_keys(tmp_path):
    _tree(tmp_path / "tree", num_classes=3, per_class=10)

    def write(out: str, *extra: str) -> tuple[dict, list[dict]]:
        tree = str(tmp_path / "tree")
        main(
            [
                "write",
                "--source",
                "imagefolder",
                "--path",
                tree,
                "--out",
                str(tmp_path / out),
                "--shard-size",
                "10",
                *extra,
            ]
        )
        index = json.loads((tmp_path / out / "index.json").read_text())
        return index, [s for shard in index["shards"] for s in _read_tar(str(tmp_path / out / shard["name"]))]

    index, stored = write("seed0")
    _, in_order = write("plain", "--no-shuffle")
    _, seed1 = write("seed1", "--shuffle-seed", "1")
    _, limited = write("limited", "--limit", "7")

    order = sources.shuffled_order(30, seed=0)
    assert index["shuffle_seed"] == 0 and [s["__key__"] for s in stored] == [f"train_{i:08d}" for i in order]
    by_key = {s["__key__"]: s for s in in_order}  # a sample keeps its key, label, path and bytes in any order
    for sample in stored:
        ref = by_key[sample["__key__"]]
        assert sample["cls"] == ref["cls"] and sample["json"] == ref["json"] and sample["png"] == ref["png"]
    assert sorted(by_key) == [s["__key__"] for s in in_order]  # --no-shuffle: the source order
    assert [int(s["cls"]) for s in in_order] == [c for c in range(3) for _ in range(10)]
    assert all(len({int(s["cls"]) for s in stored[i : i + 10]}) == 3 for i in (0, 10, 20))  # each shard: all classes
    assert [s["__key__"] for s in seed1] != [s["__key__"] for s in stored]
    assert [s["__key__"] for s in limited] == [s["__key__"] for s in stored[:7]]  # the first of the same order
    assert json.loads((tmp_path / "plain" / "index.json").read_text())["shuffle_seed"] is None
    write("again")
    names = [shard["name"] for shard in index["shards"]]
    assert [(tmp_path / "again" / n).read_bytes() for n in names] == [
        (tmp_path / "seed0" / n).read_bytes() for n in names
    ]


def test_sources_load_samples_only_when_reached(tmp_path):
    _tree(tmp_path / "tree", num_classes=2, per_class=3)
    source = sources.image_folder(str(tmp_path / "tree"), "train")
    loaded = []
    counting = source._replace(load=lambda i: loaded.append(i) or source.load(i))
    samples = counting.samples([4, 0, 5])
    assert loaded == []
    assert next(samples).key == "train_00000004" and loaded == [4]
    assert [s.label for s in samples] == [0, 1] and loaded == [4, 0, 5]


def test_shard_size_defaults_to_a_thousand_samples(tmp_path):
    main(["write", "--source", "synthetic", "--num-samples", "1500", "--image-size", "4", "--out", str(tmp_path)])
    index = json.loads((tmp_path / "index.json").read_text())
    assert [shard["num_samples"] for shard in index["shards"]] == [1000, 500]
