"""A module's full weights out of the engine (ZeRO-3 partitions gathered, fp16 runs' fp32 masters) or out of a saved
checkpoint of any ZeRO stage: what core/export/folder.py's `export_state_dict` then writes."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from core.compat import deepspeed as ds_compat
from core.engine.distributed import DistInfo
from core.engine.fp16 import fp32_master_weights, zero0_masters_from_checkpoint


def gather_state_dict(engine, module: nn.Module, dist: DistInfo) -> dict[str, torch.Tensor] | None:
    """Full fp32 CPU copy of `module`'s weights on rank 0 (None elsewhere); all ranks must call it (ZeRO-3 gathers,
    and fp16 runs read the optimizer's fp32 master weights, see fp16.py)."""
    if engine.zero_optimization_stage() == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            state = _cpu_copy(module) if dist.is_main else None
    else:
        state = _cpu_copy(module) if dist.is_main else None
    if engine.fp16_enabled():
        masters = fp32_master_weights(engine, module)
        if state is not None:
            state.update(masters)
    return state


def _cpu_copy(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}


def consolidated_state_dict(ckpt_dir: Path, tag: str, zero_stage: int) -> dict[str, torch.Tensor]:
    """fp32 weights of the whole objective from a DeepSpeed checkpoint, without starting any process group."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ds_compat.check("checkpoint_files", "zero0_fp16_masters")
    if zero_stage == 0:
        path = ckpt_dir / tag / ds_compat.MODEL_STATES_FILE
        states = torch.load(path, map_location="cpu", weights_only=False)
        weights = {k: v.float() for k, v in states["module"].items()}
        if ds_compat.checkpoint_fp32_groups(states) is not None:  # fp16: the module is the fp16 copy
            weights.update(zero0_masters_from_checkpoint(states, path))
        return weights
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
