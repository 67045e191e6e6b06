"""Segmentation data: masks in shards (write, inspect, stream), the ADE20K folder layout, the Fashion-MNIST scenes,
and the transforms that move image and mask together."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from data import seg_sources
from data.__main__ import inspect_shards
from data.__main__ import main as data_main
from data.pipeline import MaskError, make_eval_loader, make_train_loader
from data.seg_transforms import SegEvalTransform, SegTrainTransform
from data.segmentation import IGNORE_INDEX, SEG_FIELD, decode_mask
from data.sources import Sample
from data.specs import read_index, resolve_shards, segmentation_info
from data.write import write_shards
from tests.helpers.datasets import needs_fashion_mnist

MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
PALETTE = np.array([[10, 200, 30], [250, 20, 90], [40, 60, 220], [200, 200, 0]], dtype=np.uint8)


def blocks(height: int, width: int, side: int = 8) -> np.ndarray:
    """A class map of side x side blocks, classes 0-3 in a fixed pattern."""
    rows, cols = np.arange(height)[:, None] // side, np.arange(width)[None, :] // side
    return ((rows * 3 + cols * 5) % 4).astype(np.uint8)


def uniform_interior(mask: torch.Tensor, radius: int) -> torch.Tensor:
    """Pixels whose (2 radius + 1)^2 neighbourhood holds a single id (edges of the crop excluded)."""
    m = mask.float()[None, None]
    size = 2 * radius + 1
    low = -torch.nn.functional.max_pool2d(-m, size, stride=1, padding=radius)
    high = torch.nn.functional.max_pool2d(m, size, stride=1, padding=radius)
    inside = torch.zeros_like(mask, dtype=torch.bool)
    inside[radius:-radius, radius:-radius] = True
    return (low == high)[0, 0] & inside


@pytest.mark.parametrize("seed", range(6))
def test_train_transform_keeps_image_and_mask_aligned_pixel_for_pixel(seed):
    """Every pixel of the crop inside a uniform region shows its class's colour; padding is 0 in the image and the
    ignore id in the mask."""
    ids = blocks(40, 56, side=20)  # 8 px blocks at the smallest scale (0.5 x 32 / 40)
    image = Image.fromarray(PALETTE[ids])
    transform = SegTrainTransform(32, MEAN, STD, scale=(0.5, 2.0), photometric=False)
    torch.manual_seed(seed)
    out = transform(image, ids)
    pixels, mask = out["image"], out["seg"]
    assert pixels.shape == (3, 32, 32) and pixels.dtype == torch.uint8
    assert mask.shape == (32, 32) and mask.dtype == torch.int64
    scored = uniform_interior(mask, 2) & (mask != IGNORE_INDEX)
    assert scored.sum() > 30
    expected = torch.from_numpy(PALETTE)[mask[scored]].T  # (3, n)
    assert (pixels[:, scored].int() - expected.int()).abs().max() <= 1
    padded = mask == IGNORE_INDEX
    assert torch.all(pixels[:, padded] == 0)


def test_small_scales_pad_with_the_ignore_id_and_flips_move_both():
    ids = blocks(32, 32)
    image = Image.fromarray(PALETTE[ids])
    out = SegTrainTransform(32, MEAN, STD, scale=(0.5, 0.5), hflip=0.0, photometric=False)(image, ids)
    assert (out["seg"][16:, :] == IGNORE_INDEX).all() and (out["seg"][:, 16:] == IGNORE_INDEX).all()
    assert torch.equal(out["seg"][:16, :16], torch.from_numpy(ids[::2, ::2]).long())  # nearest, 2x down
    flipped = SegTrainTransform(32, MEAN, STD, scale=(1.0, 1.0), hflip=1.0, photometric=False)(image, ids)
    assert torch.equal(flipped["seg"], torch.from_numpy(ids[:, ::-1].copy()).long())
    assert torch.equal(flipped["image"], torch.from_numpy(PALETTE[ids[:, ::-1]]).permute(2, 0, 1))


def test_photometric_jitter_changes_the_image_only():
    ids = blocks(48, 48)
    image = Image.fromarray(PALETTE[ids])
    outs = []
    for photometric in (False, True):
        torch.manual_seed(3)
        outs.append(SegTrainTransform(32, MEAN, STD, photometric=photometric)(image, ids))
    assert torch.equal(outs[0]["seg"], outs[1]["seg"])
    assert not torch.equal(outs[0]["image"], outs[1]["image"])


def test_eval_transform_resizes_the_image_and_keeps_the_mask_as_stored():
    ids = blocks(40, 60)
    image = Image.fromarray(PALETTE[ids])
    whole = SegEvalTransform(32, MEAN, STD)(image, ids)
    assert whole["image"].shape == (3, 32, 32) and torch.equal(whole["seg"], torch.from_numpy(ids).long())
    slide = SegEvalTransform(32, MEAN, STD, mode="slide", base_size=20)(image, ids)
    assert slide["image"].shape == (3, 20, 30) and slide["seg"].shape == (40, 60)
    with pytest.raises(ValueError, match="mask of 60x40 for an image of 30x20"):
        SegEvalTransform(32, MEAN, STD)(image.resize((30, 20)), ids)


def test_masks_decode_from_greyscale_and_palette_pngs_only():
    ids = blocks(8, 8)
    for mode in ("L", "P"):
        buffer = io.BytesIO()
        Image.fromarray(ids).convert(mode).save(buffer, format="PNG")
        assert np.array_equal(decode_mask(buffer.getvalue()), ids)
    buffer = io.BytesIO()
    Image.fromarray(PALETTE[ids]).save(buffer, format="PNG")
    with pytest.raises(ValueError, match="greyscale or palette PNG of class ids, this one is RGB"):
        decode_mask(buffer.getvalue())


def _ade_layout(root, pairs: dict[str, tuple[np.ndarray, tuple[int, int]]], split="training") -> None:
    """ROOT/images/<split>/<stem>.jpg of the given (W, H) and ROOT/annotations/<split>/<stem>.png holding the ids."""
    for kind in ("images", "annotations"):
        (root / kind / split).mkdir(parents=True, exist_ok=True)
    for stem, (ids, size) in pairs.items():
        Image.new("RGB", size, (90, 120, 150)).save(root / "images" / split / f"{stem}.jpg")
        Image.fromarray(ids).save(root / "annotations" / split / f"{stem}.png")


def test_segfolder_reduces_the_zero_label_and_names_its_classes(tmp_path):
    ids = np.array([[0, 1, 5], [150, 255, 2]], dtype=np.uint8)
    _ade_layout(tmp_path, {"ADE_train_1": (ids, (3, 2)), "ADE_train_0": (ids.T.copy(), (2, 3))})
    (tmp_path / "objectInfo150.txt").write_text(
        "Idx\tRatio\tTrain\tVal\tName\n" + "".join(f"{k}\t0.1\t1\t1\tthing{k}, alias;more\n" for k in range(1, 151))
    )
    source, info = seg_sources.segfolder(str(tmp_path), "train")
    assert info == seg_sources.SegInfo(150, True) and source.classes[:2] == ["thing1", "thing2"]
    first = source.load(0)  # sorted by stem: ADE_train_0
    assert first.label is None and first.meta["image"] == "images/training/ADE_train_0.jpg"
    assert np.array_equal(np.asarray(first.seg), np.array([[255, 149], [0, 255], [4, 1]], dtype=np.uint8))
    reduced = np.asarray(source.load(1).seg)
    assert np.array_equal(reduced, np.array([[255, 0, 4], [149, 255, 1]], dtype=np.uint8))
    plain, info = seg_sources.segfolder(str(tmp_path), "train", reduce_zero_label=False)
    assert np.array_equal(np.asarray(plain.load(1).seg), ids) and not info.reduce_zero_label


def test_segfolder_refuses_unpaired_and_misfit_files_before_writing(tmp_path):
    ids = np.zeros((4, 6), dtype=np.uint8)
    _ade_layout(tmp_path, {"a": (ids, (6, 4)), "b": (ids, (6, 4))})
    (tmp_path / "annotations" / "training" / "b.png").rename(tmp_path / "annotations" / "training" / "c.png")
    with pytest.raises(ValueError, match=r"1 files have no counterpart of their name in .*annotations/training: b.jpg"):
        seg_sources.segfolder(str(tmp_path), "train")
    (tmp_path / "images" / "training" / "b.jpg").unlink()
    Image.new("RGB", (5, 4)).save(tmp_path / "images" / "training" / "c.jpg")
    with pytest.raises(ValueError, match=r"mask .*c.png is 6x4 but its image .*c.jpg is 5x4"):
        seg_sources.segfolder(str(tmp_path), "train")
    Image.fromarray(PALETTE[ids]).save(tmp_path / "annotations" / "training" / "c.png")
    with pytest.raises(ValueError, match=r"mask .*c.png is RGB, not a greyscale or palette PNG"):
        seg_sources.segfolder(str(tmp_path), "train")
    with pytest.raises(ValueError, match="images/validation is not a directory"):
        seg_sources.segfolder(str(tmp_path), "val")


def test_write_refuses_masks_that_do_not_fit_their_image_or_the_classes(tmp_path):
    image = Image.new("RGB", (4, 3))
    info = seg_sources.SegInfo(3, False)

    def write(seg, name):
        samples = [Sample("k_0", image, None, {}, seg)]
        return write_shards(samples, str(tmp_path / name), shard_size=4, split="s", classes=[], source="t",
                            segmentation=info)  # fmt: skip

    with pytest.raises(ValueError, match="sample k_0: a segmentation set needs a mask"):
        write(None, "a")
    with pytest.raises(ValueError, match="sample k_0: mask is 3x3, its image 4x3"):
        write(Image.new("L", (3, 3)), "b")
    with pytest.raises(ValueError, match=r"sample k_0: mask holds class id 3, outside \[0, 3\)"):
        write(Image.new("L", (4, 3), 3), "c")
    index = write(Image.new("L", (4, 3), 255), "d")  # all ignored: fine
    assert index["segmentation"] == {"num_classes": 3, "ignore_index": 255, "reduce_zero_label": False}
    assert index["classes"] == ["class_0", "class_1", "class_2"]


def test_more_classes_than_8_bit_masks_hold_are_refused_when_writing_and_reading(tmp_path):
    ids = np.zeros((4, 6), dtype=np.uint8)
    _ade_layout(tmp_path / "ade", {"a": (ids, (6, 4))})
    args = ["write", "--source", "segfolder", "--path", str(tmp_path / "ade"), "--split", "train"]
    with pytest.raises(ValueError, match=r"segmentation set .*/out: 256 classes, .* at most 255 classes \(ids 0-254\)"):
        data_main([*args, "--out", str(tmp_path / "out"), "--num-classes", "256"])
    assert not (tmp_path / "out").exists()  # refused before anything was written
    data_main([*args, "--out", str(tmp_path / "ok"), "--num-classes", "255"])
    index = json.loads((tmp_path / "ok" / "index.json").read_text())
    assert index["segmentation"]["num_classes"] == 255 and segmentation_info(str(tmp_path / "ok"))["num_classes"] == 255
    index["segmentation"]["num_classes"] = 300  # an index edited by hand
    (tmp_path / "ok" / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"ok/index.json: 300 classes, but masks are 8-bit PNGs"):
        segmentation_info(str(tmp_path / "ok"))


@pytest.fixture(scope="module")
def scenes(tmp_path_factory):
    out = tmp_path_factory.mktemp("scenes") / "val"
    data_main(["write", "--source", "fashion-mnist-scenes", "--split", "val", "--num-samples", "20", "--out",
               str(out), "--shard-size", "8"])  # fmt: skip
    return out


@needs_fashion_mnist
def test_scenes_are_garments_on_a_canvas_with_their_own_masks(scenes):
    index = read_index(str(scenes))
    assert index["segmentation"] == {"num_classes": 11, "ignore_index": 255, "reduce_zero_label": False}
    assert index["classes"][0] == "background" and index["classes"][4] == "Dress" and index["num_samples"] == 20
    assert [s["num_samples"] for s in index["shards"]] == [8, 8, 4]
    source, _ = seg_sources.fashion_mnist_scenes(None, "val", 20, 0)
    again, _ = seg_sources.fashion_mnist_scenes(None, "val", 20, 0)
    for i in range(20):
        sample = source.load(i)
        image, ids = np.asarray(sample.image), np.asarray(sample.seg)
        assert np.array_equal(image, np.asarray(again.load(i).image))  # a function of (seed, split, i)
        assert 64 <= ids.shape[0] <= 96 and 64 <= ids.shape[1] <= 96 and image.shape == (*ids.shape, 3)
        garments = sample.meta["garments"]
        assert 2 <= len(garments) <= 4 and 1 + garments[-1][1] in ids  # the last one pasted is never covered
        assert set(np.unique(ids)) <= {0} | {1 + g[1] for g in garments}
        assert image[ids == 0].max() <= 70 + 12  # the canvas: dark noise
    lines = inspect_shards(str(scenes), 1)
    assert "mask " in lines[-1] and "(background)" in lines[-1]


@needs_fashion_mnist
def test_scenes_stream_with_aligned_masks_for_training_and_evaluation(scenes):
    shards = resolve_shards(str(scenes))
    train = make_train_loader(
        shards, transform=SegTrainTransform(48, MEAN, STD), batch_size=4, seed=0, rank=0, world_size=1,
        num_workers=0, labels=False, shuffle_buffer=0,
    )  # fmt: skip
    batch = next(iter(train))
    assert batch["image"].shape == (4, 3, 48, 48) and batch["seg"].shape == (4, 48, 48)
    assert set(batch["seg"].unique().tolist()) <= set(range(11)) | {IGNORE_INDEX}
    evaluation = make_eval_loader(
        shards, transform=SegEvalTransform(48, MEAN, STD), batch_size=1, rank=0, world_size=1, num_workers=0,
        labels=False,
    )  # fmt: skip
    source, _ = seg_sources.fashion_mnist_scenes(None, "val", 20, 0)
    seen = 0
    for batch in evaluation:
        i = int(batch["key"][0].split("_")[1])
        assert batch["image"].shape == (1, 3, 48, 48)
        assert torch.equal(batch["seg"][0], torch.from_numpy(np.array(source.load(i).seg)).long())
        seen += 1
    assert seen == 20


def test_a_shard_without_masks_stops_a_segmentation_stream_naming_the_sample(tmp_path):
    data_main(["write", "--source", "synthetic", "--num-samples", "4", "--image-size", "8", "--out",
               str(tmp_path / "cls"), "--shard-size", "4", "--split", "s"])  # fmt: skip
    loader = make_eval_loader(
        resolve_shards(str(tmp_path / "cls")), transform=SegEvalTransform(8, MEAN, STD), batch_size=1, rank=0,
        world_size=1, num_workers=0, labels=False,
    )  # fmt: skip
    with pytest.raises(MaskError, match=rf"sample s_\d+ in shard .*s-000000.tar has no .{SEG_FIELD} mask"):
        next(iter(loader))
    assert json.loads((tmp_path / "cls" / "index.json").read_text()).get("segmentation") is None
