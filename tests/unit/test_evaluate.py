"""Evaluation sums, the confusion matrix and its table / picture, on hand-made logits in one process."""

import pytest
import torch

import finetune.evaluate as evaluate_module
from core.engine.distributed import DistInfo
from core.report.pictures import abbreviate, matrix_layout
from finetune.evaluate import ROW_TITLE, confusion_cell_text, confusion_image, evaluate, per_class_table

DIST = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
DARK_BLUE = torch.tensor([8 / 255, 48 / 255, 107 / 255])


class EchoEngine:
    """Stands in for the DeepSpeed engine: the batch's "image" is (B, K) and is returned as the logits."""

    def __init__(self):
        self.training = True
        self.num_forwards = 0

    def __call__(self, batch: dict) -> dict:
        self.num_forwards += 1
        return {"logits": batch["image"]}

    def eval(self):
        self.training = False

    def train(self):
        self.training = True


def one_hot_batch(predicted: list[int], labels: list[int], num_classes: int = 3) -> dict:
    """Logits whose top-1 is `predicted` (the others in a fixed order below it)."""
    logits = torch.arange(num_classes, dtype=torch.float32).repeat(len(labels), 1) * 0.1  # (B, K)
    logits[torch.arange(len(labels)), predicted] = 10.0
    return {"image": logits, "label": torch.tensor(labels)}


def test_confusion_counts_and_scalars():
    batches = [one_hot_batch([0, 1, 1], [0, 1, 2]), one_hot_batch([2, 0], [2, 1])]
    engine = EchoEngine()
    confusion = torch.full((3, 3), 7, dtype=torch.int64)  # overwritten, not added to
    metrics = evaluate(engine, batches, dist=DIST, precision="fp32", confusion=confusion)
    expected = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 1]])  # rows true, columns predicted
    assert torch.equal(confusion, expected)
    assert metrics["val/samples"] == 5.0
    assert metrics["val/top1"] == pytest.approx(3 / 5)
    assert metrics["val/top5"] == 1.0  # K = 3 < 5
    logits = torch.cat([b["image"] for b in batches])
    labels = torch.cat([b["label"] for b in batches])
    assert metrics["val/loss"] == pytest.approx(torch.nn.functional.cross_entropy(logits, labels).item(), rel=1e-6)
    assert engine.training  # put back in training mode


def test_metrics_without_confusion_are_the_same():
    batches = [one_hot_batch([0, 1, 1], [0, 1, 2])]
    with_confusion = evaluate(
        EchoEngine(), batches, dist=DIST, precision="fp32", confusion=torch.zeros(3, 3, dtype=torch.int64)
    )
    assert evaluate(EchoEngine(), batches, dist=DIST, precision="fp32") == with_confusion


def lagging_rank(num_extra_steps: int):
    """all_reduce as seen by a rank whose peer has `num_extra_steps` more batches than it does."""
    calls = {"max": 0}

    def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if op == "max":
            calls["max"] += 1
            if calls["max"] > 1:  # from the second lock-step on, the peer still has data for a while
                tensor[0] = max(tensor[0].item(), 1.0 if calls["max"] <= 1 + num_extra_steps else 0.0)
        return tensor

    return all_reduce


def test_stand_in_batches_do_not_count(monkeypatch):
    monkeypatch.setattr(evaluate_module, "all_reduce", lagging_rank(num_extra_steps=3))
    engine = EchoEngine()
    confusion = torch.zeros(3, 3, dtype=torch.int64)
    metrics = evaluate(engine, [one_hot_batch([2, 2], [0, 2])], dist=DIST, precision="fp32", confusion=confusion)
    assert engine.num_forwards == 4  # its one batch, then 3 stand-ins to keep in step with the peer
    assert metrics["val/samples"] == 2.0
    assert metrics["val/top1"] == 0.5
    assert torch.equal(confusion, torch.tensor([[0, 0, 1], [0, 0, 0], [0, 0, 1]]))


