"""Optimizer parameter groups: weight-decay exclusions and layer-wise lr decay through timm's group matcher."""

import pytest
import torch

from core.engine.distributed import DistInfo
from core.engine.setup import GuardedAdamW, build_optimizer, parallelize, set_attention
from core.recipe.config import load_config
from finetune.classification import Classification
from tests.helpers.models import tiny_vit


def _groups_by_name(objective, optimizer) -> dict[str, dict]:
    """Parameter name -> the param group holding it."""
    by_id = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    return {name: by_id[id(p)] for name, p in objective.named_parameters()}


def _classifier() -> Classification:
    """A 3-block tiny ViT with a 5-class head: enough blocks for three distinct layer-decay depths."""
    return Classification(tiny_vit(depth=3, num_classes=5, global_pool="avg").train())


def test_layer_decay_scales_lr_by_depth():
    objective = _classifier()
    cfg = load_config(None, ["stage=finetune", "optim.layer_decay=0.5", "optim.weight_decay=0.1"])
    groups = _groups_by_name(objective, build_optimizer(objective, cfg))
    # 3 blocks: embeddings are layer 0, block i is layer i + 1, final norm and head the top layer 4 (scale 1).
    assert groups["model.pos_embed"]["lr_scale"] == 0.5**4
    assert groups["model.patch_embed.proj.weight"]["lr_scale"] == 0.5**4
    for i in range(3):
        assert groups[f"model.blocks.{i}.attn.qkv.weight"]["lr_scale"] == 0.5 ** (3 - i)
    assert groups["model.fc_norm.weight"]["lr_scale"] == 1.0
    assert groups["model.head.weight"]["lr_scale"] == 1.0
    # weight decay: none on 1-d tensors and timm's no_weight_decay names, the recipe's value elsewhere
    assert groups["model.pos_embed"]["weight_decay"] == 0.0
    assert groups["model.blocks.0.attn.qkv.bias"]["weight_decay"] == 0.0
    assert groups["model.blocks.0.attn.qkv.weight"]["weight_decay"] == 0.1
    assert groups["model.head.weight"]["weight_decay"] == 0.1


def test_no_layer_decay_means_one_lr():
    objective = _classifier()
    cfg = load_config(None, ["stage=finetune"])
    optimizer = build_optimizer(objective, cfg)
    assert all(g.get("lr_scale", 1.0) == 1.0 for g in optimizer.param_groups)
    assert len(optimizer.param_groups) == 2  # decay and no-decay


def test_attention_kernels_agree_and_auto_picks_by_device():
    objective = _classifier()
    images = torch.randn(2, 3, 16, 16)
    assert set_attention(objective, "sdpa", torch.device("cpu")) == "sdpa"
    fused = objective.model(images)
    assert set_attention(objective, "auto", torch.device("cpu")) == "math"
    assert not any(block.attn.fused_attn for block in objective.model.blocks)
    torch.testing.assert_close(objective.model(images), fused, rtol=1e-5, atol=1e-5)
    assert set_attention(objective, "auto", torch.device("cuda")) == "sdpa"
    assert all(block.attn.fused_attn for block in objective.model.blocks)


def test_guard_covers_every_step_call_of_one_engine_step():
    """ZeRO-1/2 call the optimizer once per param group inside one engine step; the guard must hold for all."""
    torch.manual_seed(0)
    weight, bias = torch.nn.Parameter(torch.randn(3, 3)), torch.nn.Parameter(torch.randn(3))
    optimizer = GuardedAdamW([{"params": [weight]}, {"params": [bias]}], lr=0.1, fused=True)
    weight.grad, bias.grad = torch.full((3, 3), 2.0), torch.full((3,), 1.0)
    before = [weight.detach().clone(), bias.detach().clone()]

    def deepspeed_like_step():
        groups = optimizer.param_groups
        for group in groups:  # what DeepSpeed's stage_1_and_2 `_optimizer_step(i)` does
            optimizer.param_groups = [group]
            optimizer.step()
        optimizer.param_groups = groups

    with optimizer.guard(skip=torch.ones(())):
        deepspeed_like_step()
    assert torch.equal(weight, before[0]) and torch.equal(bias, before[1])
    assert all(float(s["step"]) == 0 for s in optimizer.state.values())  # the fused kernel's state, no step counted
    assert optimizer.grad_sq_norm.item() == 9 * 4.0 + 3 * 1.0  # both groups measured
    assert optimizer.nonfinite.item() == 0.0
    with optimizer.guard(skip=False):
        deepspeed_like_step()
    assert not torch.equal(weight, before[0]) and not torch.equal(bias, before[1])
    assert not optimizer.skip


@pytest.mark.parametrize("fused", [True, False])
def test_nonfinite_gradients_under_a_finite_loss_skip_this_and_every_later_call(fused):
    """A NaN in the first group's gradients (a finite loss) skips both groups' updates: no weight moves, no step is
    counted."""
    torch.manual_seed(0)
    weight, bias = torch.nn.Parameter(torch.randn(3, 3)), torch.nn.Parameter(torch.randn(3))
    optimizer = GuardedAdamW([{"params": [weight]}, {"params": [bias]}], lr=0.1, fused=fused)
    before = [weight.detach().clone(), bias.detach().clone()]
    weight.grad, bias.grad = torch.full((3, 3), float("nan")), torch.full((3,), 1.0)
    groups = optimizer.param_groups
    with optimizer.guard(skip=torch.zeros(())):
        for group in groups:  # as DeepSpeed's ZeRO-1/2 step them, one group per call
            optimizer.param_groups = [group]
            optimizer.step()
    optimizer.param_groups = groups
    assert optimizer.nonfinite.item() == 1.0 and not torch.isfinite(optimizer.grad_sq_norm)
    assert torch.equal(weight, before[0]) and torch.equal(bias, before[1])
    assert all(not s or float(s["step"]) == 0 for s in optimizer.state.values())


def test_fp16_is_refused_where_deepspeed_has_no_fp16(tmp_path):
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().is_fp16_supported():
        pytest.skip("this machine's DeepSpeed accelerator has fp16")
    cfg = load_config(None, ["engine.precision=fp16", f"run_dir={tmp_path}"])
    dist = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="engine.precision fp16: DeepSpeed's cpu accelerator has no fp16"):
        parallelize(torch.nn.Linear(2, 2), cfg=cfg, dist=dist, run_dir=tmp_path)
    assert not (tmp_path / "deepspeed.json").exists()  # refused before anything was written
