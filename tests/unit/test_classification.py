"""The classification objective, checked against hand-computed values."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from finetune.classification import Classification
from tests.helpers.models import wide_vit


class FixedLogits(nn.Module):
    """Stands in for a ViT: returns the given logits whatever the image."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits
        self.num_classes = logits.shape[-1]

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.logits


def test_loss_is_label_smoothed_cross_entropy_computed_by_hand():
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    labels = torch.tensor([0, 1])
    eps = 0.3
    objective = Classification(FixedLogits(logits), label_smoothing=eps)

    out = objective({"image": torch.zeros(2, 3, 28, 28), "label": labels})

    # Sample 0: log-softmax = (2 - L, -L, -L), L = log(e^2 + 2); target = (1 - eps + eps/3, eps/3, eps/3).
    log_z = math.log(math.exp(2) + 2)
    loss0 = -((1 - eps + eps / 3) * (2 - log_z) + 2 * (eps / 3) * (-log_z))
    loss1 = math.log(3)  # uniform logits: log K whatever the target
    assert out["loss"].item() == pytest.approx((loss0 + loss1) / 2, abs=1e-6)
    torch.testing.assert_close(out["loss"], F.cross_entropy(logits, labels, label_smoothing=eps))
    assert out["acc1"].item() == pytest.approx(0.5)  # sample 1 ties: argmax picks class 0
    assert out["loss"].dtype == out["logits"].dtype == torch.float32


def test_soft_labels_from_mixup():
    logits = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 1.0]])
    soft = torch.tensor([[0.2, 0.8, 0.0], [0.4, 0.0, 0.6]])
    objective = Classification(FixedLogits(logits))

    out = objective({"image": torch.zeros(2, 3, 28, 28), "label": soft})

    expected = -(soft * logits.log_softmax(dim=-1)).sum(dim=-1).mean()
    torch.testing.assert_close(out["loss"], expected)
    assert out["acc1"].item() == pytest.approx(0.5)  # sample 0 right (class 1), sample 1 wrong (0 vs 2)


def test_vit_objective_gives_every_parameter_a_finite_gradient():
    objective = Classification(wide_vit(num_classes=5, global_pool="avg"), label_smoothing=0.1)
    batch = {"image": torch.randn(4, 3, 28, 28), "label": torch.tensor([0, 1, 2, 4])}

    out = objective(batch)
    out["loss"].backward()

    assert out["logits"].shape == (4, 5) and torch.isfinite(out["loss"])
    for name, param in objective.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    assert objective.no_weight_decay() == {"model.pos_embed", "model.cls_token"}


def test_model_without_head_is_refused():
    with pytest.raises(ValueError, match="num_classes is 0"):
        Classification(wide_vit(num_classes=0, global_pool="avg"))
