"""What `engine.precision: fp16` needs beyond DeepSpeed 0.19: the fp32 weights for export. (Two gaps at ZeRO-0 are
closed elsewhere: the loop scales the loss itself where `engine.backward` does not, see `ds_compat` patch
`zero0_fp16_loss_scale`, and `setup.parallelize` vetoes the fp16 optimizer's step on zero gradients at start-up.)

DeepSpeed computes with an fp16 copy of every parameter and keeps the weights the optimizer updates in fp32: in the
ZeRO-1/2/3 partitions, or at ZeRO-0 in its fp16 optimizer's fp32 groups. An export made from the fp16 module would
round every weight to 11 significant bits, so exports read the fp32 copy. Parameters the optimizer does not hold
(frozen ones, e.g. MAE's fixed sin-cos `pos_embed`) have no fp32 copy and keep the value the run computed with.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from core.compat.deepspeed import checkpoint_fp32_groups, full_shape, zero0_groups

MASTER_NAMES = "fp32_master_names"
"""Client-state key of a ZeRO-0 fp16 checkpoint: the parameter names of each of the optimizer's fp32 groups."""


def fp32_master_weights(engine, module: nn.Module) -> dict[str, torch.Tensor]:
    """Full fp32 CPU copies of `module`'s trainable parameters from the optimizer of an fp16 engine.

    Collective at ZeRO-1/2/3 (each rank holds a partition): every rank must call it, in the same order.
    """
    if engine.zero_optimization_stage() == 0:
        groups = zip(zero0_master_names(engine, module), zero0_groups(engine)[1], strict=True)
        return {
            name: p32.detach().cpu().clone()
            for names, group32 in groups
            for name, p32 in zip(names, group32, strict=True)
            if name is not None
        }
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for name, param in module.named_parameters():
        full = safe_get_full_fp32_param(param) if param.requires_grad else None
        if full is not None:
            out[name] = full.detach().float().cpu().reshape(full_shape(param)).clone()
    return out


def zero0_master_names(engine, module: nn.Module | None = None) -> list[list[str | None]]:
    """The names in `module` (default: the engine's whole module, as its checkpoints save them under `MASTER_NAMES`)
    of each fp32 group's parameters of a ZeRO-0 fp16 engine; None for a parameter outside `module`."""
    names = {id(p): name for name, p in (module or engine.module).named_parameters()}
    return [[names.get(id(p)) for p in group] for group in zero0_groups(engine)[0]]


def zero0_masters_from_checkpoint(states: dict, source: Path) -> dict[str, torch.Tensor]:
    """The fp32 master weights in the model states of a ZeRO-0 fp16 checkpoint (`source`), by parameter name.

    Raises:
        ValueError: The checkpoint does not name its fp32 groups.
    """
    groups = checkpoint_fp32_groups(states)
    names = states.get(MASTER_NAMES)
    if names is None:
        raise ValueError(f"{source}: an fp16 ZeRO-0 checkpoint without {MASTER_NAMES}, so its fp32 weights are unnamed")
    return {
        name: p.float()
        for group_names, group in zip(names, groups, strict=True)
        for name, p in zip(group_names, group, strict=True)
    }
