"""ZeRO-3 construction: the objective is built inside `deepspeed.zero.Init`, so each rank allocates only its
partition of every parameter and the full fp32 model never exists on any rank.

zero.Init partitions a module's own parameters as soon as that module's `__init__` returns. Initialisation code that
runs later, in a parent's `__init__` (timm's ViT init, MAE's xavier init, a head init), would see empty tensors;
it runs inside `gathered(...)`, which lends it the full values of the parameters it touches, one module at a time,
and scatters rank 0's values back to every rank's partition. Outside ZeRO-3, `gathered` does nothing, so the same
code builds the ordinary model, value for value.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from timm.models import named_apply
from timm.models.vision_transformer import init_weights_vit_timm
from torch import nn


def is_partitioned(module: nn.Module) -> bool:
    """True when ZeRO-3 has converted `module`'s parameters (they carry a `ds_id`)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def partition_report(module: nn.Module) -> str:
    """How much of `module`'s parameters this rank holds, e.g. 'this rank holds 1,234 of 2,468 parameters (50.0%)'."""
    held = sum(p.ds_tensor.numel() for p in module.parameters())
    total = sum(p.ds_numel for p in module.parameters())
    return f"this rank holds {held:,} of {total:,} parameters ({100 * held / total:.1f}%)"


@contextlib.contextmanager
def gathered(params: Iterable[nn.Parameter]):
    """Full values of the ZeRO-3 partitioned `params` inside the block; rank 0's changes reach every rank on exit.
    Ordinary parameters are left alone."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0):
        yield


def init_partitioned_vit(vit: nn.Module) -> None:
    """Redo timm's per-module ViT initialisation (truncated-normal Linear weights, zero biases, norm resets) on a
    ViT built under zero.Init, where it found its sub-modules already partitioned. Its own tokens and position
    embedding were not yet partitioned when timm initialised them, so they are right already."""

    def init(module: nn.Module, name: str) -> None:
        own = list(module.parameters(recurse=hasattr(module, "init_weights")))  # init_weights may reach children
        with gathered(own):
            init_weights_vit_timm(module, name)

    named_apply(init, vit)


def build_partitioned(build: Callable[[], nn.Module], ds_config: dict) -> tuple[nn.Module, nn.Module]:
    """Build the objective under zero.Init, plus a twin on the meta device (no memory) that keeps every parameter's
    real shape, for code that reads shapes (timm's weight-decay and layer-decay grouping looks at `ndim`).

    Returns:
        (objective with partitioned fp32 parameters, meta-device layout with the same parameter names)
    """
    import deepspeed

    # No `dtype=`: DeepSpeed 0.19 ignores an explicit float32 on accelerators without fp16 (CPU) and picks bf16;
    # from the config it takes fp32 (our bf16 is autocast over fp32 weights) or fp16 with engine.precision fp16.
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        objective = build()
    with torch.device("meta"):
        layout = build()
    return objective, layout


@contextlib.contextmanager
def fp32_master_shared():
    """While DeepSpeed sets up its ZeRO-3 optimizer, let it use fp32 parameter partitions as their own master weights.

    DeepSpeed 0.19 means to skip the master copy when the partitions are already fp32 on the optimizer's device (our
    bf16 is autocast over fp32 weights), but it compares a `torch.device` with the device's *name*, a string, which is
    never equal. So it keeps a second fp32 copy: 4 bytes per parameter per rank, 0.6 GiB for MAE ViT-L on 2 ranks
    (`make bench-memory`). Inside this block the name is a `torch.device` while the master partitions are created.
    Partitions offloaded to the CPU or kept in fp16 still get their own master copy, as DeepSpeed intends.
    """
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    create = Stage3._create_fp32_partitions

    def create_sharing(self) -> None:
        name = self.device
        self.device = torch.device(name)
        try:
            create(self)
        finally:
            self.device = name

    Stage3._create_fp32_partitions = create_sharing
    try:
        yield
    finally:
        Stage3._create_fp32_partitions = create
