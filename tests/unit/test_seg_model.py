"""Segmentation heads and objective: shapes at every stride, gradients, the loss's ignored pixels, layer decay, and
sliding-window prediction."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from timm.optim import param_groups_layer_decay

from core.engine.distributed import DistInfo
from core.models.t2t_vit import T2TViT
from core.models.vit import build_vit
from core.report.pictures import class_colours, colour_mask
from data.device import normalisation
from data.segmentation import IGNORE_INDEX
from finetune.seg_evaluate import evaluate_segmentation, predict, segmentation_picture, window_boxes
from finetune.seg_heads import ViTPyramid
from finetune.seg_model import Segmentation, SegmentationModel, pyramid_blocks, token_stride

K = 5


def tiny_vit(**kwargs):
    return build_vit("tiny", img_size=32, patch_size=4, embed_dim=32, depth=4, num_heads=2, num_classes=0, **kwargs)


def test_pyramid_reads_blocks_4_6_8_12_of_a_depth_12_vit():
    assert pyramid_blocks(12) == [3, 5, 7, 11]
    assert pyramid_blocks(24) == [7, 11, 15, 23]
    assert pyramid_blocks(2) == [0, 0, 0, 1]


@pytest.mark.parametrize(("patch", "grid"), [(16, 14), (4, 56), (8, 28)])
def test_vit_pyramid_gives_strides_4_8_16_32_of_the_image_whatever_the_patch(patch, grid):
    maps = [torch.randn(2, 8, grid, grid) for _ in range(4)]
    shapes = [tuple(m.shape) for m in ViTPyramid(8, patch)(maps)]
    assert shapes == [(2, 8, 56, 56), (2, 8, 28, 28), (2, 8, 14, 14), (2, 8, 7, 7)]  # a 224 px image


def test_token_stride_of_each_encoder():
    assert token_stride(tiny_vit()) == 4
    t2t = T2TViT(img_size=64, num_classes=0, embed_dim=32, depth=1, num_heads=2, token_dim=8, t2t_kind="transformer")
    assert token_stride(t2t) == 16
    hybrid = build_vit("tiny", img_size=64, patch_size=1, num_classes=0, hybrid_backbone="resnet_stem", embed_dim=32,
                       depth=1, num_heads=2)  # fmt: skip
    assert token_stride(hybrid) == 4


@pytest.mark.parametrize("head", ["upernet", "linear"])
def test_logits_come_at_the_input_size_and_every_trainable_parameter_gets_a_gradient(head):
    torch.manual_seed(0)
    objective = Segmentation(SegmentationModel(tiny_vit(), head, K, channels=16))
    batch = {"image": torch.randn(2, 3, 32, 32), "seg": torch.randint(0, K, (2, 32, 32))}
    out = objective(batch)
    assert out["logits"].shape == (2, K, 32, 32) and out["loss"].isfinite()
    out["loss"].backward()
    missing = [n for n, p in objective.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]
    assert missing == []
    objective.eval()
    logits, aux = objective.model(batch["image"])
    assert aux is None and logits.shape == (2, K, 32, 32)  # the auxiliary head trains only


def test_t2t_vit_feeds_upernet_through_its_forward_intermediates():
    torch.manual_seed(0)
    t2t = T2TViT(img_size=32, num_classes=0, embed_dim=32, depth=3, num_heads=2, token_dim=8, t2t_kind="transformer")
    image = torch.randn(2, 3, 32, 32)
    (last,) = t2t.forward_intermediates(image, [2], norm=True, output_fmt="NLC")
    assert torch.allclose(last, t2t.forward_features(image)[:, 1:], atol=1e-6)
    maps = t2t.forward_intermediates(image, [0, 2])
    assert [tuple(m.shape) for m in maps] == [(2, 32, 2, 2), (2, 32, 2, 2)]  # T2T's stride 16
    out = Segmentation(SegmentationModel(t2t, "upernet", K, channels=16))({"image": image})
    assert out["logits"].shape == (2, K, 32, 32) and "loss" not in out


def test_ignored_pixels_add_nothing_to_the_loss_or_its_gradient():
    torch.manual_seed(0)
    objective = Segmentation(SegmentationModel(tiny_vit(), "linear", K))
    image = torch.randn(1, 3, 32, 32)
    seg = torch.full((1, 32, 32), IGNORE_INDEX)
    seg[0, :8, :8] = 2
    out = objective({"image": image, "seg": seg})
    expected = F.cross_entropy(out["logits"][0, :, :8, :8].reshape(K, -1).T, torch.full((64,), 2))
    assert torch.allclose(out["loss"], expected, atol=1e-6)
    other = seg.clone()
    other[0, 16:, 16:] = IGNORE_INDEX  # already ignored: nothing changes
    assert torch.equal(objective({"image": image, "seg": other})["loss"], out["loss"])


def test_a_frozen_encoder_trains_the_head_alone():
    objective = Segmentation(SegmentationModel(tiny_vit(), "linear", K), freeze_encoder=True)
    trainable = {n for n, p in objective.named_parameters() if p.requires_grad}
    assert trainable == {"model.head.norm.weight", "model.head.norm.bias", "model.head.classifier.weight",
                         "model.head.classifier.bias"}  # fmt: skip


def test_layer_decay_scales_the_encoder_by_depth_and_leaves_the_heads_at_the_full_rate():
    objective = Segmentation(SegmentationModel(tiny_vit(), "upernet", K, channels=16))
    groups = param_groups_layer_decay(
        objective, weight_decay=0.05, layer_decay=0.5, no_weight_decay_list=objective.no_weight_decay()
    )
    names = {id(p): name for name, p in objective.named_parameters()}
    scale = {names[id(p)]: g["lr_scale"] for g in groups for p in g["params"]}
    assert scale["model.head.classifier.weight"] == scale["model.aux_head.conv.0.weight"] == 1.0
    assert scale["model.encoder.blocks.3.attn.qkv.weight"] == 0.5  # 4 blocks: block 3 is one layer below the top
    assert scale["model.encoder.patch_embed.proj.weight"] == 0.5**5
    no_decay = {names[id(p)] for g in groups if g["weight_decay"] == 0 for p in g["params"]}
    assert "model.encoder.pos_embed" in no_decay and "model.encoder.cls_token" in no_decay


def test_sliding_windows_cover_the_image_and_end_flush_with_its_edges():
    assert window_boxes((10, 10), (4, 4), (3, 3)) == [(t, left) for t in (0, 3, 6) for left in (0, 3, 6)]
    assert window_boxes((4, 4), (4, 4), (3, 3)) == [(0, 0)]
    assert window_boxes((11, 4), (4, 4), (3, 3)) == [(0, 0), (3, 0), (6, 0), (7, 0)]


class _Pointwise(torch.nn.Module):
    """A per-pixel model: its logits at a pixel depend on that pixel only, wherever the window lies."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, K, 1)

    def forward(self, batch):
        return {"logits": self.conv(batch["image"])}