def test_rank_without_any_batch_raises_clearly(monkeypatch):
    def peer_has_data(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if op == "max":
            tensor[0] = 1.0
        return tensor

    monkeypatch.setattr(evaluate_module, "all_reduce", peer_has_data)
    engine = EchoEngine()
    with pytest.raises(ValueError, match="rank 0 got no samples from its eval shards while other ranks did"):
        evaluate(engine, [], dist=DIST, precision="fp32")
    assert engine.num_forwards == 0


def test_empty_everywhere_gives_zero_samples():
    confusion = torch.ones(2, 2, dtype=torch.int64)
    metrics = evaluate(EchoEngine(), [], dist=DIST, precision="fp32", confusion=confusion)
    assert metrics == {"val/loss": 0.0, "val/top1": 0.0, "val/top5": 0.0, "val/samples": 0.0}
    assert not confusion.any()


def test_confusion_argument_is_checked():
    with pytest.raises(ValueError, match="int64"):
        evaluate(EchoEngine(), [], dist=DIST, precision="fp32", confusion=torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"\(K, K\)"):
        evaluate(EchoEngine(), [], dist=DIST, precision="fp32", confusion=torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="the model has 3 classes"):
        confusion = torch.zeros(4, 4, dtype=torch.int64)
        evaluate(EchoEngine(), [one_hot_batch([0], [0])], dist=DIST, precision="fp32", confusion=confusion)


def test_per_class_table():
    confusion = torch.tensor([[5, 1, 0], [2, 2, 0], [0, 0, 0]])  # "bird" has no samples
    lines = per_class_table(confusion, ["cat", "dog", "bird"]).splitlines()
    assert lines[0] == "| class | samples | correct | accuracy |"
    assert lines[1] == "| :---- | ------: | ------: | -------: |"
    assert lines[2] == "| cat   |       6 |       5 |   0.8333 |"
    assert lines[3] == "| dog   |       4 |       2 |   0.5000 |"
    assert lines[4] == "| bird  |       0 |       0 |        - |"
    assert lines[5] == ""
    assert lines[6] == "mean per-class accuracy: 0.6667 (2 of 3 classes have samples)"  # (5/6 + 2/4) / 2
    assert len(lines) == 7


def test_per_class_table_checks_names():
    with pytest.raises(ValueError, match="2 class names for a 3-class"):
        per_class_table(torch.zeros(3, 3, dtype=torch.int64), ["a", "b"])


def _region(image, box):
    left, top, right, bottom = box
    return image[:, top:bottom, left:right]


def test_confusion_image_writes_counts_in_colour_coded_cells_and_names_both_axes():
    names = ["cat", "dog", "bird"]
    confusion = torch.tensor([[7, 0, 3], [3, 7, 0], [0, 0, 0]])  # bird has no samples
    image = confusion_image(confusion, names)
    layout = matrix_layout(confusion_cell_text(confusion), names, names, row_title=ROW_TITLE)
    assert image.shape[1] == layout.height and image.shape[2] >= layout.width
    assert confusion_cell_text(confusion) == [["7", "", "3"], ["3", "7", ""], ["", "", ""]]
    fractions = torch.tensor([[0.7, 0.0, 0.3], [0.3, 0.7, 0.0]])
    for row in range(3):
        for col in range(3):
            cell = _region(image, layout.cell_box(row, col))  # (3, C, C)
            fill = cell[:, 0, 0]
            expected = 1 + (DARK_BLUE - 1) * fractions[row, col] if row < 2 else torch.full((3,), 0.85)
            torch.testing.assert_close(fill, expected, atol=1 / 255, rtol=0)
            text = (cell - fill[:, None, None]).abs().amax(dim=0) > 0.1  # (C, C) pixels of the count
            assert text.any() == bool(confusion[row, col]), (row, col)
            if text.any():  # centred: no ink on the cell's border
                assert not (text[0].any() or text[-1].any() or text[:, 0].any() or text[:, -1].any())
    # The same count on the same colour is the same picture; another count is another picture.
    assert torch.equal(_region(image, layout.cell_box(0, 0)), _region(image, layout.cell_box(1, 1)))
    assert torch.equal(_region(image, layout.cell_box(0, 2)), _region(image, layout.cell_box(1, 0)))
    for box in [*map(layout.row_label_box, range(3)), *map(layout.col_label_box, range(3))]:
        assert (_region(image, box) < 0.5).any(), box  # dark text on white
    assert not torch.equal(_region(image, layout.row_label_box(0)), _region(image, layout.row_label_box(1)))
    scale = _region(image, layout.scale_box())  # colour bar: 1 at the top, 0 at the bottom
    torch.testing.assert_close(scale[:, 0, 0], DARK_BLUE, atol=1 / 255, rtol=0)
    torch.testing.assert_close(scale[:, -1, 0], torch.ones(3), atol=1 / 255, rtol=0)


def test_confusion_image_shortens_long_names_and_draws_at_most_max_classes():
    assert abbreviate("a very long class name") == "a very long cla\u2026" and len(abbreviate("x" * 40)) == 16
    assert abbreviate("short") == "short"
    confusion = torch.tensor([[1, 3, 0], [0, 0, 0], [0, 0, 2]])
    names = ["a very long class name", "b", "c"]
    image = confusion_image(confusion, names, max_classes=2)  # first 2 classes drawn
    layout = matrix_layout(confusion_cell_text(confusion[:2, :2]), names[:2], names[:2], row_title=ROW_TITLE)
    assert (layout.rows, layout.cols) == (2, 2) and image.shape[1] == layout.height
    quarter = 1 + (DARK_BLUE - 1) * 0.25  # row 0: 1 of its 4 samples predicted as class 0, normalised by the whole row
    torch.testing.assert_close(_region(image, layout.cell_box(0, 0))[:, 0, 0], quarter, atol=1 / 255, rtol=0)
    many = confusion_image(torch.eye(1000, dtype=torch.int64))
    names = [str(k) for k in range(100)]
    layout = matrix_layout(confusion_cell_text(torch.eye(100, dtype=torch.int64)), names, names, row_title=ROW_TITLE)
    assert layout.rows == 100 and many.shape[1] == layout.height
