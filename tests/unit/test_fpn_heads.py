"""Panoptic FPN and VT-FPN on a timm ResNet: strides, shapes at any input size, gradients, the levels' exchange
through VT-FPN's shared transformer, and the hand-off of a ResNet's weights."""

from __future__ import annotations

import pytest
import timm
import torch

from core.export.handoff import load_encoder
from finetune.fpn_heads import VT_TOKENS, PanopticFPN, VisualTokenFPN
from finetune.seg_model import Segmentation, SegmentationModel

K = 5


def resnet18():
    return timm.create_model("resnet18", num_classes=0)


@pytest.mark.parametrize("head", ["fpn", "vt_fpn"])
def test_logits_at_the_input_size_and_every_parameter_gets_a_gradient(head):
    torch.manual_seed(0)
    objective = Segmentation(SegmentationModel(resnet18(), head, K, channels=32))
    batch = {"image": torch.randn(2, 3, 64, 64), "seg": torch.randint(0, K, (2, 64, 64))}
    out = objective(batch)
    assert out["logits"].shape == (2, K, 64, 64) and out["loss"].isfinite()
    assert out["loss"].item() == pytest.approx(torch.log(torch.tensor(K)).item(), abs=0.2)  # small first logits
    out["loss"].backward()
    # the residual branches of timm's ResNet start at zero (zero_init_last), so their gradients may be zero yet
    assert [n for n, p in objective.named_parameters() if p.grad is None] == []
    assert all(p.grad.any() for p in objective.model.head.parameters())
    logits = objective.eval()({"image": torch.randn(1, 3, 75, 93)})["logits"]  # not a multiple of 32
    assert logits.shape == (1, K, 75, 93)


def test_the_fpn_levels_are_the_stages_strides_at_one_width():
    stages = [torch.randn(1, c, 32 // 2**i, 32 // 2**i) for i, c in enumerate((8, 16, 24, 40))]
    for visual_tokens in (False, True):
        fpn = PanopticFPN([8, 16, 24, 40], 16, K, visual_tokens=visual_tokens)
        assert [tuple(p.shape) for p in fpn.forward_fpn(stages)] == [(1, 16, 32 // 2**i, 32 // 2**i) for i in range(4)]
        assert fpn(stages).shape == (1, K, 32, 32)  # stride 4 of a 128 px image


def test_vt_fpn_levels_exchange_information_through_one_transformer():
    torch.manual_seed(0)
    vt = VisualTokenFPN(16, 4).eval()
    maps = [torch.randn(1, 16, 16 // 2**i, 16 // 2**i) for i in range(4)]
    before = vt(maps)
    changed = vt([*maps[:3], maps[3] + 1.0])  # only the coarsest level's map moves
    assert not torch.allclose(changed[0], before[0])  # the finest level's output follows it
    tokens = [tok(m.flatten(2).transpose(1, 2), None) for tok, m in zip(vt.tokenizers, maps, strict=True)]
    tokens = torch.cat(tokens, dim=1)
    assert tokens.shape == (1, 4 * VT_TOKENS, 1024)  # 8 tokens of width 1024 per level (the VT paper's)


def test_a_resnet_export_hands_its_stages_to_the_segmentation_encoder(tmp_path):
    torch.manual_seed(0)
    source = timm.create_model("resnet18", num_classes=10)  # an ImageNet-style classifier
    torch.save(source.state_dict(), tmp_path / "resnet18.pth")
    encoder = resnet18()
    report = load_encoder(encoder, tmp_path / "resnet18.pth")
    assert torch.equal(encoder.layer4[1].conv2.weight, source.layer4[1].conv2.weight)
    assert report.dropped == ["fc.weight", "fc.bias"] and not report.initialised
    with pytest.raises(ValueError, match=r"layer1.0.conv1.weight: checkpoint \(64, 64, 3, 3\) vs model"):
        load_encoder(timm.create_model("resnet50", num_classes=0), tmp_path / "resnet18.pth")