def test_sliding_prediction_of_a_per_pixel_model_equals_its_whole_image_prediction():
    torch.manual_seed(0)
    model = _Pointwise()
    image = torch.randn(1, 3, 13, 22)
    whole = predict(model, image, (8, 8), None)
    slid = predict(model, image, (8, 8), (5, 5))
    assert slid.shape == (1, K, 13, 22) and torch.allclose(slid, whole, atol=1e-6)
    small = torch.randn(1, 3, 5, 6)  # smaller than the crop: padded, then cut back
    assert torch.allclose(predict(model, small, (8, 8), (5, 5)), model({"image": small})["logits"], atol=1e-6)


class _ColourEngine:
    """Stands in for the engine: class k wherever the image's red channel is the highest, 0 elsewhere (logits from
    the pixels alone, so any window gives the same)."""

    def __init__(self):
        self.training = True

    def __call__(self, batch):
        red = batch["image"][:, :1]  # (N, 1, h, w)
        return {"logits": torch.cat([-red, red, torch.zeros_like(red)], dim=1)}

    def eval(self):
        self.training = False

    def train(self):
        self.training = True


def test_evaluation_scores_every_pixel_at_the_masks_size_and_keeps_examples_for_the_picture():
    """An 8x8 image, red on its left half, scored against an 8x8 mask and a 16x16 one (logits resized to it)."""
    dist = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    image = torch.zeros(1, 3, 8, 8, dtype=torch.uint8)
    image[:, 0, :, :4] = 255
    same = torch.zeros(1, 8, 8, dtype=torch.int64)
    same[:, :, :4] = 1
    larger = torch.full((1, 16, 16), 2, dtype=torch.int64)  # class 2: never predicted
    same[:, 0, 0] = larger[:, 0, 0] = IGNORE_INDEX
    unit = normalisation((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))  # x / 255
    batches = [{"image": image, "seg": seg, "normalise": {"image": unit}} for seg in (same, larger)]
    result = evaluate_segmentation(
        _ColourEngine(), batches, dist=dist, precision="fp32", num_classes=3, crop=(8, 8), keep=1
    )
    assert result.metrics["val/images"] == 2.0
    # 8x8: exact. 16x16: the bilinear resize keeps red (class 1) over columns 0-8 (144 pixels less the ignored
    # one), ties at 0 go to class 0 (112).
    assert result.confusion.tolist() == [[32, 0, 0], [0, 31, 0], [112, 143, 0]]
    assert result.metrics["val/miou"] == pytest.approx((32 / 144 + 31 / 174 + 0 / 255) / 3)  # TP / union
    assert len(result.examples) == 1 and result.examples[0][0].dtype == torch.uint8
    picture = segmentation_picture(result.examples, ["a", "b", "c"], [0, 1, 2])
    assert picture.shape[0] == 3 and picture.min() >= 0.0 and picture.max() <= 1.0


def test_class_colours_are_distinct_and_ignored_pixels_white():
    colours = class_colours(150)
    assert colours.shape == (151, 3) and len({tuple(c) for c in colours.tolist()}) == 151
    assert colours[-1].tolist() == [255, 255, 255]
    ids = torch.tensor([[0, 1], [IGNORE_INDEX, 7]])
    painted = colour_mask(ids, class_colours(3), IGNORE_INDEX)
    assert painted[:, 1, 0].tolist() == painted[:, 1, 1].tolist() == [255, 255, 255]  # ignored, out of range
    assert painted[:, 0, 0].tolist() == class_colours(3)[0].tolist()
