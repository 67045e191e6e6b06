"""ZeRO-3 construction: the objective is built inside `deepspeed.zero.Init`, so each rank allocates only its
partition of every parameter and the full fp32 model never exists on any rank.

zero.Init partitions a module's own parameters as soon as that module's `__init__` returns, so initialisation code
that runs later, in a parent's `__init__`, would see empty tensors. The objectives (pretrain/mae.py, beit.py) are
plain models that initialise their weights one module at a time through `Module.apply`, each call touching only that
module's own parameters; inside zero.Init, DeepSpeed wraps `apply` to lend each call the full values of the module's
parameters and to scatter rank 0's values back to every rank's partition (`ds_compat` patch `zero_init_apply`;
`deepspeed_config` sets `override_module_apply`). timm's ViT initialises its sub-modules by its own traversal
(`named_apply`), so `build_partitioned` has `init_partitioned_vit` redo that under `gathered` as the last step of the
ViT's own initialisation, before an objective's `__init__` goes on to initialise its own way (MAE re-initialises the
encoder). Outside zero.Init, `apply` and `gathered` change nothing: the same code builds the ordinary model.

zero.Init creates the parameters on the accelerator, where initialisation would draw from the device's generator
(CUDA's Philox, not the CPU's Mersenne Twister) while the ZeRO-0/1/2 build initialises on the CPU and moves the
weights: `_random_fills_on_cpu` has every draw of the build made on the CPU, so ZeRO-3 starts from the same weights
on a GPU as on a CPU, where tests/dist checks that ZeRO-3 trains to ZeRO-2's losses through the same code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import timm
import torch
from timm.layers import HybridEmbed
from timm.models import named_apply
from timm.models.vision_transformer import VisionTransformer, init_weights_vit_timm
from torch import nn

from core.compat.deepspeed import is_zero3_param


@contextlib.contextmanager
def gathered(params: Iterable[nn.Parameter]):
    """Full values of the ZeRO-3 partitioned `params` inside the block; rank 0's changes reach every rank on exit.
    Ordinary parameters are left alone."""
    partitioned = [p for p in params if is_zero3_param(p)]
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

    redone: list[nn.Module] = []
    # No `dtype=`: DeepSpeed 0.19 ignores an explicit float32 on accelerators without fp16 (CPU) and picks bf16;
    # from the config it takes fp32 (our bf16 is autocast over fp32 weights) or fp16 with engine.precision fp16.
    with (
        deepspeed.zero.Init(config_dict_or_path=ds_config),
        _vit_init_redone(redone),
        _hybrid_probe_gathered(),
        _random_fills_on_cpu(),
    ):
        objective = build()
    vits = [m for m in objective.modules() if isinstance(m, VisionTransformer)]
    if len(redone) != len(vits):
        raise RuntimeError(
            f"ZeRO-3 build: {len(vits)} timm VisionTransformer(s) built but {len(redone)} initialised through "
            f"VisionTransformer.init_weights (timm {timm.__version__}); its __init__ no longer ends with init_weights, "
            f"so their partitioned weights would keep DeepSpeed's placeholders"
        )
    with torch.device("meta"):
        layout = build()
    return objective, layout


# The in-place random fills behind torch.nn.init (kaiming/xavier uniform, normal, trunc_normal_) and timm's
# trunc_normal_ / lecun_normal_.
_RANDOM_FILLS = ("uniform_", "normal_")


@contextlib.contextmanager
def _random_fills_on_cpu():
    """Inside the block, `Tensor.uniform_` and `Tensor.normal_` draw into a new CPU tensor of the same shape and dtype
    (the CPU generator, as an ordinary build on the CPU draws) and copy the values into the tensor, on any device.

    On a CPU tensor that is what the fill itself does (same values, same generator advance), so CPU runs take exactly
    the path an accelerator's tensors take. fp16 at ZeRO-3 still differs: zero.Init creates fp16 parameters and the
    draws are made in fp16, where the ordinary build draws in fp32 and casts.
    """
    originals = {name: getattr(torch.Tensor, name) for name in _RANDOM_FILLS}

    def on_cpu(fill: Callable) -> Callable:
        def draw(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            # device= explicitly: inside zero.Init, torch.empty defaults to the accelerator.
            values = fill(torch.empty(self.shape, dtype=self.dtype, device="cpu"), *args, **kwargs)
            with torch.no_grad():
                return self.copy_(values)

        return draw

    for name, fill in originals.items():
        setattr(torch.Tensor, name, on_cpu(fill))
    try:
        yield
    finally:
        for name, fill in originals.items():
            setattr(torch.Tensor, name, fill)


@contextlib.contextmanager
def _vit_init_redone(redone: list[nn.Module]):
    """Inside the block, every timm ViT ends its own initialisation (`init_weights`, called at the end of its
    `__init__`) with `init_partitioned_vit`, and is appended to `redone`."""
    original = VisionTransformer.init_weights

    def init_weights(self: VisionTransformer, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        init_partitioned_vit(self)
        redone.append(self)

    VisionTransformer.init_weights = init_weights
    try:
        yield
    finally:
        VisionTransformer.init_weights = original


@contextlib.contextmanager
def _hybrid_probe_gathered():
    """Inside the block, timm's `HybridEmbed` sizes its token grid by running its ResNet backbone once on zeros while
    it is constructed, after the backbone was partitioned: the backbone's weights are gathered for that forward."""
    original = HybridEmbed._init_backbone

    def init_backbone(self: HybridEmbed, *args, **kwargs):
        with gathered(self.backbone.parameters()):
            return original(self, *args, **kwargs)

    HybridEmbed._init_backbone = init_backbone
    try:
        yield
    finally:
        HybridEmbed._init_backbone = original
