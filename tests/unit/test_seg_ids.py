"""Segmentation ids where a mask leaves the project, and evaluation without a host read per image: the dataset's own
ids (a reduce-zero-label set's training id k is its id k + 1) in `finetune predict`, the pictures' legend and the
per-class table; the mIoU convention against an independent computation (mmsegmentation's nanmean of intersect over
union); the confusion counts kept on the device, the host reads of a pass the same for 4 images and for 20."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from core.engine.distributed import DistInfo
from core.report.metrics import Confusion, confusion_counts, segmentation_scores
from core.report.pictures import class_colours, id_colours, legend
from data.__main__ import main as data_main
from data.device import normalisation
from data.index import shard_samples
from data.segmentation import IGNORE_INDEX, SEG_FIELD, dataset_ids, decode_mask
from data.specs import segmentation_info
from finetune.predict import written_ids
from finetune.seg_evaluate import AGREE_EVERY, evaluate_segmentation, segmentation_picture
from finetune.segment import per_class_iou_table
from tests.unit.test_seg_model import _ColourEngine

CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def test_training_ids_and_the_dataset_s_own():
    assert dataset_ids(3, reduce_zero_label=True) == [1, 2, 3] and dataset_ids(3, reduce_zero_label=False) == [0, 1, 2]
    info = {"num_classes": 3, "reduce_zero_label": True}
    assert written_ids(info, Path("export"), training_ids=False) == [1, 2, 3]
    assert written_ids(info, Path("export"), training_ids=True) == [0, 1, 2]
    assert written_ids({**info, "reduce_zero_label": False}, Path("export"), training_ids=False) == [0, 1, 2]
    with pytest.raises(ValueError, match="does not record whether the set's ids were reduced.*--training-ids"):
        written_ids({"num_classes": 3}, Path("export"), training_ids=False)  # an older export: no guess


def test_a_class_has_the_colour_of_the_id_it_is_written_as_and_the_picture_names_it():
    voc = class_colours(4)
    assert torch.equal(id_colours([1, 2, 3]), torch.cat([voc[1:4], voc[-1:]]))  # white last: ignored
    image = torch.zeros(3, 8, 8, dtype=torch.uint8)
    pred, target = torch.zeros(8, 8, dtype=torch.int64), torch.ones(8, 8, dtype=torch.int64)
    target[0] = IGNORE_INDEX
    picture = segmentation_picture([(image, pred, target)], ["wall", "floor", "tree"], [1, 2, 3])
    prediction = picture[:, :, picture.shape[-1] // 2]  # the middle column: the prediction panel
    seen = {tuple((255 * prediction[:, y]).round().int().tolist()) for y in range(prediction.shape[-1])}
    assert tuple(voc[1].tolist()) in seen  # training class 0 ("wall") in the colour of id 1, not of id 0
    strip = legend([("wall (1)", voc[1].tolist()), ("floor (2)", voc[2].tolist())], picture.shape[-1])
    assert torch.equal(picture[:, -strip.shape[-2] :], strip)  # below the panels: the classes shown, by name and id
    swatches = {
        tuple((255 * strip[:, y, x]).round().int().tolist())
        for y in range(strip.shape[-2])
        for x in range(strip.shape[-1])
    }
    assert tuple(voc[1].tolist()) in swatches and tuple(voc[3].tolist()) not in swatches  # tree: not shown


def test_the_per_class_table_names_classes_by_name_and_their_dataset_id():
    confusion = torch.tensor([[3, 1], [0, 4]])
    table = per_class_iou_table(confusion, ["wall", "floor"], [1, 2]).splitlines()
    assert [cell.strip() for cell in table[0].split("|")[1:5]] == ["class", "id", "pixels", "IoU"]
    assert [cell.strip() for cell in table[2].split("|")[1:5]] == ["wall", "1", "4", f"{3 / 4:.4f}"]
    assert [cell.strip() for cell in table[3].split("|")[1:5]] == ["floor", "2", "4", f"{4 / 5:.4f}"]


def _mmseg_miou(confusion: np.ndarray) -> tuple[float, list[float]]:
    """mmsegmentation's convention, computed independently: per class intersect / union with 0 / 0 a NaN, the mean
    over the classes that are not NaN."""
    intersect = np.diag(confusion).astype(float)
    union = confusion.sum(0) + confusion.sum(1) - intersect
    with np.errstate(invalid="ignore", divide="ignore"):
        iou = intersect / union
    return float(np.nanmean(iou)), iou.tolist()


@pytest.mark.parametrize(
    "confusion",
    [
        [[10, 2, 0, 0], [4, 6, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]],  # classes 2 and 3: absent, never predicted
        [[10, 2, 3, 0], [4, 6, 0, 0], [0, 0, 0, 0], [0, 0, 0, 5]],  # class 2 predicted, never present: IoU 0
        [[0, 0, 0], [0, 0, 0], [0, 0, 7]],  # only class 2 at all
    ],
)
def test_miou_leaves_out_classes_absent_from_prediction_and_truth_as_mmsegmentation_does(confusion):
    miou, iou = _mmseg_miou(np.array(confusion))
    scores = segmentation_scores(torch.tensor(confusion))
    assert scores["miou"] == pytest.approx(miou)
    assert [None if math.isnan(v) else pytest.approx(v) for v in iou] == scores["iou"]


def test_the_ignored_id_is_left_out_and_an_id_outside_the_classes_is_checked_once():
    target = torch.tensor([[0, 1, IGNORE_INDEX], [2, IGNORE_INDEX, 1]])
    pred = torch.tensor([[0, 2, 1], [2, 0, 1]])
    confusion = confusion_counts(pred, target, 3, IGNORE_INDEX)
    assert confusion.tolist() == [[1, 0, 0], [0, 1, 1], [0, 0, 1]]  # the two ignored pixels counted nowhere
    counter = Confusion(3, IGNORE_INDEX)
    counter.add(pred, target)
    counter.add(pred, torch.tensor([[5, 0, 0], [0, 0, 0]]))  # an id outside the classes: not counted, kept
    assert int(counter.matrix().sum()) == 4 + 5
    with pytest.raises(ValueError, match=r"class id 5 outside \[0, 3\)"):
        counter.check()


READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero", "cpu", "numpy")


def _host_reads(monkeypatch, num_images: int) -> int:
    """Tensor reads (each a wait for the device on a GPU) during one evaluation pass of `num_images` images."""
    image = torch.zeros(1, 3, 8, 8, dtype=torch.uint8)
    image[:, 0, :, :4] = 255
    seg = torch.zeros(1, 8, 8, dtype=torch.int64)
    batches = [{"image": image, "seg": seg, "normalise": {"image": normalisation((0,) * 3, (1,) * 3)}}] * num_images
    reads = []
    with monkeypatch.context() as patch:
        for name in READS:
            original = getattr(torch.Tensor, name)

            def counted(self, *args, _name=name, _original=original, **kwargs):
                reads.append(_name)
                return _original(self, *args, **kwargs)

            patch.setattr(torch.Tensor, name, functools.wraps(original)(counted))
        result = evaluate_segmentation(
            _ColourEngine(), batches, dist=CPU, precision="fp32", num_classes=3, crop=(8, 8), keep=0
        )
    assert result.metrics["val/images"] == num_images and int(result.confusion.sum()) == 64 * num_images
    return len(reads)


def test_host_reads_of_a_pass_do_not_grow_with_its_images(monkeypatch):
    assert AGREE_EVERY >= 20
    assert _host_reads(monkeypatch, 4) == _host_reads(monkeypatch, 20)


def test_a_set_written_without_the_reduction_round_trips_its_ids_unchanged(tmp_path):
    """ADE20K's layout written with --no-reduce-zero-label: the shards hold the annotations' own ids (0 a class),
    the index says so, and predict's ids for such an export are the training ids themselves."""
    for kind in ("images", "annotations"):
        (tmp_path / kind / "validation").mkdir(parents=True)
    annotation = np.zeros((8, 8), dtype=np.uint8)
    annotation[:, 4:] = 2
    Image.fromarray(np.full((8, 8, 3), 90, dtype=np.uint8)).save(tmp_path / "images" / "validation" / "a.png")
    Image.fromarray(annotation).save(tmp_path / "annotations" / "validation" / "a.png")
    out = tmp_path / "shards"
    data_main(["write", "--source", "segfolder", "--path", str(tmp_path), "--split", "val", "--out", str(out),
               "--no-reduce-zero-label"])  # fmt: skip
    info = segmentation_info(str(out))
    assert info["reduce_zero_label"] is False and info["num_classes"] == 3
    (sample,) = [s for shard in sorted(out.glob("*.tar")) for s in shard_samples(str(shard), frozenset({SEG_FIELD}))]
    assert (decode_mask(sample[SEG_FIELD]) == annotation).all()  # stored as annotated
    exported = {"num_classes": 3, "reduce_zero_label": info["reduce_zero_label"]}
    assert written_ids(exported, Path("export"), training_ids=False) == [0, 1, 2]  # written back unchanged
