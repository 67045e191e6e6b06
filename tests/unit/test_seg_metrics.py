"""mIoU, per-class IoU and pixel accuracy from a confusion matrix, against hand computations."""

from __future__ import annotations

import pytest
import torch

from core.report.metrics import confusion_counts, segmentation_scores


def test_confusion_counts_pixels_by_true_and_predicted_class_and_leaves_the_ignored_out():
    target = torch.tensor([[0, 0, 1], [2, 255, 1]])
    pred = torch.tensor([[0, 1, 1], [0, 2, 2]])
    expected = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 0, 0]])  # rows true, columns predicted
    assert torch.equal(confusion_counts(pred, target, 3, 255), expected)
    with pytest.raises(ValueError, match=r"class id 3 outside \[0, 3\)"):
        confusion_counts(pred, torch.tensor([[3]]).expand(2, 3), 3, 255)


def test_scores_match_a_hand_computed_confusion_matrix():
    # true \ predicted: class 0 10 right, 2 taken for 1; class 1 6 right, 4 taken for 0; class 2 never occurs,
    # predicted twice (for class 0 pixels); class 3 neither occurs nor is predicted.
    confusion = torch.tensor([[10, 2, 2, 0], [4, 6, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    scores = segmentation_scores(confusion)
    iou0 = 10 / (10 + 2 + 2 + 4)  # TP / (TP + FN + FP)
    iou1 = 6 / (6 + 4 + 2)
    assert scores["iou"][:3] == pytest.approx([iou0, iou1, 0.0])
    assert scores["iou"][3] is None  # left out of the mean
    assert scores["miou"] == pytest.approx((iou0 + iou1 + 0.0) / 3)
    assert scores["pixel_acc"] == pytest.approx(16 / 24)
    assert scores["mean_acc"] == pytest.approx((10 / 14 + 6 / 10) / 2)


def test_summed_confusions_give_the_scores_of_the_whole():
    """Ranks sum their matrices (finetune/segmentation.py): the scores of the sum are those of all pixels at once."""
    generator = torch.Generator().manual_seed(0)
    target = torch.randint(0, 5, (4, 16, 16), generator=generator)
    target[:, :2] = 255
    pred = torch.randint(0, 5, (4, 16, 16), generator=generator)
    whole = confusion_counts(pred, target, 5, 255)
    parts = sum(confusion_counts(pred[i : i + 1], target[i : i + 1], 5, 255) for i in range(4))
    assert torch.equal(whole, parts) and int(whole.sum()) == 4 * 14 * 16
    assert segmentation_scores(whole) == segmentation_scores(parts)
