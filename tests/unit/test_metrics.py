"""Top-k counting, checked against a hand-made example."""

import torch

from core.report.metrics import topk_correct


def test_topk_correct_on_hand_made_example():
    logits = torch.tensor(
        [
            [0.1, 0.9, 0.0, 0.3],  # ranking 1, 3, 0, 2; label 1 -> top-1
            [0.8, 0.1, 0.7, 0.0],  # ranking 0, 2, 1, 3; label 2 -> top-2
            [0.2, 0.3, 0.1, 0.4],  # ranking 3, 1, 0, 2; label 2 -> top-4 only
        ]
    )
    labels = torch.tensor([1, 2, 2])

    counts = topk_correct(logits, labels, ks=(1, 2, 3, 10))

    assert counts.tolist() == [1, 2, 2, 3]  # k=10 is clamped to the 4 classes
    assert counts.dtype == torch.int64
