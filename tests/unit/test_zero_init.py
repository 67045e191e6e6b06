"""The hook by which a ZeRO-3 build redoes timm's ViT initialisation (core/engine/zero_init.py), and its self-check.
The partitioned build itself is covered in tests/dist/test_zero_init_dist.py."""

from __future__ import annotations

import contextlib

import deepspeed
import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

from core.engine import zero_init
from core.models.vit import build_vit

TINY = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2)


def test_every_vit_built_in_the_block_is_redone_once_and_timm_is_restored_after():
    original = VisionTransformer.init_weights
    redone = []
    with zero_init._vit_init_redone(redone):
        plain = build_vit("tiny", **TINY)
        distilled = build_vit("tiny", distilled=True, **TINY)  # DeiT's init_weights reaches the ViT's via super()
    assert redone == [plain, distilled]
    assert VisionTransformer.init_weights is original
    build_vit("tiny", **TINY)
    assert len(redone) == 2


def test_build_partitioned_names_timm_when_a_vit_skipped_init_weights(monkeypatch):
    """Stand-in for a timm whose ViT no longer initialises through `init_weights`: the build stops, naming it."""
    monkeypatch.setattr(deepspeed.zero, "Init", lambda **kwargs: contextlib.nullcontext())
    with pytest.raises(RuntimeError, match=r"1 timm VisionTransformer\(s\) built but 0 initialised .*timm 1\."):
        zero_init.build_partitioned(lambda: build_vit("tiny", weight_init="skip", **TINY), ds_config={})


def test_initialisation_draws_on_the_cpu_whatever_device_the_tensor_is_on(monkeypatch):
    """Inside the block, a fill of a tensor on another device (meta stands in for the GPU, and torch.empty defaults
    to it, as zero.Init makes it default to the accelerator) draws from the CPU generator what the same fill of a CPU
    tensor draws; a build on the CPU gets the plain build's values and leaves the generator where it does."""

    def fills(tensor: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(1)
        tensor.uniform_(-1, 1)
        tensor.normal_(0, 0.02)
        return torch.rand(4)  # where the fills left the CPU generator

    on_cpu = fills(torch.empty(3, 5))
    assert not torch.equal(fills(torch.empty(3, 5, device="meta")), on_cpu)  # a plain meta fill draws nothing here
    torch.manual_seed(0)
    plain, plain_next = build_vit("tiny", **TINY), torch.rand(4)
    torch.manual_seed(0)
    with zero_init._random_fills_on_cpu():
        redirected, redirected_next = build_vit("tiny", **TINY), torch.rand(4)
        empty = torch.empty
        monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **{**k, "device": k.get("device") or "meta"}))
        assert torch.equal(fills(torch.empty(3, 5)), on_cpu)
    assert all(torch.equal(p, r) for p, r in zip(plain.parameters(), redirected.parameters(), strict=True))
    assert torch.equal(plain_next, redirected_next)
    assert "draw" not in torch.Tensor.uniform_.__qualname__  # restored
