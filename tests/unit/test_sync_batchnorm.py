"""`synchronise_batchnorm` swaps every BatchNorm2d for the synchronised one without changing the model: same keys,
values, trainability and mode; in one process (no process group) it computes what BatchNorm2d does."""

from __future__ import annotations

import copy

import torch
from torch import nn

from core.engine.sync_batchnorm import SyncBatchNorm2d, synchronise_batchnorm
from core.models.vit import build_vit
from finetune.seg_model import SegmentationModel


def test_every_batchnorm_of_a_segmentation_model_is_swapped_and_its_state_kept():
    vit = build_vit("tiny", img_size=32, patch_size=4, embed_dim=32, depth=4, num_heads=2, num_classes=0)
    model = SegmentationModel(vit, "upernet", 5, channels=16)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(), m.num_batches_tracked.fill_(3)  # not the defaults
    model.head.classifier.weight.requires_grad_(False)
    plain = copy.deepcopy(model)
    synced = synchronise_batchnorm(model).eval()
    norms = [m for m in synced.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(norms) > 10 and all(type(m) is SyncBatchNorm2d for m in norms)
    expected, got = plain.state_dict(), synced.state_dict()
    assert list(got) == list(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    assert [p.requires_grad for p in synced.parameters()] == [p.requires_grad for p in plain.parameters()]
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(synced(x)[0], plain.eval()(x)[0])


def test_without_a_process_group_it_is_batchnorm_in_training_and_evaluation():
    plain = nn.BatchNorm2d(3, momentum=None).train()
    synced = synchronise_batchnorm(copy.deepcopy(plain))
    assert type(synced) is SyncBatchNorm2d and synced.training and synced.momentum is None
    for _ in range(3):
        x = torch.randn(4, 3, 6, 6) * 2 + 1
        torch.testing.assert_close(synced(x), plain(x))
    torch.testing.assert_close(synced.running_var, plain.running_var)
    x = torch.randn(4, 3, 6, 6)
    torch.testing.assert_close(synced.eval()(x), plain.eval()(x))
